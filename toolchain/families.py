"""The target-family table: one entry per family of targets/table.py rows that vtool builds.

A family decides what a build or a tuning run does differently per kind of target:
which options apply (kernels for weights kept in blocks, integer-dot activations, the
--gemm and --attention backends), the pipeline (TVM's Relax backend, vtool's model
passes before FuseTransposeMatmul, the schedule rule set, the PassContext), functions
added to the model, checks a model must pass, the compile and link step and the external
tools it records, the runtime device, and how `vtool tune` measures. A new family (rocm,
vulkan, metal) is one entry here plus the modules its hooks name; nothing else in
toolchain/ or schedules/ branches on a family's name.

This module is on the cached-build path: it imports no compiler. The hooks import what
they need when they are called.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping

from vtool import VtoolError
from vtool.targets import TargetSpec

if TYPE_CHECKING:
    from vtool.models.config import ModelConfig
    from vtool.toolchain.plan import BuildPlan

Progress = Callable[[str], None]

# The entry point a build with CUDA graph batch sizes adds: batch_decode, captured per batch
# size (toolchain/pipeline.py). The runtime calls it by this name (runtime/engine/decode_buckets.py
# writes it too; a test holds the two equal), and the pass that makes it is named in the manifest.
CAPTURED_BATCH_DECODE = "batch_decode_captured"
# batch_verify, captured per token count (speculative verification and other short steps that
# want logits at every position; runtime/engine/runner.py calls it by this name).
CAPTURED_BATCH_VERIFY = "batch_verify_captured"
CAPTURE_PASS = "VtoolCaptureBatchDecode"


class FamilyError(VtoolError):
    """A target family with no entry in the table."""


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # as targets/table.py spells it
    label: str  # in messages: "--gemm cublas needs a CUDA target"
    device: str  # the tvm_ffi device type its libraries run on (the runtime's own table must agree)
    # --- which options apply
    quantized_kernels: bool  # weights kept in GGML blocks: --quantization gguf, q4_0, q4_1, q8_0, q4_k, q6_k
    # why --quantization auto dequantizes a GGUF file's blocks at load for (dtype, the block
    # formats it would keep); None: auto keeps them
    why_auto_dequantizes_gguf: Callable[[str, frozenset[str]], str | None]
    int8_isa: Callable[[TargetSpec], str | None]  # integer-dot ISA for --activations (None: float only)
    gemm: tuple[str, ...]  # --gemm backends, "tir" first
    gemm_auto: Mapping[str, str]  # dtype -> what --gemm auto picks; other dtypes get "tir"
    attention: tuple[str, ...]  # --attention backends, "tir" first; auto tries the others
    # --- the pipeline (toolchain/pipeline.py)
    relax_backend: str  # TVM's Relax backend package: library dispatch, dataflow lowering, finalize
    model_passes: tuple[tuple[str, Callable[[], Any]], ...]  # (name, pass factory), before FuseTransposeMatmul
    schedules: str  # the rule set under vtool.schedules (a subpackage exporting schedule_pass())
    opt_level: int | None  # the PassContext it compiles under; None: the ambient one
    pass_config: Mapping[str, Any]
    dtype_pass_config: Mapping[str, Mapping[str, Any]]  # dtype -> config added for builds of that dtype
    dtype_notice: Mapping[str, str]  # dtype -> what a build of that dtype is told (a slow path, say)
    # batch sizes whose batched decode runs from CUDA graphs (what --cuda-graph-sizes auto picks;
    # () for a family without graphs, where any other value is refused)
    graph_batch_sizes: tuple[int, ...]
    extra_modules: Callable[[ModelConfig], list[Any]]  # Relax modules a library holds beside the model's
    # the manifest's build.pipeline, given --gemm and the resolved --cuda-graph-sizes
    describe_pipeline: Callable[[Family, str, tuple[int, ...]], dict[str, Any]]
    # --- the build
    check_model: Callable[[ModelConfig, str], None]  # refuses shapes its kernels cannot run (config, dtype)
    toolchain: Callable[[TargetSpec], dict[str, str]]  # external tools' versions (cache key); {} when none
    compile: Callable[[BuildPlan, Path, Progress], dict[str, Any]]  # compile + link model.so
    # --- tuning (toolchain/tune.py)
    min_rule_us: float  # a kernel whose rule schedule runs faster is not worth a tuning run
    tensor_intrinsics: bool  # its rules may tensorize: TVM's intrinsics are loaded before the pipeline

    def rules(self, records: Any = None) -> Any:
        """The schedule pass (tuning records first, when a RecordSet is given)."""
        from vtool.schedules import rules_for

        return rules_for(self.schedules, records)

    def backend(self) -> Any:
        """TVM's Relax backend pipeline module (library_dispatch_passes, ...)."""
        return importlib.import_module(f"{self.relax_backend}.pipeline")

    def pass_context(self, dtype: str | None = None) -> Any:
        """The PassContext a build of `dtype` compiles under (`vtool tune` extracts kernels under
        it too: passes and configs that differ would give kernels whose hashes no build looks up)."""
        config = {**self.pass_config, **self.dtype_pass_config.get(dtype or "", {})}
        if self.opt_level is None and not config:
            return contextlib.nullcontext()
        import tvm

        opt_level = self.opt_level if self.opt_level is not None else tvm.transform.PassContext.current().opt_level
        return tvm.transform.PassContext(opt_level=opt_level, config=config)


