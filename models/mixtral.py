"""Mixtral (MixtralForCausalLM: Mixtral-8x7B, 8x22B): Mistral's decoder with a mixture-of-experts
MLP in every layer; the router's top-k softmax weights are always renormalized to sum 1.

config   models/moe_weights.py parse_moe: num_local_experts, num_experts_per_tok, experts of
         intermediate_size; the context is capped to `sliding_window` as for Mistral
module   models/decoder.py DecoderForCausalLM, whose MoE layers are models/moe.py MoEMLP
weights  models/moe_weights.py moe_plan (block_sparse_moe.gate, block_sparse_moe.experts.N.w1/w3/w2)
GGUF     llama.cpp's "llama" with expert tensors (ffn_gate_inp, stacked ffn_{gate,up,down}_exps;
         llama.expert_count): runtime/weights/gguf_reader.py reads such a file as Mixtral
"""
from __future__ import annotations

import dataclasses
from typing import Any

from vtool.models import llama
from vtool.models.config import ModelConfig
from vtool.models.moe_weights import MIXTRAL_NAMES, moe_plan, parse_moe


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    c = parse_moe(cfg, arch, qk_norm=False, expert_size_key="intermediate_size", norm_topk_prob=True)
    if cfg.get("sliding_window"):
        c = dataclasses.replace(c, max_position_embeddings=min(c.max_position_embeddings, int(cfg["sliding_window"])))
    return c


# gguf_architecture None: its GGUF files are llama.cpp's "llama" (the Llama family's), told apart by
# their expert tensors in runtime/weights/gguf_reader.py.
FAMILY = dataclasses.replace(llama.FAMILY, name="mixtral", architectures=("MixtralForCausalLM",),
                             normalize=normalize, weights=moe_plan(MIXTRAL_NAMES), gguf_architecture=None)
