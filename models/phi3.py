"""Phi-3 (Phi3ForCausalLM: Phi-3-mini/medium, 4k and 128k): the Llama decoder with q|k|v and
gate|up already fused in the checkpoint (self_attn.qkv_proj, mlp.gate_up_proj, gate rows first,
the order models/decoder.py splits them in), so its weights bind as they are stored.

config   models/config.py parse_decoder; the context is capped to `sliding_window` as for Mistral
         (Phi-3-mini-4k's 2047: sliding-window attention only differs past the window); Phi-3.5's
         and the 128k models' longrope scaling and Phi-4-mini's partial rotary factor are refused
         by name
module   models/decoder.py DecoderForCausalLM
weights  PHI3_WEIGHTS: DECODER_WEIGHTS's layout with fused sources
GGUF     llama.cpp's "phi3": attn_qkv and ffn_up (gate|up stacked) are the fused tensors as
         they are (runtime/weights/gguf_reader.py maps them); the sliding window from
         phi3.attention.sliding_window; longrope factor tensors refused
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from vtool.models import llama
from vtool.models.config import ConfigError, ModelConfig, parse_decoder
from vtool.models.weights import FUSED, WeightPlan, decoder_modules, decoder_source_shapes, plan_parameters


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    partial = cfg.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor {partial!r} is not supported (rotary embeddings over the whole "
                          "head only); Phi-4-mini uses 0.75")
    c = parse_decoder(cfg, arch)
    if cfg.get("sliding_window"):
        c = dataclasses.replace(c, max_position_embeddings=min(c.max_position_embeddings, int(cfg["sliding_window"])))
    return c


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
