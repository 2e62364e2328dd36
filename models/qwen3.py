"""Qwen3: Llama's family with an RMSNorm on each q and k head before RoPE (ModelConfig.qk_norm)."""
from __future__ import annotations

import dataclasses
from typing import Any

from vtool.models import llama
from vtool.models.config import ModelConfig, parse_decoder


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    return parse_decoder(cfg, arch, qk_norm=True)


FAMILY = dataclasses.replace(llama.FAMILY, name="qwen3", architectures=("Qwen3ForCausalLM",), normalize=normalize,
                             gguf_architecture="qwen3")