# --- hooks (each imports its module when called) ------------------------------------------------

def _x86_int8_isa(target: TargetSpec) -> str | None:
    from vtool.models.int8_activations import int8_isa

    return int8_isa(str(target.tvm.get("mcpu", "")), list(target.tvm.get("mattr", [])))


def _no_int8_isa(_target: TargetSpec) -> str | None:
    return None


def _nothing(*_args: Any) -> list[Any]:
    return []


def _keeps_every_format(_dtype: str, _formats: frozenset[str]) -> str | None:
    return None


def _cuda_why_dequantize(dtype: str, formats: frozenset[str]) -> str | None:
    """Keep a GGUF file's blocks on CUDA where batched decode multiplies every kept format on
    the tensor cores (bf16/f16 builds of Q4_0/Q4_1/Q4_K/Q6_K/Q8_0): each step then reads the
    blocks once, whatever its batch. Other formats and float32 would take the block GEMV, whose
    cost grows with every sequence, so those builds dequantize at load instead (and say why)."""
    from vtool.toolchain.block_mma import BLOCK_MMA_FORMATS, MMA_DTYPES

    if dtype in MMA_DTYPES and formats <= set(BLOCK_MMA_FORMATS):
        return None
    return (f"a CUDA build keeps only blocks whose batched decode runs on the tensor cores "
            f"({', '.join(BLOCK_MMA_FORMATS)} in {' or '.join(MMA_DTYPES)} builds)")


def _no_check(_cfg: ModelConfig, _dtype: str) -> None:
    return None


def _cpu_toolchain(target: TargetSpec) -> dict[str, str]:
    from vtool.toolchain.cross_link import record

    return record(target)  # the cross linker for another instruction set; {} for a native link


def _cpu_compile(plan: BuildPlan, library: Path, progress: Progress) -> dict[str, Any]:
    from vtool.toolchain.build import compile_cpu

    return compile_cpu(plan, library, progress)


def _describe_cpu(_family: Family, _gemm: str, _graph_sizes: tuple[int, ...] = ()) -> dict[str, Any]:
    from vtool.schedules.cpu.noalias import PASS_NAME as NOALIAS_PASS

    return {"passes": ["FuseTransposeMatmul", "CollapseReshapeChains", "cpu.library_dispatch", "cpu.legalize",
                       "vtool.schedules.cpu", "cpu.dataflow_lower", "cpu.finalize", NOALIAS_PASS]}


def _cuda_toolchain(_target: TargetSpec) -> dict[str, str]:
    from vtool.toolchain.cuda import nvcc_version

    return {"nvcc": nvcc_version()}


def _cuda_check_model(cfg: ModelConfig, dtype: str) -> None:
    from vtool.toolchain.cuda import check_attention_shape, check_prefill_tiling

    check_attention_shape(cfg)
    check_prefill_tiling(cfg, dtype)


def _cuda_extra_modules(cfg: ModelConfig) -> list[Any]:
    # Sampling on the GPU (schedules/cuda/sampler.py): the engine samples there, so logits stay put.
    # A large vocabulary's top-p / top-k sort is CUB's (toolchain/row_sort.py), which the build links.
    from vtool.schedules.cuda.sampler import sampler_module
    from vtool.toolchain.row_sort import SORT_SYMBOL, uses_row_sort

    return [sampler_module(cfg.vocab_size, sort_symbol=SORT_SYMBOL if uses_row_sort(cfg.vocab_size) else None)]


