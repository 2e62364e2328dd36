"""Qwen2: Llama's family with a bias on the q, k and v projections (ModelConfig.attention_bias).

A config with use_sliding_window attends over the last sliding_window tokens in its layers from
max_window_layers on (transformers' layer_types), on the KV cache's per-layer "mha_sliding"
layers as Gemma's (ModelConfig.sliding_window, sliding_layers; models/decoder.py)."""
from __future__ import annotations

import dataclasses
from typing import Any

from vtool.models import llama
from vtool.models.config import ModelConfig, parse_decoder


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    c = parse_decoder(cfg, arch, attention_bias=True)
    window = int(cfg.get("sliding_window") or 0) if cfg.get("use_sliding_window") else 0
    if not window:
        return c
    first = int(cfg.get("max_window_layers", 0) or 0)
    types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                       for i in range(c.num_hidden_layers)]
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return dataclasses.replace(c, sliding_window=window, sliding_layers=sliding) if sliding else c


FAMILY = dataclasses.replace(llama.FAMILY, name="qwen2", architectures=("Qwen2ForCausalLM",), normalize=normalize,
                             gguf_architecture="qwen2")
