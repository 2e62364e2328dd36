"""Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head
q/k RMSNorm) and a mixture-of-experts MLP in every layer but the dense ones decoder_sparse_step /
mlp_only_layers name (those keep an MLP of intermediate_size).

config   models/moe_weights.py parse_moe: num_experts (or num_local_experts), num_experts_per_tok,
         moe_intermediate_size, norm_topk_prob as config.json says
module   models/decoder.py DecoderForCausalLM, whose MoE layers are models/moe.py MoEMLP
weights  models/moe_weights.py moe_plan (mlp.gate, mlp.experts.N.{gate,up,down}_proj)
GGUF     llama.cpp's "qwen3moe" (ffn_gate_inp, stacked ffn_{gate,up,down}_exps; expert_count,
         expert_used_count, expert_feed_forward_length; norm_topk_prob from expert_weights_norm,
         true when absent as llama.cpp's qwen3moe graph always renormalizes)
"""
from __future__ import annotations

import dataclasses
from typing import Any

from vtool.models import llama
from vtool.models.config import ModelConfig
from vtool.models.moe_weights import QWEN3_MOE_NAMES, moe_plan, parse_moe


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    return parse_moe(cfg, arch, qk_norm=True, expert_size_key="moe_intermediate_size", norm_topk_prob=None)


# gguf_architecture None: the registry's GGUF checks hold a family's plan to gguf-py's per-tensor
# names, and llama.cpp stores experts stacked; runtime/weights/gguf_reader.py reads "qwen3moe" itself.
FAMILY = dataclasses.replace(llama.FAMILY, name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",),
                             normalize=normalize, weights=moe_plan(QWEN3_MOE_NAMES), gguf_architecture=None)