def _short_prefill_attention() -> Any:
    """Split-KV attention for the cached part of short multi-token steps (speculative
    verification), in front of TVM's paged prefill kernel."""
    from vtool.schedules.cuda.short_prefill_attention import short_prefill_attention_pass

    return short_prefill_attention_pass()


def _split_kv_decode() -> Any:
    # schedules/cuda/decode_attention.py's split-KV kernel in place of TVM's decode attention.
    from vtool.schedules.cuda.decode_attention import decode_attention_pass

    return decode_attention_pass()


def _block_mma_epilogues() -> Any:
    # the casts, residual adds and SiLU x up after the batched-decode block matmuls, done by the
    # matmuls' own last kernel (toolchain/block_mma_epilogues.py)
    from vtool.toolchain.block_mma_epilogues import block_mma_epilogues_pass

    return block_mma_epilogues_pass()


def _block_mma_norms() -> Any:
    # decode's RMSNorms between two one-row block calls, shared by them (toolchain/block_mma_norms.py);
    # after the epilogues pass, whose residual-add calls it extends
    from vtool.toolchain.block_mma_norms import block_mma_norms_pass

    return block_mma_norms_pass()


def _cuda_compile(plan: BuildPlan, library: Path, progress: Progress) -> dict[str, Any]:
    from vtool.toolchain.build import compile_cuda

    return compile_cuda(plan, library, progress)


def _describe_cuda(family: Family, gemm: str, graph_sizes: tuple[int, ...] = ()) -> dict[str, Any]:
    from vtool.schedules.cuda import describe as schedules

    offload = ["VtoolOffloadGemmToCublas"] if gemm == "cublas" else []
    described = {"gemm": gemm,
                 "passes": [name for name, _ in family.model_passes] + offload + [
                     "FuseTransposeMatmul", "CollapseReshapeChains", "cuda.library_dispatch", "LegalizeOps",
                     "AnnotateTIROpPattern", "FoldConstant", "FuseOps", "FuseTIR", "vtool.schedules.cuda"]
                 + ([CAPTURE_PASS] if graph_sizes else []) + ["cuda.dataflow_lower", "cuda.finalize"],
                 "schedules": schedules(), "cuda_graph": bool(family.pass_config["relax.backend.use_cuda_graph"]),
                 "pass_config": dict(family.pass_config), "opt_level": family.opt_level}
    if graph_sizes:  # the runtime pads a decode step to one of these (runtime/engine/decode_buckets.py)
        described["cuda_graph_batch"] = {"entry": CAPTURED_BATCH_DECODE, "sizes": list(graph_sizes),
                                         "max_batch": max(graph_sizes)}
        # a verification step of up to max_tokens tokens runs captured, one graph per token count
        described["cuda_graph_verify"] = {"entry": CAPTURED_BATCH_VERIFY, "max_tokens": max(graph_sizes)}
    return described


# --- the table -------------------------------------------------------------------------------

# bfloat16 CPU builds compile without TIR's common-subexpression pass. The CPU's vector exp,
# sigmoid, tanh, erf, sin and cos are chains of Let expressions (schedules/cpu/vector_math.py);
# BF16ComputeLegalize's float32 -> bfloat16 rounding reads its operand twice, so such a chain
# appears twice, and TVM 0.27's CSE then hoists a piece of it above the Let that binds its
# variable ("variable cse_v16 has been used before definition", first in fused_rope). CUDA
# builds run without the pass for the same fault. LLVM still eliminates common subexpressions.
_CPU_DTYPE_PASS_CONFIG = MappingProxyType({"bfloat16": MappingProxyType({"tirx.disable_cse_tir": True})})

# float16 CPU builds are told what bfloat16 ones need not be: their prompts over dense weights run
# about 1.8x float32's time (no float16 GEMM micro-kernel; every value converted by F16C), where
# bfloat16 runs at float32's speed (BENCHMARKS.md, "Half precision on the CPU").
_CPU_DTYPE_NOTICE = MappingProxyType({
    "float16": ("--dtype float16 on a CPU target: weights and KV cache are kept in float16 and computed in float32, "
                "but prompts over dense float16 weights take about 1.8x the float32 time (no float16 GEMM kernel; "
                "BENCHMARKS.md, 'Half precision on the CPU'); --dtype bfloat16 halves the bytes at float32's "
                "prompt speed")})


