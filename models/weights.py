"""How each compiled parameter is made from checkpoint tensors (Hugging Face names).

The plan is written into manifest.json, so the runtime binds weights by following it
and never needs this module: each entry names its source tensors and one transform
from the runtime's registry (vtool.runtime.transforms).
"""
from __future__ import annotations

from typing import Any, Iterable

from vtool import VtoolError
from vtool.models.config import ModelConfig

# Fused compiled parameter -> the HF projections concatenated (along the output rows) into it.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class WeightPlanError(VtoolError):
    """The checkpoint does not provide what the config says the model needs."""


def plan_parameters(named_params: Iterable[tuple[str, Any]]) -> list[dict[str, Any]]:
    """One manifest entry per compiled parameter, in the order the library expects them."""
    plan = []
    for name, param in named_params:
        shape = [int(x) for x in param.shape]
        entry = {"name": name, "shape": shape, "dtype": str(param.dtype), "transform": "identity", "sources": [name]}
        for fused, parts in FUSED.items():
            marker = f".{fused}."
            if marker in name:
                prefix, suffix = name.split(marker)
                entry["transform"] = "concat_rows"
                entry["sources"] = [f"{prefix}.{part}.{suffix}" for part in parts]
        plan.append(entry)
    return plan


def expected_source_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape the config implies for each HF tensor name; used to refuse a checkpoint
    that disagrees with its own config before anything is compiled or bound."""
    h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes[p + "self_attn.q_proj.weight"] = (c.num_attention_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (c.num_key_value_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (c.num_key_value_heads * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, c.num_attention_heads * d)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.num_attention_heads * d,)
            shapes[p + "self_attn.k_proj.bias"] = (c.num_key_value_heads * d,)
            shapes[p + "self_attn.v_proj.bias"] = (c.num_key_value_heads * d,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    return shapes


def check_checkpoint_shapes(c: ModelConfig, available: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse a missing tensor or a tensor whose shape disagrees with the config, by name."""
    for name, want in expected_source_shapes(c).items():
        if name not in available:
            raise WeightPlanError(f"{where}: missing tensor {name!r} (the config needs it with shape {list(want)})")
        got = tuple(available[name])
        if got != want:
            raise WeightPlanError(
                f"{where}: tensor {name!r} has shape {list(got)} but the config implies {list(want)}"
            )
