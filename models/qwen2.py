"""Qwen2: Llama's family with a bias on the q, k and v projections (ModelConfig.attention_bias)."""
from __future__ import annotations

import dataclasses
from typing import Any

from vtool.models import llama
from vtool.models.config import ModelConfig, parse_decoder


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    return parse_decoder(cfg, arch, attention_bias=True)


FAMILY = dataclasses.replace(llama.FAMILY, name="qwen2", architectures=("Qwen2ForCausalLM",), normalize=normalize,
                             gguf_architecture="qwen2")
