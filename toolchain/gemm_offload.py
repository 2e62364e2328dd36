"""Send the large matmuls of CUDA builds to cuBLAS (`vtool build --gemm`).

Batch-1 decode multiplies a vector by each weight: memory-bound, and vtool's own GEMV
kernels (schedules/cuda) run it near the copy bandwidth and inside a CUDA graph. Prefill
and batched decode multiply a matrix: compute-bound past a few dozen rows, where the
16x16x16 WMMA tiles DLight can emit reached about a tenth of what torch gets from cuBLAS
on an H200 (2048-token prefill of an 8B model: 689 ms vs 64 ms). So in the functions
that take many rows (OFFLOADED_FUNCTIONS), every `x @ W.T` whose weight is bf16/f16 (or
float32 when asked) becomes one call of `vtool_cublas_gemm_nt`, a cuBLAS GemmEx wrapper
linked into the library (native/cublas_gemm.cc). The float32 accumulation the model
asks for is kept: GemmEx computes in float32 and writes the dtype the graph wanted (the
bf16 cast after the matmul folds into the call). An FP8 build's W8A8 matmuls (e4m3 x e4m3,
models/fp8_linear.py) become `vtool_cublaslt_fp8_gemm_nt` (cuBLASLt: GemmEx has no FP8).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from vtool import VtoolError

if TYPE_CHECKING:  # the compiler is imported only when a pass is made: resolve_gemm runs on
    import tvm     # every build_artifact call, cached builds included
    from tvm import relax

GemmBackend = Literal["tir", "cublas"]
GEMM_CHOICES = ("auto", "tir", "cublas")
EXTERN_SYMBOL = "vtool_cublas_gemm_nt"
FP8_SYMBOL = "vtool_cublaslt_fp8_gemm_nt"  # e4m3 x e4m3 on cuBLASLt (models/fp8_linear.py's W8A8 matmuls)
FP8_DTYPE = "float8_e4m3fn"
OFFLOADED_FUNCTIONS = ("prefill", "batch_prefill", "batch_decode", "batch_verify", "chain_verify", "draft_extend")
SOURCE = Path(__file__).with_name("native") / "cublas_gemm.cc"
_OFFLOADED_DTYPES = ("bfloat16", "float16", "float32")


class GemmChoiceError(VtoolError):
    """A --gemm choice that cannot apply to this target or dtype."""


def resolve_gemm(choice: str, family: str, dtype: str) -> GemmBackend:
    """The backend a build uses: `auto` is what the family's table entry picks for the dtype
    (cuBLAS for bf16/f16 CUDA builds, whose prefill is where tensor cores matter; float32
    keeps TIR so its parity with transformers stays bit-for-bit in reach), else vtool's TIR
    kernels; a backend the family does not offer is refused."""
    from vtool.toolchain.families import family_named, offering

    if choice not in GEMM_CHOICES:
        raise GemmChoiceError(f"--gemm {choice!r} is not one of {', '.join(GEMM_CHOICES)}")
    entry = family_named(family)
    if choice == "auto":
        return entry.gemm_auto.get(dtype, "tir")  # type: ignore[return-value]
    if choice not in entry.gemm:
        raise GemmChoiceError(f"--gemm {choice} needs a {offering('gemm', choice)} target; "
                              f"this build's target family is {family}")
    return choice  # type: ignore[return-value]


def _nt_patterns():
    from tvm.relax.dpl import is_op, wildcard

    x, w = wildcard(), wildcard()
    matmul = is_op("relax.matmul")(x, is_op("relax.permute_dims")(w))
    return x, w, matmul, is_op("relax.astype")(matmul)


def _rewriter(x_pat: Any, w_pat: Any):  # noqa: ANN202 - a rewrite_call callback
    from tvm import relax

    def rewrite(expr: relax.Expr, matches) -> relax.Expr:
        x, w = matches[x_pat], matches[w_pat]
        xs, ws, out = x.ty, w.ty, expr.ty
        if ws.ndim != 2 or xs.dtype != ws.dtype or out.dtype not in _OFFLOADED_DTYPES:
            return expr
        if xs.dtype == FP8_DTYPE:
            symbol = FP8_SYMBOL
        elif xs.dtype in _OFFLOADED_DTYPES:
            symbol = EXTERN_SYMBOL
        else:
            return expr
        return relax.call_dps_packed(symbol, [x, w], out_ty=relax.TensorType(out.shape, out.dtype))

    return rewrite


def offload_matmuls(func: relax.Function) -> relax.Function:
    """`x @ W.T` (with its trailing cast, when there is one) -> vtool_cublas_gemm_nt."""
    from tvm.relax.dpl import rewrite_call

    x, w, matmul, cast = _nt_patterns()
    # The cast pattern first, so a bf16 output is written by cuBLAS directly rather than
    # as float32 and cast in another kernel.
    func = rewrite_call(cast, _rewriter(x, w), func)
    return rewrite_call(matmul, _rewriter(x, w), func)


def offload_pass(functions: tuple[str, ...] = OFFLOADED_FUNCTIONS) -> tvm.transform.Pass:
    import tvm
    from tvm import relax

    @tvm.transform.module_pass(opt_level=0, name="VtoolOffloadGemmToCublas")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        for gvar, func in list(mod.functions.items()):
            if gvar.name_hint in functions and isinstance(func, relax.Function):
                mod[gvar] = offload_matmuls(func)
        return relax.transform.DeadCodeElimination()(mod)

    return _pass


def count_offloaded(mod: tvm.IRModule) -> int:
    """How many cuBLAS calls a module holds (the build reports it)."""
    text = str(mod)
    return text.count(f'"{EXTERN_SYMBOL}"') + text.count(f'"{FP8_SYMBOL}"')


def compile_shim() -> Path:
    """native/cublas_gemm.cc -> an object file export_library links into the model library,
    compiled once per source and tvm-ffi version into the user cache (every bf16/f16 CUDA
    build links it).

    Only the tvm-ffi headers are needed (cuBLAS is opened with dlopen at run time), so this
    works on a build machine without CUDA libraries."""
    from vtool.toolchain.native_objects import cached_object, tvm_ffi_includes

    return cached_object(SOURCE, "cublas-shim", "",
                         lambda out: ["g++", "-std=c++17", "-O2", "-fPIC", "-c", str(SOURCE), "-o", out,
                                      *tvm_ffi_includes()])
