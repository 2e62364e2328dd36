"""Gemma-2 (Gemma2ForCausalLM) and Gemma-3 text (Gemma3ForCausalLM): the Llama decoder with
Gemma's differences as ModelConfig hooks.

config   parse_decoder plus: four norms per layer (sandwich_norms), GELU-tanh MLP, embeddings
         times sqrt(hidden), softmax scale query_pre_attn_scalar ** -0.5, final logit
         soft-capping (Gemma-2), per-head q/k RMSNorm (Gemma-3), sliding-window layers
         (Gemma-3: layer_types or sliding_window_pattern; Gemma-2: every other layer, the first
         sliding), RoPE in the model (rope_local_base_freq on the sliding layers, rope_theta and
         linear scaling on the global ones), attention logit soft-capping (Gemma-2's
         attn_logit_softcapping, applied inside every attention kernel: models/softcap.py).
         Refused by name: bidirectional attention on the causal architectures, other
         activations and rope types.
         use_bidirectional_attention (EmbeddingGemma) builds for Gemma3TextModel only, as an
         embedding model (models/gemma_encoder.py); its window is read as window // 2 + 1.
module   models/decoder.py DecoderForCausalLM; the KV cache built with a per-layer attention
         kind ("mha_sliding" for the windowed layers) and RopeMode.NONE
weights  DECODER_WEIGHTS's names; every RMSNorm weight w bound as 1 + w (the "plus_one"
         transform), since Gemma's RMSNorm scales by (1 + w)
GGUF     llama.cpp's "gemma2" / "gemma3": ffn_norm is the pre-feedforward norm; its converter
         stores norms as 1 + w, which runtime/weights/gguf_reader.py takes back to w
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

from vtool.models import llama
from vtool.models.config import ConfigError, ModelConfig, parse_decoder
from vtool.models.weights import DECODER_WEIGHTS, plan_parameters

BIDIRECTIONAL = ("Gemma3TextModel",)  # use_bidirectional_attention (EmbeddingGemma): GEMMA3_EMBED
ACTIVATIONS = ("gelu_pytorch_tanh",)  # transformers' name of the tanh approximation Gemma uses
ROPE_TYPES = ("default", "linear")


def _rope_params(cfg: dict[str, Any], arch: str) -> tuple[float, float, float]:
    """(global theta, local theta, global linear factor) from transformers-4 keys (rope_theta,
    rope_local_base_freq, rope_scaling) or transformers-5 rope_parameters (per layer type for Gemma-3)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        full = dict(params) or {"rope_theta": cfg.get("rope_theta", 10000.0)}
        if cfg.get("rope_scaling"):
            full.update(cfg["rope_scaling"])
        full.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        local = {"rope_theta": cfg.get("rope_local_base_freq", full["rope_theta"] if arch == "Gemma2ForCausalLM"
                                       else 10000.0)}
    for kind, p in (("full_attention", full), ("sliding_attention", local)):
        rope_type = str(p.get("rope_type", p.get("type", "default")))
        if rope_type not in ROPE_TYPES or (rope_type == "linear" and kind == "sliding_attention"):
            raise ConfigError(f"rope type {rope_type!r} on {kind} layers is not supported; supported: "
                              "default, and linear on the global layers")
    factor = float(full.get("factor", 1.0)) if str(full.get("rope_type", full.get("type"))) == "linear" else 1.0
    return float(full.get("rope_theta", 10000.0)), float(local.get("rope_theta", 10000.0)), factor


def sliding_layers(cfg: dict[str, Any], arch: str, layers: int) -> tuple[int, ...]:
    """The layers that attend over the sliding window, as transformers picks them."""
    types = cfg.get("layer_types")
    if types:
        if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ConfigError(f"config field 'layer_types' must name sliding_attention or full_attention for each "
                              f"of the {layers} layers, got {types!r}")
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if arch == "Gemma2ForCausalLM":
        return tuple(range(0, layers, 2))
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    return tuple(i for i in range(layers) if (i + 1) % pattern)


def _softcap(cfg: dict[str, Any], key: str) -> float:
    """A soft-cap field: a positive number, or null / 0 / absent for none."""
    value = cfg.get(key)
    if value is None or value == 0:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"config field {key!r} must be a positive number or null, got {value!r}")
    return float(value)


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    bidirectional = bool(cfg.get("use_bidirectional_attention"))
    if bidirectional and arch not in BIDIRECTIONAL:
        raise ConfigError(f"use_bidirectional_attention with {arch} is not supported; vtool builds it as an "
                          f"embedding model ({', '.join(BIDIRECTIONAL)}: models/gemma_encoder.py)")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ConfigError(f"hidden_activation {act!r} is not supported for Gemma; supported: {', '.join(ACTIVATIONS)}")
    theta, local_theta, factor = _rope_params(cfg, arch)
    base = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "hidden_act")}
    c = parse_decoder(base | {"rope_theta": theta}, arch, qk_norm=arch in ("Gemma3ForCausalLM", "Gemma3TextModel"))
    if c.attention_bias:
        raise ConfigError("attention_bias is not supported for Gemma (its checkpoints have none)")
    window = int(cfg.get("sliding_window") or 0)
    if bidirectional and window:  # as transformers' Gemma3TextConfig loads it: keys with |i - j| < window
        window = window // 2 + 1
    scalar = cfg.get("query_pre_attn_scalar") or c.head_dim
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ConfigError(f"config field 'query_pre_attn_scalar' must be a positive number, got {scalar!r}")
    return dataclasses.replace(
        c, sandwich_norms=True, norm_plus_one=True, mlp_act="gelu_tanh", embed_scale=True,
        attn_scale=float(scalar) ** -0.5,
        final_logit_softcap=_softcap(cfg, "final_logit_softcapping"),
        attn_logit_softcap=_softcap(cfg, "attn_logit_softcapping"), sliding_window=window,
        sliding_layers=sliding_layers(cfg, arch, c.num_hidden_layers) if window else (),
        model_rope=True, rope_local_theta=local_theta,
        rope_scaling={"rope_type": "linear", "factor": factor} if factor != 1.0 else None)


def _parameters(named_params: Iterable[tuple[str, Any]], formats: Mapping[str, str] | None = None
                ) -> list[dict[str, Any]]:
    """The decoder's plan, every RMSNorm weight made as 1 + w."""
    plan = plan_parameters(named_params, formats)
    for entry in plan:
        if entry["name"].endswith("norm.weight") and entry["transform"] == "identity":
            entry["transform"] = "plus_one"
    return plan


GEMMA_WEIGHTS = dataclasses.replace(DECODER_WEIGHTS, parameters=_parameters)

GEMMA2 = dataclasses.replace(llama.FAMILY, name="gemma2", architectures=("Gemma2ForCausalLM",), normalize=normalize,
                             weights=GEMMA_WEIGHTS, gguf_architecture="gemma2")
GEMMA3 = dataclasses.replace(llama.FAMILY, name="gemma3", architectures=("Gemma3ForCausalLM",), normalize=normalize,
                             weights=GEMMA_WEIGHTS, gguf_architecture="gemma3")
