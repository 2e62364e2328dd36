"""OLMo-2 (Olmo2ForCausalLM): the Llama decoder with its norms moved after attention and after
the MLP (on each block's output, before the residual add; none before) and q and k each
RMS-normalized over all heads at once, before RoPE.

config   models/config.py parse_decoder, with qk_norm_full and post_norms set
module   models/decoder.py DecoderForCausalLM (ModelConfig.post_norms, qk_norm_full)
weights  models/weights.py DECODER_WEIGHTS (post_feedforward_layernorm, no input_layernorm)
GGUF     llama.cpp's "olmo2" (post_attention_norm, post_ffw_norm, attn_q_norm, attn_k_norm; no
         Q/K row permutation); OLMo-3's sliding window is not registered
"""
from __future__ import annotations

import dataclasses
from typing import Any

from vtool.models import llama
from vtool.models.config import ModelConfig, parse_decoder


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    return dataclasses.replace(parse_decoder(cfg, arch, qk_norm=True), qk_norm_full=True, post_norms=True)


FAMILY = dataclasses.replace(llama.FAMILY, name="olmo2", architectures=("Olmo2ForCausalLM",), normalize=normalize,
                             gguf_architecture="olmo2")