def _cpu(name: str, label: str, int8_isa: Callable[[TargetSpec], str | None]) -> Family:
    """x86 and aarch64 share TVM's cpu_generic backend (its passes hold nothing x86-specific)
    and one set of CPU rules (vector_lanes reads the target's width)."""
    return Family(
        name=name, label=label, device="cpu",
        quantized_kernels=True, why_auto_dequantizes_gguf=_keeps_every_format, int8_isa=int8_isa, gemm=("tir",), gemm_auto=MappingProxyType({}), attention=("tir",),
        relax_backend="tvm.relax.backend.cpu_generic", model_passes=(), schedules="cpu", opt_level=None,
        pass_config=MappingProxyType({}), dtype_pass_config=_CPU_DTYPE_PASS_CONFIG, dtype_notice=_CPU_DTYPE_NOTICE,
        graph_batch_sizes=(), extra_modules=_nothing, describe_pipeline=_describe_cpu,
        check_model=_no_check, toolchain=_cpu_toolchain, compile=_cpu_compile,
        min_rule_us=5.0, tensor_intrinsics=False)


CUDA = Family(
    name="cuda", label="CUDA", device="cuda",
    # GGUF blocks dequantized inside the matmuls (schedules/cuda/quantized.py and, for batched
    # decode, the tensor-core kernel of toolchain/block_mma.py); `auto` keeps them where every
    # batch size has a kernel that reads them once a step (_cuda_why_dequantize). Q8_0 activations
    # are an x86 integer-dot scheme.
    quantized_kernels=True, why_auto_dequantizes_gguf=_cuda_why_dequantize, int8_isa=_no_int8_isa,
    # bf16/f16 prefill is where tensor cores matter (cuBLAS); float32 keeps TIR so its parity
    # with transformers stays bit-for-bit in reach (toolchain/gemm_offload.py)
    gemm=("tir", "cublas"), gemm_auto=MappingProxyType({"bfloat16": "cublas", "float16": "cublas"}),
    attention=("tir", "flashinfer"),
    relax_backend="tvm.relax.backend.cuda",
    model_passes=(("VtoolSplitKVDecodeAttention", _split_kv_decode),
                  ("VtoolShortPrefillAttention", _short_prefill_attention),
                  ("VtoolBlockMmaEpilogues", _block_mma_epilogues),
                  ("VtoolBlockMmaNorms", _block_mma_norms)),
    schedules="cuda", opt_level=3,
    # CUDA graphs: RewriteCUDAGraph in the finalize passes reads it. TIR's common-subexpression
    # pass emits a use before its definition in the KV cache's llama3-rope kernels for CUDA
    # ("cse_v18 has been used before definition").
    pass_config=MappingProxyType({"relax.backend.use_cuda_graph": True, "tirx.disable_cse_tir": True}),
    dtype_pass_config=MappingProxyType({}), dtype_notice=MappingProxyType({}),
    # batch_decode's kernel runs captured per batch size, at these sizes (vLLM's default list, to
    # 128); a decode step is padded up to the next one (toolchain/pipeline.py, decode_buckets.py)
    graph_batch_sizes=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128),
    extra_modules=_cuda_extra_modules, describe_pipeline=_describe_cuda,
    check_model=_cuda_check_model, toolchain=_cuda_toolchain, compile=_cuda_compile,
    # a decode step is hundreds of kernels of a few microseconds each, run from a CUDA graph
    min_rule_us=2.0, tensor_intrinsics=True)

FAMILIES: tuple[Family, ...] = (
    _cpu("x86", "x86 CPU", _x86_int8_isa),
    _cpu("arm", "aarch64 CPU", _no_int8_isa),
    CUDA,
)
_BY_NAME = {f.name: f for f in FAMILIES}


def family_named(name: str) -> Family:
    """The entry for a family name; a family with none is refused by name."""
    family = _BY_NAME.get(name)
    if family is None:
        raise FamilyError(f"target family {name!r} has no entry in vtool's target-family table "
                          f"(toolchain/families.py: pipeline, schedule rules, compile step); "
                          f"families: {', '.join(_BY_NAME)}")
    return family


def family_of(target: TargetSpec) -> Family:
    """The entry for a target's family, refusing by name a target whose family has none."""
    try:
        return family_named(target.family)
    except FamilyError as err:
        raise FamilyError(f"target {target.name!r}: {err}") from None


def offering(option: str, value: str) -> str:
    """Who offers `value` for --gemm/--attention, for a refusal: "CUDA"."""
    labels = [f.label for f in FAMILIES if value in getattr(f, option)]
    return " or ".join(labels) if labels else "no"
