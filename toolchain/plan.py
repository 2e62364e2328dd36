"""BuildPlan: every build option resolved once, from the checkpoint, the target and the user's options.

`resolve_plan` turns what the user asked for (BuildOptions, "auto" where unset) into what
a build makes: each "auto" resolved, each combination that cannot work refused by name
(the option, the value, what is accepted). `vtool build` compiles a plan
(toolchain/build.py), `vtool tune` extracts the kernels of one (toolchain/tune.py), the
build cache key hashes one (`BuildPlan.cache_key`), the manifest records one, and a
release archive cites one (`BuildPlan.as_dict`). Nothing after the plan resolves an option
again; what differs per target family comes from toolchain/families.py.

This module is on the cached-build path: it imports no compiler.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from vtool import VtoolError
from vtool.models.config import ModelConfig, parse_hf_config, source_config
from vtool.models.weights import block_formats, check_checkpoint_shapes, format_runs, kept_formats, weight_modules
from vtool.runtime.weights.ggml_blocks import FORMATS as BLOCK_FORMATS
from vtool.runtime.artifact.library import installed_versions
from vtool.runtime.weights.checkpoint import Checkpoint
from vtool.runtime.weights.hf_overrides import apply_hf_overrides, canonical, parse_hf_overrides
from vtool.targets import TargetSpec, buildable
from vtool.targets.table import TargetError
from vtool.toolchain.block_mma import block_mma_formats
from vtool.toolchain.families import FAMILIES, Family, family_of
from vtool.toolchain.flashinfer_attention import attention_key, resolve_attention
from vtool.toolchain.gemm_offload import resolve_gemm
from vtool.toolchain.fp8_plan import fp8_formats, fp8_tensor_cores, stored_fp8_tensors
from vtool.toolchain.quantize import SCHEMES, plan_formats, quantized_sources, source_key

DTYPES = ("float32", "float16", "bfloat16")
# --quantization: auto = gguf for a GGUF file on a target with quantized kernels, else none;
# none = every weight dequantized to the dtype at load; gguf = keep the file's Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q6_K blocks.
# q4_0/q4_1/q8_0 = quantize a float checkpoint's weights at build time (toolchain/quantize.py).
# fp8 = e4m3 linear weights with a float32 scale per row, quantized from the float checkpoint when
# the artifact loads (runtime/weights/fp8.py, models/fp8_linear.py), as vLLM's --quantization fp8.
QUANTIZATIONS = ("auto", "none", "gguf", *SCHEMES, "fp8")
# --activations: how the matmuls over weights kept in a format with integer-dot kernels
# (models/int8_activations.py DOT_FORMATS; schedules/cpu/int8_gemv.py, kquant_gemv.py, kquant_gemm.py) take their
# input: rows quantized to Q8_0 (Q8_K for the K-quants, as llama.cpp) and integer dot products everywhere ("q8_0",
# llama.cpp's numerics: what auto picks on integer-dot CPUs, as every such format's prompt GEMM is faster than the
# float one) or in decode only ("decode": prompts stay float32), or float32 everywhere ("none").
ACTIVATIONS = ("auto", "decode", "q8_0", "none")
# --cuda-graph-sizes: "auto" = the family's list (toolchain/families.py; none off CUDA), "none" =
# batch_decode stays uncaptured, or batch sizes "1,2,4,8,...": batched decode runs in CUDA graphs
# captured per size up to the largest, and the runtime pads a step up to the next size.
CUDA_GRAPH_SIZES_NONE = "none"
MAX_CUDA_GRAPH_BATCH = 1024  # the static memory plan grows with the largest size

# Families with kernels for weights kept in blocks (the CPU ones).
QUANT_TARGET_FAMILIES = tuple(f.name for f in FAMILIES if f.quantized_kernels)

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
# Sources whose change changes the compiled library (part of the cache key).
_COMPILER_SOURCES = ("models", "schedules", "targets", "toolchain/pipeline.py", "toolchain/build.py",
                     "toolchain/plan.py", "toolchain/families.py",
                     "toolchain/cuda.py", "toolchain/gemm_offload.py", "toolchain/native/cublas_gemm.cc",
                     "toolchain/native_objects.py",
                     "toolchain/flashinfer_attention.py", "toolchain/quantize.py", "toolchain/fp8_plan.py",
                     "toolchain/block_mma.py", "toolchain/native/block_mma.cu",
                     "toolchain/row_sort.py", "toolchain/native/row_sort.cu",
                     "toolchain/prefill_attention.py",
                     "toolchain/native/prefill_attention.cu",
                     "runtime/weights/ggml_blocks.py",  # the block layout the kernels are compiled for
                     "runtime/weights/fp8_layout.py",  # and the FP8 one
                     "runtime/artifact/draft_state.py")  # and the draft cache's state

Notice = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """What the user asked for (the CLI's flags, the API's arguments); "auto" lets the plan choose."""
    dtype: str = "float32"  # DTYPES
    quantization: str = "auto"  # QUANTIZATIONS
    activations: str = "auto"  # ACTIVATIONS
    gemm: str = "auto"  # toolchain/gemm_offload.py GEMM_CHOICES
    attention: str = "auto"  # toolchain/flashinfer_attention.py ATTENTIONS
    records: bool = True  # apply the tuning records found for the target (tuning_logs/<target>/)
    cuda_graph_sizes: str = "auto"  # "auto", "none" or comma-separated batch sizes (CUDA_GRAPH_SIZES_NONE above)
    hf_overrides: str = ""  # --hf-overrides: a JSON object of config.json fields (runtime/weights/hf_overrides.py)
    draft_cache_len: int = 0  # --draft-cache-len: draft_extend/draft_step over a cache of this many positions; 0: none;
    # DRAFT_CACHE_AUTO: what a speculative pair gets by default (resolve_draft_cache_len)


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """One build, fully resolved: what `vtool build` compiles and the cache key hashes."""
    target: TargetSpec  # a buildable row ("host" already resolved to its tier)
    config: ModelConfig
    source_config: Mapping[str, Any]  # the config.json keys the parser reads, as the checkpoint gave them
    source_format: str  # "safetensors" | "gguf"
    dtype: str
    quantization: str  # "none" | "gguf" | "q4_0" | "q4_1" | "q8_0"
    kept: Mapping[str, str]  # module -> GGML block format its weight keeps in memory
    dense: Mapping[str, str]  # module -> stored types dequantized at load (no kernel for them)
    left_float: tuple[str, ...] | None  # build-time schemes: modules whose shape does not fit the tiles
    quantized_sources: Mapping[str, str]  # build-time schemes: HF tensor -> GGML type written to weights.gguf
    weights_key: str  # build-time schemes: fingerprint of the source weights; "" otherwise
    activations: str  # "none" | "decode" | "q8_0"
    gemm: str  # "tir" | "cublas"
    attention: str  # "tir" | "flashinfer"
    records: bool  # whether tuning records apply
    tuning_digest: str  # of the records that apply; "" for none
    # External tools, resolved for builds only (`vtool tune` extracts kernels without them):
    toolchain: Mapping[str, str] | None  # nvcc's version, or the cross linker's; {} for a native CPU link
    attention_backend: str | None  # "tir" or "flashinfer-<version>"
    # batch sizes whose batched decode is captured in CUDA graphs, ascending; () for none
    cuda_graph_sizes: tuple[int, ...] = ()
    # --hf-overrides: config.json fields replaced before the config was parsed ({} for none)
    hf_overrides: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    # positions of the speculative draft cache of draft_extend / draft_step (models/draft_chain.py); 0: none
    draft_cache_len: int = 0

    @property
    def family(self) -> Family:
        return family_of(self.target)

    @property
    def quantize_now(self) -> bool:
        """Blocks made at build time and written into the artifact (weights.gguf)."""
        return self.quantization in SCHEMES

    def quantized_weights(self) -> dict[str, Any]:
        """The manifest's summary: how many weights keep each block format, which were
        dequantized at load for want of a kernel (module -> stored types), and (build-time
        schemes) which stay float because their shape does not fit the kernels' tiles."""
        counts: dict[str, int] = {}
        for spec in self.kept.values():
            for fmt, _, _ in format_runs(spec):  # a fused weight kept in several formats: one per run
                counts[fmt] = counts.get(fmt, 0) + 1
        summary: dict[str, Any] = {"kept": counts, "dequantized": dict(sorted(self.dense.items()))}
        if self.left_float is not None:
            summary["float"] = sorted(self.left_float)
        mma = block_mma_formats(self.kept, self.dtype) if self.family.name == "cuda" else ()
        if mma:  # batch_decode's matmuls over these formats on the tensor cores (toolchain/block_mma.py)
            summary["batched_decode_mma"] = list(mma)
        if self.quantization == "fp8":  # which matmuls quantize their activations too (models/fp8_linear.py)
            summary["fp8_matmuls"] = {"decode": "W8A16",
                                      "prompts_and_batches": "W8A8" if self.fp8_tensor_cores else "W8A16"}
        return summary

    @property
    def fp8_tensor_cores(self) -> bool:
        """An FP8 build whose prompt and batched matmuls take W8A8 on the FP8 tensor cores."""
        return self.quantization == "fp8" and fp8_tensor_cores(self.target, self.gemm)

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data: how the library is made, every option resolved.

        The manifest records it (`build.plan`), and a release archive cites it as the
        provenance of its library. The cache key (`cache_key`) hashes the same fields, plus
        the installed versions and vtool's compiler sources. Same inputs give the same dict;
        any resolved option that changes the library changes it. `toolchain` and
        `attention_backend` are None in a plan resolved without its tools (`vtool tune`)."""
        return {
            "plan_format": 1,
            "target": self.target.describe(),
            "model": {"arch": self.config.architecture, "family": self.config.family,
                      "config_digest": self.config.digest(), "source_format": self.source_format,
                      "source_config": dict(self.source_config),
                      **({"hf_overrides": dict(self.hf_overrides)} if self.hf_overrides else {})},
            "dtype": self.dtype,
            "quantization": self.quantization,
            "quantized_weights": {**self.quantized_weights(), "formats": dict(sorted(self.kept.items()))},
            "weights_key": self.weights_key,
            "activations": self.activations,
            "gemm": self.gemm,
            "attention": self.attention,
            "attention_backend": self.attention_backend,
            "tuning": {"records": self.records, "digest": self.tuning_digest},
            "toolchain": None if self.toolchain is None else dict(self.toolchain),
            "cuda_graph_sizes": list(self.cuda_graph_sizes),
            **({"draft_cache_len": self.draft_cache_len} if self.draft_cache_len else {}),
        }

    def quantization_key(self) -> str:
        """The cache key's quantization: the scheme plus which weight keeps which format (two
        GGUF files of one model in different formats need different libraries), the
        activation scheme, and for weights quantized into the artifact their source (another
        checkpoint of this config needs its own)."""
        key = self.quantization
        if self.kept:
            key += ":" + hashlib.sha256(json.dumps(dict(self.kept), sort_keys=True).encode()).hexdigest()[:16]
        if self.activations != "none":
            key += f":{self.activations}-activations"
        if self.weights_key:
            key += ":" + self.weights_key
        return key

    def cache_key(self) -> str:
        """The build cache key (the artifact folder's name under the user cache)."""
        if self.toolchain is None or self.attention_backend is None:
            raise VtoolError("this plan was resolved without its tools (as `vtool tune` does): it has no cache key")
        return _key(self.source_config, self.target, self.dtype, self.quantization_key(), self.gemm,
                    self.attention_backend, self.tuning_digest, self.toolchain, self.cuda_graph_sizes,
                    self.hf_overrides, self.draft_cache_len)


# --- the cache key -----------------------------------------------------------------------------

def compiler_source_digest() -> str:
    h = hashlib.sha256()
    for entry in _COMPILER_SOURCES:
        path = _PACKAGE_ROOT / entry
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.relative_to(_PACKAGE_ROOT)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _key(source_cfg: Mapping[str, Any], target: TargetSpec, dtype: str, quantization: str, gemm: str,
         attention: str, tuning: str, toolchain: Mapping[str, str], graph_sizes: tuple[int, ...] = (),
         hf_overrides: Mapping[str, Any] | None = None, draft_cache_len: int = 0) -> str:
    payload = {"config": dict(source_cfg), "target": target.describe(), "dtype": dtype,
               "quantization": quantization, "gemm": gemm, "versions": installed_versions(),
               "compiler": compiler_source_digest()}
    if attention != "tir":  # e.g. "flashinfer-0.6.15.post1"; tir builds keep their keys
        payload["attention"] = attention
    if tuning:  # the digest of the tuning records that apply; builds without records keep their keys
        payload["tuning"] = tuning
    if toolchain:
        payload["toolchain"] = dict(toolchain)
    if graph_sizes:  # the captured batch_decode and its memory plan; builds without keep their keys
        payload["cuda_graph_sizes"] = list(graph_sizes)
    if hf_overrides:  # recorded in the manifest, which the runtime applies; builds without keep their keys
        payload["hf_overrides"] = canonical(hf_overrides)
    if draft_cache_len:  # two more entry points; builds without keep their keys
        payload["draft_cache_len"] = draft_cache_len
    blob = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cache_key(raw_config: dict[str, Any], target: TargetSpec, dtype: str, quantization: str,
              gemm: str = "tir", attention: str = "tir", tuning: str = "",
              cuda_graph_sizes: tuple[int, ...] | None = None) -> str:
    """The key for explicit parts (`quantization` as BuildPlan.quantization_key gives it;
    cuda_graph_sizes None: what --cuda-graph-sizes auto picks for the target); a build
    takes BuildPlan.cache_key, which is this for its own parts."""
    family = family_of(target)
    graph_sizes = family.graph_batch_sizes if cuda_graph_sizes is None else tuple(cuda_graph_sizes)
    return _key(source_config(raw_config), target, dtype, quantization, gemm, attention, tuning,
                family.toolchain(target), graph_sizes)


# --- resolving --------------------------------------------------------------------------------

def check_request(target: str | TargetSpec, options: BuildOptions) -> TargetSpec:
    """The refusals that need no checkpoint: the dtype, the target, its family's entry."""
    if options.dtype not in DTYPES:
        raise VtoolError(f"unsupported dtype {options.dtype!r}; supported: {', '.join(DTYPES)}")
    if isinstance(target, str):
        spec = buildable(target)
    else:
        spec = target
        if not spec.buildable:
            raise TargetError(f"target {spec.name!r} cannot be built yet: {spec.not_buildable_reason}")
    family_of(spec)
    return spec


def resolve_plan(checkpoint: Checkpoint, target: str | TargetSpec, options: BuildOptions = BuildOptions(),
                 notice: Notice | None = None, tools: bool = True) -> BuildPlan:
    """The plan for building `checkpoint` for `target` with `options`, or a VtoolError that
    names the option, the value and what is accepted. `notice` hears why an "auto" fell
    back (attention). tools=False leaves out the external tools' versions (nvcc, the cross
    linker, FlashInfer's): `vtool tune` extracts kernels without them, and such a plan has
    no cache key."""
    spec = check_request(target, options)
    family = family_of(spec)
    overrides = parse_hf_overrides(options.hf_overrides)
    raw = apply_hf_overrides(checkpoint.config(), overrides)
    cfg = parse_hf_config(raw)
    shapes = {n: t.shape for n, t in checkpoint.tensors().items()}
    check_checkpoint_shapes(cfg, shapes, str(checkpoint.path))
    family.check_model(cfg, options.dtype)
    if notice and options.dtype in family.dtype_notice:
        notice(family.dtype_notice[options.dtype])
    quantization, kept, dense = resolve_quantization(options.quantization, checkpoint, cfg, spec, options.dtype,
                                                     notice=notice)
    quantize_now = quantization in SCHEMES
    qsources = quantized_sources(cfg, kept) if quantize_now else {}
    left_float = tuple(plan_formats(cfg, shapes, quantization)[1]) if quantize_now else None
    gemm = resolve_gemm(options.gemm, spec.family, options.dtype)
    attention = resolve_attention(options.attention, spec.family, options.dtype, cfg, notice=notice)
    activations = resolve_activations(options.activations, spec, kept)
    weights_key = source_key(checkpoint, qsources) if quantize_now else ""
    backend = attention_key(attention) if tools else None
    digest = _records_digest(spec) if options.records else ""
    toolchain = family.toolchain(spec) if tools else None
    graph_sizes = resolve_cuda_graph_sizes(options.cuda_graph_sizes, spec)
    draft_len = resolve_draft_cache_len(options.draft_cache_len, cfg, spec, options.dtype, notice=notice)
    return BuildPlan(
        target=spec, config=cfg, source_config=MappingProxyType(source_config(raw)), source_format=checkpoint.format,
        dtype=options.dtype, quantization=quantization, kept=MappingProxyType(dict(kept)),
        dense=MappingProxyType(dict(dense)), left_float=left_float, quantized_sources=MappingProxyType(qsources),
        weights_key=weights_key, activations=activations, gemm=gemm, attention=attention, records=options.records,
        tuning_digest=digest, toolchain=None if toolchain is None else MappingProxyType(dict(toolchain)),
        attention_backend=backend, cuda_graph_sizes=graph_sizes, hf_overrides=MappingProxyType(overrides),
        draft_cache_len=draft_len)


DRAFT_CACHE_AUTO = -1
DEFAULT_DRAFT_CACHE_LEN = 4096


def resolve_draft_cache_len(requested: int, cfg: ModelConfig, target_spec: TargetSpec, dtype: str,
                            notice: Callable[[str], None] | None = None) -> int:
    """--draft-cache-len: 0, or the positions of the draft cache (models/draft_chain.py) when this
    model and target can have one; what cannot work is refused by name.

    DRAFT_CACHE_AUTO (what run/serve/bench ask for the target and the draft of a --speculative-config
    draft model): DEFAULT_DRAFT_CACHE_LEN positions (at most the model's context) on a CUDA target,
    where speculating through the two caches measured fastest (1.59x against 1.34x through the
    paged cache on an H100, docs/BENCHMARKS.md session 37); none elsewhere (on the CPU the engine's
    way measured faster, runtime/engine/spec_config.py uses_own_caches) or where the model cannot
    have one (said by `notice`)."""
    if requested == DRAFT_CACHE_AUTO:
        if family_of(target_spec).name != "cuda":
            return 0
        try:
            return resolve_draft_cache_len(min(DEFAULT_DRAFT_CACHE_LEN, cfg.max_position_embeddings), cfg,
                                           target_spec, dtype)
        except VtoolError as e:
            if notice:
                notice(f"speculation without the model's own cache: {e}")
            return 0
    if not requested:
        return 0
    # only now: the model rooms import TVM, which a `vtool run` finding its build cached never loads
    from vtool.models.draft_chain import unsupported_reason
    from vtool.models.registry import model_family

    if requested < 16:
        raise VtoolError(f"--draft-cache-len {requested}: give the positions a draft sequence may reach "
                         "(prompt and output, at least 16), or 0 for none")
    family = model_family(cfg.architecture)
    if family.task != "generate" or family.name == "gpt2":
        raise VtoolError(f"--draft-cache-len: the {family.name} family ({cfg.architecture}) has no draft entry "
                         "points (the decoders of models/decoder.py have them)")
    why = unsupported_reason(cfg)
    if why:
        raise VtoolError(f"--draft-cache-len: {cfg.architecture} cannot run on the draft cache: {why}")
    if requested > cfg.max_position_embeddings:
        raise VtoolError(f"--draft-cache-len {requested}: more positions than the model's context "
                         f"({cfg.max_position_embeddings})")
    if family_of(target_spec).name == "cuda":
        from vtool.schedules.cuda.draft_chain import attention_layout

        try:
            attention_layout(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, dtype)
        except ValueError as e:
            raise VtoolError(f"--draft-cache-len: {e}") from None
    return int(requested)


def resolve_cuda_graph_sizes(requested: str, target_spec: TargetSpec) -> tuple[int, ...]:
    """The batch sizes whose batched decode a build captures in CUDA graphs, ascending and
    distinct, for --cuda-graph-sizes `requested`: "auto" (the family's list, none off CUDA),
    "none", or sizes such as "1,2,4,8,16"; what cannot work is refused by name."""
    family = family_of(target_spec)
    text = str(requested).strip().lower()
    if text == "auto":
        return tuple(family.graph_batch_sizes)
    if text in (CUDA_GRAPH_SIZES_NONE, ""):
        return ()
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise VtoolError(f"--cuda-graph-sizes {requested!r} is not a list of positive batch sizes such as "
                         f"'1,2,4,8,16'; or use auto or {CUDA_GRAPH_SIZES_NONE}")
    if sizes[-1] > MAX_CUDA_GRAPH_BATCH:
        raise VtoolError(f"--cuda-graph-sizes {requested!r}: the largest size is {sizes[-1]}, past "
                         f"{MAX_CUDA_GRAPH_BATCH} (the captured batch_decode plans its memory for the largest)")
    if not family.graph_batch_sizes:
        offered = " or ".join(f.label for f in FAMILIES if f.graph_batch_sizes) or "no"
        raise VtoolError(f"--cuda-graph-sizes {requested!r} needs a {offered} target: target "
                         f"{target_spec.name!r} ({target_spec.family}) has no CUDA graphs; use auto or "
                         f"{CUDA_GRAPH_SIZES_NONE}")
    return tuple(sizes)


def _records_digest(spec: TargetSpec) -> str:
    from vtool.toolchain.records import RecordSet

    return RecordSet.load(spec.name, dict(spec.tvm)).digest  # records change the library


def resolve_quantization(requested: str, ckpt: Checkpoint, cfg: ModelConfig, target_spec: TargetSpec, dtype: str,
                         notice: Notice | None = None) -> tuple[str, dict[str, str], dict[str, str]]:
    """(scheme, kept: module -> block format, dense: module -> stored types dequantized
    instead) for --quantization `requested` of a `dtype` build; a combination that cannot work
    is refused. `notice` hears why an "auto" dequantizes a GGUF file's blocks."""
    if requested not in QUANTIZATIONS:
        raise VtoolError(f"unknown quantization {requested!r}; supported: {', '.join(QUANTIZATIONS)}")
    stored_fp8 = stored_fp8_tensors(ckpt)
    if stored_fp8 and requested not in ("auto", "fp8"):
        raise VtoolError(f"{ckpt.path} is an FP8 checkpoint (its weights are e4m3 with scales, e.g. "
                         f"{stored_fp8[0]!r}): build it with --quantization fp8 (or auto); --quantization {requested} would read the "
                         "e4m3 values without their scales")
    if requested == "none":
        return "none", {}, {}
    if requested != "auto" and not weight_modules(cfg):  # a family with no quantizable layers (GPT-2)
        raise VtoolError(f"--quantization {requested}: the {cfg.family} family ({cfg.architecture}) has no quantized "
                         "layers yet; its weights are dequantized to the dtype at load: use --quantization none "
                         "(or auto)")
    if requested in SCHEMES:
        return requested, _scheme_formats(requested, ckpt, cfg, target_spec), {}
    if requested == "fp8" or stored_fp8:
        return "fp8", fp8_formats(ckpt, cfg), {}
    quantized_kernels = family_of(target_spec).quantized_kernels
    if requested == "auto" and ckpt.format != "gguf":
        return "none", {}, {}
    if ckpt.format != "gguf":
        raise VtoolError(f"--quantization gguf keeps a GGUF file's quantized blocks, but {ckpt.path} is a "
                         f"{ckpt.format} checkpoint; use --quantization none")
    if not quantized_kernels:
        raise VtoolError(f"--quantization gguf has kernels for x86 CPU targets only, not {target_spec.name} "
                         f"({target_spec.family}); use --quantization none there")
    kept, dense = kept_formats(cfg, {n: (t.dtype, t.shape) for n, t in ckpt.tensors().items()})
    if not kept:
        if requested == "auto":
            return "none", {}, {}
        raise VtoolError(f"--quantization gguf: {ckpt.path} has no weight stored as {', '.join(BLOCK_FORMATS)} "
                         f"(the formats with kernels); use --quantization none")
    formats = block_formats(kept)
    why = family_of(target_spec).why_auto_dequantizes_gguf(dtype, formats) if requested == "auto" else None
    if why:
        if notice:
            notice(f"--quantization auto: {ckpt.path}'s {', '.join(sorted(formats))} blocks are dequantized to "
                   f"{dtype} at load: {why}; --quantization gguf keeps them anyway")
        return "none", {}, {}
    return "gguf", kept, dense


def _scheme_formats(scheme: str, ckpt: Checkpoint, cfg: ModelConfig, target_spec: TargetSpec) -> dict[str, str]:
    """module -> GGML type for a build-time scheme (q4_0, q4_1, q8_0, q4_k, q6_k), refusing what cannot work."""
    if ckpt.format == "gguf":
        raise VtoolError(f"--quantization {scheme} quantizes a float (safetensors) checkpoint at build time, but "
                         f"{ckpt.path} is a GGUF file, whose blocks are kept as they are: use --quantization gguf "
                         "(or auto); re-quantizing already quantized weights would only add error")
    if not family_of(target_spec).quantized_kernels:
        raise VtoolError(f"--quantization {scheme} has kernels for CPU targets only "
                         f"({', '.join(QUANT_TARGET_FAMILIES)}), not {target_spec.name} ({target_spec.family}): "
                         f"there are no quantized {family_of(target_spec).label} kernels yet; use --quantization none")
    kept, _ = plan_formats(cfg, {n: t.shape for n, t in ckpt.tensors().items()}, scheme)
    if not kept:
        raise VtoolError(f"--quantization {scheme}: no weight of {ckpt.path} fits the quantized kernels' tiles "
                         "(rows a multiple of 4, columns a multiple of 32); use --quantization none")
    return kept




def resolve_activations(requested: str, target_spec: TargetSpec, kept: Mapping[str, str]) -> str:
    """"decode", "q8_0" or "none" for --activations `requested`; a quantized mode asked of a
    build that cannot run it is refused by name."""
    if requested not in ACTIVATIONS:
        raise VtoolError(f"unknown --activations {requested!r}; supported: {', '.join(ACTIVATIONS)}")
    from vtool.models.int8_activations import DOT_FORMATS

    isa = family_of(target_spec).int8_isa(target_spec)
    formats = block_formats(kept)
    usable = isa is not None and bool(formats & set(DOT_FORMATS))
    if requested == "none" or (requested == "auto" and not usable):
        return "none"
    if requested == "auto":
        # prompts too: the integer GEMMs beat dequantize + float GEMM for every DOT format (issue 16,
        # docs/BENCHMARKS.md); "decode" (float prompts) stays an explicit choice
        return "q8_0"
    if isa is None:
        raise VtoolError(f"--activations {requested} needs an x86 target with integer dot products (AVX2 or "
                         f"AVX-512 VNNI); {target_spec.name} has none: use --activations none")
    if not usable:
        raise VtoolError(f"--activations {requested} applies to weights kept as {', '.join(DOT_FORMATS)} blocks and "
                         "this build keeps none: use --activations none (or --quantization gguf / q4_1 / q8_0)")
    return requested
