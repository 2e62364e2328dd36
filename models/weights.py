"""How each compiled parameter is made from checkpoint tensors (Hugging Face names).

A family's WeightPlan (its registry entry's `weights`) says it; DECODER_WEIGHTS is the plan
of models/decoder.py, which every family shares today. The plan is written into
manifest.json, so the runtime binds weights by following it and never needs this module:
each entry names its source tensors and one transform from the runtime's registry
(vtool.runtime.weights.transforms). weight_modules, expected_source_shapes, kept_formats and
check_checkpoint_shapes take a config and follow its family's plan.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping

from vtool import VtoolError
from vtool.models.config import ModelConfig
from vtool.runtime.weights.fp8_layout import FP8_FORMAT, PARTS as FP8_PARTS
from vtool.runtime.weights.ggml_blocks import QUANT_PARTS, keepable

FLOAT_TYPES = ("F32", "F16", "BF16")  # stored types that are plain floats

# Fused compiled parameter -> the HF projections concatenated (along the output rows) into it.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}

# A fused module whose sources are kept in different block formats (a Q4_K_M file's Q5_0 q/k and
# Q8_0 v) keeps each source in its own blocks: its format is the sources' formats joined by
# SPLIT ("Q5_0,Q5_0,Q8_0"), and it is compiled as one matmul per run of consecutive sources that
# share a format (models/quantized_linear.py SplitQuantizedLinear: submodules `runs.<i>`).
SPLIT = ","
RUNS = "runs"


def format_runs(spec: str) -> list[tuple[str, int, int]]:
    """A kept format, or a split one ("Q5_0,Q5_0,Q8_0") -> (format, first source, sources) per
    run of consecutive sources sharing a format: [("Q5_0", 0, 2), ("Q8_0", 2, 1)]."""
    runs: list[tuple[str, int, int]] = []
    for i, fmt in enumerate(spec.split(SPLIT)):
        if runs and runs[-1][0] == fmt:
            runs[-1] = (fmt, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((fmt, i, 1))
    return runs


def block_formats(kept: Mapping[str, str]) -> frozenset[str]:
    """Every block format of a plan's kept weights (module -> format; a split one names several)."""
    return frozenset(fmt for spec in kept.values() for fmt, _, _ in format_runs(spec))


class WeightPlanError(VtoolError):
    """The checkpoint does not provide what the config says the model needs."""


@dataclasses.dataclass(frozen=True)
class WeightPlan:
    """HF tensor names -> compiled parameters, for one module layout."""

    # (the module's named parameters, kept formats) -> the manifest's params: name, shape,
    # dtype, sources and transform, in library order
    parameters: Callable[[Iterable[tuple[str, Any]], Mapping[str, str] | None], list[dict[str, Any]]]
    # config -> every HF tensor the model needs, with the shape the config implies
    source_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    # config -> each compiled module whose weight may stay in blocks -> the HF weights it is made of
    modules: Callable[[ModelConfig], dict[str, tuple[str, ...]]]


def _plan(c: ModelConfig) -> WeightPlan:
    from vtool.models.registry import model_family  # the registry imports this module

    return model_family(c.architecture).weights


