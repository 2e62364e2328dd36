"""vtool's Relax pipeline per target family.

TVM's "default" pipeline legalizes `x @ W.T` into a transpose of every weight on every
call plus a matmul. FuseTransposeMatmul turns that into one NT_matmul kernel: decode on
CPU ran 14x faster (measured in the TVM notes), and on an H200 10x faster (the GPU
baseline). After legalization, the target's schedule rules from vtool.schedules run on
the TIR kernels.

CUDA: FuseTransposeMatmul, then TVM's CUDA backend pieces (library dispatch,
legalize + fuse, our schedules in place of the stock DLight list, dataflow lowering,
finalize). `pass_config` turns on CUDA graphs (relax.backend.use_cuda_graph), which
RewriteCUDAGraph in the finalize passes reads. It captures only the static regions of a
function: the kernel runs between KV-cache calls in `prefill`/`decode`, whose shapes are
fixed. In the symbolic-shape functions (batch_prefill, batch_decode) nothing is static,
so they stay uncaptured and unchanged.
"""
from __future__ import annotations

import contextlib
from typing import Any

import tvm
from tvm import relax

from vtool.schedules import rules_for

# Explicit pipeline choices per family; the manifest records them (build.pipeline).
CUDA_GRAPHS = True
# models/decode_attention.py's split-KV kernel in place of TVM's decode attention.
SPLIT_KV_DECODE = True


def pass_config(family: str) -> dict[str, Any]:
    """The PassContext config tvm.compile runs under for this family."""
    if family == "cuda":
        # TIR's common-subexpression pass emits a use before its definition in the KV
        # cache's llama3-rope kernels for CUDA ("cse_v18 has been used before definition").
        return {"relax.backend.use_cuda_graph": CUDA_GRAPHS, "tirx.disable_cse_tir": True}
    return {}


def pass_context(family: str) -> Any:
    """The PassContext a build of this family compiles under (CPU builds: the ambient one).
    `vtool tune` extracts kernels under it too: passes and configs that differ would give
    kernels whose hashes no build looks up."""
    if family == "cuda":
        return tvm.transform.PassContext(opt_level=3, config=pass_config(family))
    return contextlib.nullcontext()


def describe(family: str, gemm: str = "tir") -> dict[str, Any]:
    """The manifest's record of the pipeline a library was built with."""
    if family == "cuda":
        from vtool.schedules.cuda import describe as schedules

        offload = ["VtoolOffloadGemmToCublas"] if gemm == "cublas" else []
        decode = ["VtoolSplitKVDecodeAttention"] if SPLIT_KV_DECODE else []
        return {"gemm": gemm, "passes": decode + offload + ["FuseTransposeMatmul", "cuda.library_dispatch", "LegalizeOps", "AnnotateTIROpPattern",
                           "FoldConstant", "FuseOps", "FuseTIR", "vtool.schedules.cuda", "cuda.dataflow_lower",
                           "cuda.finalize"],
                "schedules": schedules(), "cuda_graph": CUDA_GRAPHS, "pass_config": pass_config(family),
                "opt_level": 3}
    return {"passes": ["FuseTransposeMatmul", "cpu.library_dispatch", "cpu.legalize", "vtool.schedules.cpu",
                       "cpu.dataflow_lower", "cpu.finalize"]}


def _backend(family: str):  # noqa: ANN202 - a TVM backend pipeline module
    if family in ("x86", "arm"):  # cpu_generic's passes hold nothing x86-specific
        from tvm.relax.backend.cpu_generic import pipeline as backend
    elif family == "cuda":
        from tvm.relax.backend.cuda import pipeline as backend
    else:
        raise NotImplementedError(f"no pipeline for target family {family!r} yet")
    return backend


def kernel_passes() -> list[tvm.transform.Pass]:
    """Legalize + fuse: after these the module holds the fused TIR kernels the schedule
    pass sees (`vtool tune` extracts them with the same passes, so hashes match)."""
    return [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR()]


def build_pipeline(target: tvm.target.Target, family: str, gemm: str = "tir",
                   records: Any = None, until_schedules: bool = False) -> tvm.transform.Pass:
    """(With gemm="cublas", the prefill/batched matmuls to cuBLAS,) FuseTransposeMatmul,
    the backend's library dispatch, legalize + fuse, vtool's schedules for the family
    (tuning records first when `records`, a vtool.toolchain.records.RecordSet, is given),
    the backend's dataflow lowering and finalize passes. until_schedules: stop before the
    schedule pass (`vtool tune` extracts the kernels there)."""
    backend = _backend(family)
    schedule_pass = rules_for(family, records)
    offload: list[tvm.transform.Pass] = []
    if family == "cuda" and SPLIT_KV_DECODE:
        from vtool.models.decode_attention import decode_attention_pass

        offload.append(decode_attention_pass())
    if gemm == "cublas":
        from vtool.toolchain.gemm_offload import offload_pass

        offload.append(offload_pass())

    @tvm.transform.module_pass(opt_level=0, name=f"Vtool{family.upper()}Pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            passes = (
                offload
                # First of the rest, or every x @ W.T transposes its weight per call.
                + [relax.transform.FuseTransposeMatmul()]
                + backend.library_dispatch_passes(target)
                # The CPU backend's legalize_passes, and the CUDA one's without its trailing
                # DLight pass: vtool's schedules take that place on both.
                + kernel_passes()
            )
            if not until_schedules:
                passes += [schedule_pass] + backend.dataflow_lower_passes(target) + backend.finalize_passes(target)
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
