"""Mixture-of-experts families' config normalisation and weight plan (pure Python: the registry
loads it without TVM; the module is models/moe.py).

config   parse_moe: the Llama decoder's fields plus num_experts, num_experts_per_tok,
         moe_intermediate_size, norm_topk_prob and the layers that keep a dense MLP
         (Qwen3-MoE's decoder_sparse_step / mlp_only_layers); shared experts are refused by name
weights  moe_plan: each MoE layer's router (`<block>.gate.weight`, [E, H]) and its experts'
         per-expert HF tensors stacked at load into two parameters, `mlp.experts.gate_up_proj`
         [E, 2I, H] (transform stack_gate_up_experts: expert e's gate rows then its up rows) and
         `mlp.experts.down_proj` [E, H, I] (transform stack_experts). A GGUF file's stacked
         ffn_{gate,up,down}_exps are read as the same per-expert names
         (runtime/weights/gguf_reader.py), so one plan serves both.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Mapping

from vtool.models.config import ConfigError, ModelConfig, parse_decoder
from vtool.models.weights import WeightPlan, decoder_modules, decoder_source_shapes, plan_parameters

# compiled parameter names of a MoE layer (models/moe.py), under model.layers.N.
ROUTER = "mlp.gate.weight"
GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"
_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@dataclasses.dataclass(frozen=True)
class ExpertNames:
    """How a family's HF checkpoint names a MoE layer's tensors, under model.layers.N."""

    block: str  # "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    gate: str  # an expert's gate projection: "gate_proj" / "w1"
    up: str  # "up_proj" / "w3"
    down: str  # "down_proj" / "w2"

    def router(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.block}.gate.weight"

    def expert(self, layer: int, e: int, part: str) -> str:
        return f"model.layers.{layer}.{self.block}.experts.{e}.{part}.weight"


QWEN3_MOE_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")


def _int(cfg: dict[str, Any], key: str, default: Any = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"config field {key!r} must be a positive integer, got {v!r}")
    return v


def parse_moe(cfg: dict[str, Any], arch: str, *, qk_norm: bool, expert_size_key: str,
              norm_topk_prob: bool | None) -> ModelConfig:
    """The decoder's config with its experts. expert_size_key: the config field of an expert's
    intermediate size; norm_topk_prob: the family always renormalizes (True), or as config.json says
    (None)."""
    c = parse_decoder(cfg, arch, qk_norm=qk_norm)
    counts = {k: cfg[k] for k in ("num_experts", "num_local_experts") if cfg.get(k) is not None}
    if len(set(counts.values())) > 1:
        raise ConfigError(f"config fields num_experts and num_local_experts disagree: {counts}")
    if not counts:
        raise ConfigError("config is missing required field 'num_experts' (or 'num_local_experts')")
    key, experts = next(iter(counts.items()))
    experts = _int(cfg, key)
    top_k = _int(cfg, "num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok={top_k} exceeds the {experts} experts")
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if shared:
        raise ConfigError(f"shared_expert_intermediate_size={shared}: shared experts (Qwen2-MoE) are not supported")
    step = cfg.get("decoder_sparse_step", 1)
    step = _int(cfg, "decoder_sparse_step", 1) if step is not None else 1
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only) \
            or any(not 0 <= i < c.num_hidden_layers for i in only):
        raise ConfigError(f"config field 'mlp_only_layers' must list layer numbers below {c.num_hidden_layers}, "
                          f"got {only!r}")
    dense = sorted(set(only) | {i for i in range(c.num_hidden_layers) if (i + 1) % step})
    renorm = cfg.get("norm_topk_prob", False) if norm_topk_prob is None else norm_topk_prob
    if not isinstance(renorm, bool):
        raise ConfigError(f"config field 'norm_topk_prob' must be true or false, got {renorm!r}")
    return dataclasses.replace(c, num_experts=experts, num_experts_per_tok=top_k,
                               moe_intermediate_size=_int(cfg, expert_size_key), norm_topk_prob=renorm,
                               mlp_only_layers=tuple(dense))


def _source_shapes(names: ExpertNames, c: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = decoder_source_shapes(c)
    h, i, e = c.hidden_size, c.moe_intermediate_size, c.num_experts
    for n in range(c.num_hidden_layers):
        if not c.is_moe_layer(n):
            continue
        for dense in _DENSE_MLP:
            del shapes[f"model.layers.{n}.{dense}"]
        shapes[names.router(n)] = (e, h)
        for x in range(e):
            shapes[names.expert(n, x, names.gate)] = (i, h)
            shapes[names.expert(n, x, names.up)] = (i, h)
            shapes[names.expert(n, x, names.down)] = (h, i)
    return shapes


def _modules(c: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The decoder's, less the dense MLP of each MoE layer: experts and routers stay float."""
    out = decoder_modules(c)
    for n in range(c.num_hidden_layers):
        if c.is_moe_layer(n):
            out.pop(f"model.layers.{n}.mlp.gate_up_proj", None)
            out.pop(f"model.layers.{n}.mlp.down_proj", None)
    return out


def _parameters(names: ExpertNames, named_params: Iterable[tuple[str, Any]],
                formats: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    plan = plan_parameters(named_params, formats)
    for entry in plan:
        name = entry["name"]
        if not name.startswith("model.layers."):
            continue
        layer = int(name.split(".")[2])
        experts = int(entry["shape"][0])
        if name.endswith("." + ROUTER):
            entry["sources"] = [names.router(layer)]
        elif name.endswith("." + GATE_UP):
            entry["transform"] = "stack_gate_up_experts"
            entry["sources"] = ([names.expert(layer, e, names.gate) for e in range(experts)]
                                + [names.expert(layer, e, names.up) for e in range(experts)])
        elif name.endswith("." + DOWN):
            entry["transform"] = "stack_experts"
            entry["sources"] = [names.expert(layer, e, names.down) for e in range(experts)]
    return plan


def moe_plan(names: ExpertNames) -> WeightPlan:
    return WeightPlan(parameters=functools.partial(_parameters, names),
                      source_shapes=functools.partial(_source_shapes, names), modules=_modules)
