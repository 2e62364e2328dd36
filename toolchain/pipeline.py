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

from typing import Any

import tvm
from tvm import relax

from vtool.schedules import rules_for

# Explicit pipeline choices per family; the manifest records them (build.pipeline).
CUDA_GRAPHS = True


def pass_config(family: str) -> dict[str, Any]:
    """The PassContext config tvm.compile runs under for this family."""
    if family == "cuda":
        # TIR's common-subexpression pass emits a use before its definition in the KV
        # cache's llama3-rope kernels for CUDA ("cse_v18 has been used before definition").
        return {"relax.backend.use_cuda_graph": CUDA_GRAPHS, "tirx.disable_cse_tir": True}
    return {}


def describe(family: str) -> dict[str, Any]:
    """The manifest's record of the pipeline a library was built with."""
    if family == "cuda":
        from vtool.schedules.cuda import describe as schedules

        return {"passes": ["FuseTransposeMatmul", "cuda.library_dispatch", "LegalizeOps", "AnnotateTIROpPattern",
                           "FoldConstant", "FuseOps", "FuseTIR", "vtool.schedules.cuda", "cuda.dataflow_lower",
                           "cuda.finalize"],
                "schedules": schedules(), "cuda_graph": CUDA_GRAPHS, "pass_config": pass_config(family),
                "opt_level": 3}
    return {"passes": ["FuseTransposeMatmul", "cpu.library_dispatch", "cpu.legalize", "vtool.schedules.cpu",
                       "cpu.dataflow_lower", "cpu.finalize"]}


def build_pipeline(target: tvm.target.Target, family: str) -> tvm.transform.Pass:
    if family == "x86":
        return _cpu_pipeline(target)
    if family == "cuda":
        return _cuda_pipeline(target)
    raise NotImplementedError(f"no pipeline for target family {family!r} yet")


def _cpu_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    schedule_pass = rules_for("x86")

    @tvm.transform.module_pass(opt_level=0, name="VtoolCPUPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            passes = (
                [relax.transform.FuseTransposeMatmul()]
                + cpu.library_dispatch_passes(target)
                + cpu.legalize_passes(target)
                + [schedule_pass]
                + cpu.dataflow_lower_passes(target)
                + cpu.finalize_passes(target)
            )
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def _cuda_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    from tvm.relax.backend.cuda import pipeline as cuda

    schedule_pass = rules_for("cuda")

    @tvm.transform.module_pass(opt_level=0, name="VtoolCUDAPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            passes = (
                # First, or every x @ W.T transposes its weight per call.
                [relax.transform.FuseTransposeMatmul()]
                + cuda.library_dispatch_passes(target)
                # cuda.legalize_passes(target) without its trailing DLight pass: our rules
                # (vtool.schedules.cuda) replace it.
                + [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                   relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR(),
                   schedule_pass]
                + cuda.dataflow_lower_passes(target)
                + cuda.finalize_passes(target)
            )
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
