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
sliding_layers; models/decoder.py), as Gemma's and Qwen2's. Its per-layer-type rope_parameters
must agree on one theta and no scaling (the KV cache rotates every layer alike): OLMo-3's
long-context yarn scaling of the global layers is refused by name. No GGUF mapping (llama.cpp's
"olmo3" is not registered).
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
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    if {"full_attention", "sliding_attention"} & set(params):  # transformers 5: per layer type
        kinds = {kind: params.get(kind) or {} for kind in ("full_attention", "sliding_attention")}
        for kind, p in kinds.items():
            if str(p.get("rope_type", p.get("type", "default"))) != "default":
                raise ConfigError(f"OLMo-3 rope_parameters[{kind!r}] type {p.get('rope_type', p.get('type'))!r} is "
                                  "not supported (its layers share one rotary embedding here); supported: default")
        thetas = {float(p.get("rope_theta", cfg.get("rope_theta", 10000.0))) for p in kinds.values()}
        if len(thetas) != 1:
            raise ConfigError(f"OLMo-3 rope_parameters with two rope_theta values {sorted(thetas)} are not supported")
        cfg = {**cfg, "rope_parameters": {"rope_theta": thetas.pop()}}
    c = normalize(cfg, arch)
    window = int(cfg.get("sliding_window") or 0)
    if window <= 0 or window >= c.max_position_embeddings:
        return c
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                       for i in range(c.num_hidden_layers)]
    if len(types) != c.num_hidden_layers:
        raise ConfigError(f"layer_types has {len(types)} entries for {c.num_hidden_layers} layers")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return dataclasses.replace(c, sliding_window=window, sliding_layers=sliding) if sliding else c


OLMO3 = dataclasses.replace(FAMILY, name="olmo3", architectures=("Olmo3ForCausalLM",), normalize=normalize_olmo3,
                            gguf_architecture=None)
