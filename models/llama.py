"""Llama: LlamaForCausalLM (SmolLM2's too) and MistralForCausalLM checkpoints.

config   models/config.py parse_decoder; Mistral's context is capped to its sliding window
         (sliding-window attention only differs past the window)
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


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    c = parse_decoder(cfg, arch)
    if arch == "MistralForCausalLM" and cfg.get("sliding_window"):
        c = dataclasses.replace(c, max_position_embeddings=min(c.max_position_embeddings, int(cfg["sliding_window"])))
    return c


def module(c: ModelConfig, dtype: str, target: Any, formats: Mapping[str, str] | None = None,
           **int8: Any) -> Any:
    """The decoder; `int8`: its int8_activations and int8_kernels."""
    from vtool.models.decoder import DecoderForCausalLM  # TVM: only when a build exports the module

    return DecoderForCausalLM(c, dtype, target, formats, **int8)


FAMILY = ModelFamily(name="llama", architectures=("LlamaForCausalLM", "MistralForCausalLM"), normalize=normalize,
                     module=module, weights=DECODER_WEIGHTS, gguf_architecture="llama")
