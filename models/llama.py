"""Llama: LlamaForCausalLM (SmolLM2's too) and MistralForCausalLM checkpoints.

config   models/config.py parse_decoder; Mistral's sliding_window (when shorter than the context)
         makes every layer a sliding-window layer (ModelConfig.sliding_window, sliding_layers: the
         KV cache's per-layer "mha_sliding" layers, models/decoder.py), as Qwen2's and Gemma's
module   models/decoder.py DecoderForCausalLM (fused q|k|v and gate|up, TVM's paged KV cache)
weights  models/weights.py DECODER_WEIGHTS
GGUF     llama.cpp's "llama" (its converter permutes Q/K rows; the reader puts them back)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from vtool.models.config import ModelConfig, parse_decoder
from vtool.models.family import ModelFamily
from vtool.models.weights import DECODER_WEIGHTS


def every_layer_windowed(c: ModelConfig, window: Any) -> ModelConfig:
    """`c` with all its layers attending over the last `window` tokens (Mistral, Phi-3); as it
    was when there is no window or it covers the whole context (then it never masks a key)."""
    window = int(window or 0)
    if window <= 0 or window >= c.max_position_embeddings:
        return c
    return dataclasses.replace(c, sliding_window=window, sliding_layers=tuple(range(c.num_hidden_layers)))


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    c = parse_decoder(cfg, arch)
    return every_layer_windowed(c, cfg.get("sliding_window")) if arch == "MistralForCausalLM" else c


def module(c: ModelConfig, dtype: str, target: Any, formats: Mapping[str, str] | None = None,
           **int8: Any) -> Any:
    """The decoder; `int8`: its int8_activations and int8_kernels."""
    from vtool.models.decoder import DecoderForCausalLM  # TVM: only when a build exports the module

    return DecoderForCausalLM(c, dtype, target, formats, **int8)


FAMILY = ModelFamily(name="llama", architectures=("LlamaForCausalLM", "MistralForCausalLM"), normalize=normalize,
                     module=module, weights=DECODER_WEIGHTS, gguf_architecture="llama")
