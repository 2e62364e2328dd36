"""Phi-3 (Phi3ForCausalLM: Phi-3-mini/medium, 4k and 128k): the Llama decoder with q|k|v and
gate|up already fused in the checkpoint (self_attn.qkv_proj, mlp.gate_up_proj, gate rows first,
the order models/decoder.py splits them in), so its weights bind as they are stored.

config   models/config.py parse_decoder; `sliding_window` (Phi-3-mini-4k's 2047), when shorter
         than the context, makes every layer a sliding-window layer as Mistral's
         (models/llama.py every_layer_windowed). Phi-3.5's and the 128k models' longrope
         scaling is applied by the model (ModelConfig.model_rope, models/rope.py) with ONE set of
         factors per build: the long factors when the built context (max_position_embeddings)
         exceeds original_max_position_embeddings, else the short ones -- vLLM's rule
         (use_long_rope = max_model_len > original_max_position_embeddings), so that every key in
         the KV cache is rotated as every query. transformers instead switches per forward pass
         by the sequence's length, so a 128k model agrees with it on sequences longer than
         original_max_position_embeddings, and a model built for at most that on all. The
         attention factor sqrt(1 + ln(factor) / ln(original_max)), factor = max_position_embeddings
         / original_max (or the config's factor / attention_factor) scales cos and sin for both
         sets, as transformers. Phi-4-mini's partial rotary factor (0.75: RoPE over the first 96 of
         128 head dims) is models/config.py's rotary_dim, applied by the model
module   models/decoder.py DecoderForCausalLM
weights  PHI3_WEIGHTS: DECODER_WEIGHTS's layout with fused sources
GGUF     llama.cpp's "phi3": attn_qkv and ffn_up (gate|up stacked) are the fused tensors as
         they are (runtime/weights/gguf_reader.py maps them); the sliding window from
         phi3.attention.sliding_window; longrope factor tensors refused
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from vtool.models import llama
from vtool.models.config import ConfigError, ModelConfig, parse_decoder
from vtool.models.weights import FUSED, WeightPlan, decoder_modules, decoder_source_shapes, plan_parameters


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    scaling = _longrope(cfg)
    if scaling is not None:  # parse_decoder knows the KV cache's rope types only: the rest without it
        cfg = {**cfg, "rope_scaling": None, "rope_parameters": {"rope_theta": _theta(cfg)}}
    c = llama.every_layer_windowed(parse_decoder(cfg, arch), cfg.get("sliding_window"))
    if scaling is None:
        return c
    half = (c.rotary_dim or c.head_dim) // 2
    for key in ("short_factor", "long_factor"):
        if len(scaling[key]) != half:
            raise ConfigError(f"longrope {key} has {len(scaling[key])} values; the {2 * half} rotated dims "
                              f"(head_dim {c.head_dim}) need {half}")
    original = scaling["original_max_position_embeddings"]
    factor = scaling.pop("factor", None) or c.max_position_embeddings / original
    attention = scaling.get("attention_factor") or (
        1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
    scaling |= {"attention_factor": float(attention), "long": c.max_position_embeddings > original}
    return dataclasses.replace(c, rope_scaling=scaling, model_rope=True)


def _theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    return cfg.get("rope_theta", params.get("rope_theta", 10000.0))


def _longrope(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Phi-3's longrope scaling normalized (rope_type, short_factor, long_factor,
    original_max_position_embeddings, and factor / attention_factor when the config sets them),
    from transformers-4 rope_scaling (type "longrope" or its old name "su") or transformers-5
    rope_parameters; None for any other rope (parse_decoder judges it)."""
    scaling = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else None
    if scaling is None and isinstance(cfg.get("rope_parameters"), dict):
        scaling = cfg["rope_parameters"]
    if not scaling or str(scaling.get("rope_type", scaling.get("type"))) not in ("longrope", "su"):
        return None
    out: dict[str, Any] = {"rope_type": "longrope"}
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if not isinstance(values, (list, tuple)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in values):
            raise ConfigError(f"longrope scaling needs {key} as a list of positive numbers, got {values!r}")
        out[key] = [float(v) for v in values]
    original = scaling.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if isinstance(original, bool) or not isinstance(original, int) or original <= 1:
        raise ConfigError(f"longrope scaling needs original_max_position_embeddings > 1, got {original!r}")
    out["original_max_position_embeddings"] = original
    for key in ("factor", "attention_factor"):
        if scaling.get(key) is not None:
            value = scaling[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"longrope {key} must be a positive number, got {value!r}")
            out[key] = float(value)
    for key in ("short_mscale", "long_mscale"):  # Phi-3-small's: another attention factor per set
        if scaling.get(key) not in (None, 1, 1.0):
            raise ConfigError(f"longrope {key} {scaling[key]!r} is not supported")
    return out


def _fused_name(name: str) -> tuple[str, bool] | None:
    """(the fused module's tensor name, whether `name` is its first part) for a tensor of a
    FUSED module's part; None for any other tensor."""
    for fused, parts in FUSED.items():
        for i, part in enumerate(parts):
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), i == 0
    return None


def _source_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The decoder's, with each fused module's parts stacked into one tensor."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in decoder_source_shapes(c).items():
        fused = _fused_name(name)
        if fused is None:
            out[name] = shape
        elif fused[1]:
            out[fused[0]] = shape
        else:
            rows, *rest = out[fused[0]]
            out[fused[0]] = (rows + shape[0], *rest)
    return out


def _modules(c: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The decoder's, with a fused module made of its own stored weight."""
    return {module: sources if _fused_name(sources[0]) is None else (module + ".weight",)
            for module, sources in decoder_modules(c).items()}


PHI3_WEIGHTS = WeightPlan(parameters=functools.partial(plan_parameters, fused_sources={}),
                          source_shapes=_source_shapes, modules=_modules)

FAMILY = dataclasses.replace(llama.FAMILY, name="phi3", architectures=("Phi3ForCausalLM",), normalize=normalize,
                             weights=PHI3_WEIGHTS, gguf_architecture="phi3")
