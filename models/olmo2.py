"""OLMo-2 (Olmo2ForCausalLM): the Llama decoder with its norms moved after attention and after
the MLP (on each block's output, before the residual add; none before) and q and k each
RMS-normalized over all heads at once, before RoPE.

config   models/config.py parse_decoder, with qk_norm_full and post_norms set
module   models/decoder.py DecoderForCausalLM (ModelConfig.post_norms, qk_norm_full)
weights  models/weights.py DECODER_WEIGHTS (post_feedforward_layernorm, no input_layernorm)
GGUF     llama.cpp's "olmo2" (post_attention_norm, post_ffw_norm, attn_q_norm, attn_k_norm; no
         Q/K row permutation)

OLMo-3 (Olmo3ForCausalLM, OLMO3 here): OLMo-2's layout with the layers of layer_types
"sliding_attention" (by default three in every four) attending over the last sliding_window
tokens, on the KV cache's per-layer "mha_sliding" layers (ModelConfig.sliding_window,
sliding_layers; models/decoder.py), as Gemma's and Qwen2's. Its rope parameters per layer type:
the full-attention layers may be scaled (the long-context models' yarn, models/rope.py) and the
sliding ones keep the default rope, with a theta of their own if given; then the model rotates
q and k itself (ModelConfig.model_rope, rope_local_theta on the sliding layers), as for Gemma-3.
No GGUF mapping (llama.cpp's "olmo3" is not registered).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from vtool.models import llama
from vtool.models.config import ConfigError, ModelConfig, parse_decoder


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    return dataclasses.replace(parse_decoder(cfg, arch, qk_norm=True), qk_norm_full=True, post_norms=True)


FAMILY = dataclasses.replace(llama.FAMILY, name="olmo2", architectures=("Olmo2ForCausalLM",), normalize=normalize,
                             gguf_architecture="olmo2")


def normalize_olmo3(cfg: dict[str, Any], arch: str) -> ModelConfig:
    full, sliding_params = _olmo3_rope(cfg)
    # transformers' Olmo3Config nests rope_parameters by layer type, where a top-level
    # original_max_position_embeddings is not read (standardize_rope_params' nested case)
    base = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_parameters",
                                                         "original_max_position_embeddings")}
    c = normalize(base | {"rope_parameters": full}, arch)
    local_theta = float(sliding_params["rope_theta"])
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                       for i in range(c.num_hidden_layers)]
    if len(types) != c.num_hidden_layers:
        raise ConfigError(f"layer_types has {len(types)} entries for {c.num_hidden_layers} layers")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    # Sliding layers rotate with their own, unscaled rope: the model applies it (models/rope.py)
    # when that differs from the global layers' (a scaling on them, or another theta).
    per_layer_rope = bool(sliding) and (bool(c.rope_scaling) or local_theta != c.rope_theta)
    if per_layer_rope:
        c = dataclasses.replace(c, model_rope=True, rope_local_theta=local_theta)
    if window <= 0 or window >= c.max_position_embeddings:
        if per_layer_rope:  # the layers would lose the type that picks their rope
            raise ConfigError("OLMo-3 with per-layer-type rope (rope scaling on the full-attention layers, or two "
                              "rope_theta values) needs a sliding_window shorter than max_position_embeddings")
        return c
    return dataclasses.replace(c, sliding_window=window, sliding_layers=sliding) if sliding else c


def _olmo3_rope(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """OLMo-3's rope parameters of the full-attention and the sliding layers, as transformers'
    Olmo3Config reads them: per layer type (transformers 5), or one dict (rope_parameters or
    transformers-4 rope_scaling) whose scaling goes to the full-attention layers only. The
    sliding layers' rope must be the default one."""
    theta = cfg.get("rope_theta", 10000.0)
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    if {"full_attention", "sliding_attention"} & set(params):  # transformers 5: per layer type
        kinds = {kind: dict(params.get(kind) or {}) for kind in ("full_attention", "sliding_attention")}
    else:
        flat = {**params, **(cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else {})}
        theta = flat.pop("rope_theta", theta)
        kinds = {"full_attention": flat, "sliding_attention": {}}
    for p in kinds.values():
        p.setdefault("rope_theta", theta)
    kind = str(kinds["sliding_attention"].get("rope_type", kinds["sliding_attention"].get("type", "default")))
    if kind != "default":
        raise ConfigError(f"OLMo-3 rope_parameters['sliding_attention'] type {kind!r} is not supported; "
                          "supported: default (transformers scales the full-attention layers only)")
    return kinds["full_attention"], kinds["sliding_attention"]


OLMO3 = dataclasses.replace(FAMILY, name="olmo3", architectures=("Olmo3ForCausalLM",), normalize=normalize_olmo3,
                            gguf_architecture=None)