def plan_parameters(named_params: Iterable[tuple[str, Any]],
                    formats: Mapping[str, str] | None = None,
                    fused_sources: Mapping[str, tuple[str, ...]] = FUSED) -> list[dict[str, Any]]:
    """The decoder's parameters: one manifest entry per compiled parameter, in the order the
    library expects them. fused_sources: the compiled fused modules whose HF weights come
    apart (FUSED; a family whose checkpoints store them fused, as Phi-3's, passes {}).

    A part of a weight kept in blocks (module path in `formats`) carries
    `quant: {format, part}`: the runtime repacks its source tensors' blocks and binds that
    part. Its sources are the HF weights (`<module>.weight`) the blocks come from. A part of
    an FP8 weight (format FP8_FORMAT) carries `fp8: {part}` and the float weights it is made of.
    """
    formats = formats or {}
    plan = []
    for name, param in named_params:
        module, leaf = name.rsplit(".", 1)
        entry: dict[str, Any] = {"name": name, "shape": [int(x) for x in param.shape], "dtype": str(param.dtype),
                                 "transform": "identity", "sources": [name]}
        if formats.get(module) == FP8_FORMAT and leaf in FP8_PARTS:
            # both parts are made, at load, from the float weight (runtime/weights/fp8.py)
            entry["fp8"] = {"part": leaf}
            leaf = "weight"
            entry["sources"] = [f"{module}.{leaf}"]
        elif module in formats and leaf in QUANT_PARTS:
            entry["quant"] = {"format": formats[module], "part": leaf}
            leaf = "weight"
            entry["sources"] = [f"{module}.{leaf}"]
        parent, _, run = module.rpartition(f".{RUNS}.")
        if parent in formats and SPLIT in formats[parent] and leaf in QUANT_PARTS:
            # one run of a fused module kept in several formats: its own sources' blocks
            fmt, first, count = format_runs(formats[parent])[int(run)]
            fused = next(f for f in fused_sources if parent.endswith("." + f))
            prefix = parent[: -len(fused) - 1]
            entry["quant"] = {"format": fmt, "part": leaf}
            entry["sources"] = [f"{prefix}.{p}.weight" for p in fused_sources[fused][first:first + count]]
            entry["transform"] = "concat_rows" if count > 1 else "identity"
            plan.append(entry)
            continue
        for fused, parts in fused_sources.items():
            if module.endswith("." + fused):
                prefix = module[: -len(fused) - 1]
                entry["transform"] = "concat_rows"
                entry["sources"] = [f"{prefix}.{part}.{leaf}" for part in parts]
        plan.append(entry)
    return plan


def weight_modules(c: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each compiled module whose weight may stay quantized -> the HF weights it is made of."""
    return _plan(c).modules(c)


def decoder_modules(c: ModelConfig) -> dict[str, tuple[str, ...]]:
    modules: dict[str, tuple[str, ...]] = {"model.embed_tokens": ("model.embed_tokens.weight",)}
    if not c.tie_word_embeddings:
        modules["lm_head"] = ("lm_head.weight",)
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        for fused, parts in FUSED.items():
            modules[p + fused] = tuple(f"{p}{part}.weight" for part in parts)
        modules[p + "self_attn.o_proj"] = (p + "self_attn.o_proj.weight",)
        modules[p + "mlp.down_proj"] = (p + "mlp.down_proj.weight",)
    return modules


def kept_formats(c: ModelConfig, stored: Mapping[str, tuple[str, tuple[int, ...]]]
                 ) -> tuple[dict[str, str], dict[str, str]]:
    """Which weights a `gguf` build keeps in blocks, from each HF tensor's (stored type, shape).

    Returns (kept: module -> format, dense: module -> stored types dequantized instead). A
    module is kept when all its sources share one format vtool has kernels for and fit its
    tiles. A fused module whose sources are each keepable in different formats (a q|k|v of
    Q4_K q/k and a Q6_K v) keeps each in its own blocks: its format is the per-source list
    joined by SPLIT (format_runs).
    """
    kept: dict[str, str] = {}
    dense: dict[str, str] = {}
    for module, sources in weight_modules(c).items():
        types = sorted({stored[s][0] for s in sources})
        if len(types) == 1 and all(keepable(types[0], *stored[s][1]) for s in sources):
            kept[module] = types[0]
        elif len(types) > 1 and all(keepable(stored[s][0], *stored[s][1]) for s in sources):
            kept[module] = SPLIT.join(stored[s][0] for s in sources)
        elif any(t not in FLOAT_TYPES for t in types):
            dense[module] = "+".join(types)
    return kept, dense


def expected_source_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape the config implies for each HF tensor name; used to refuse a checkpoint
    that disagrees with its own config before anything is compiled or bound."""
    return _plan(c).source_shapes(c)


def decoder_source_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
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
            full = c.qk_norm_full
            shapes[p + "self_attn.q_norm.weight"] = (c.num_attention_heads * d,) if full else (d,)
            shapes[p + "self_attn.k_norm.weight"] = (c.num_key_value_heads * d,) if full else (d,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        if c.post_norms or c.sandwich_norms:
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if c.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
        if not c.post_norms:
            shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    return shapes


DECODER_WEIGHTS = WeightPlan(parameters=plan_parameters, source_shapes=decoder_source_shapes,
                             modules=decoder_modules)


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
