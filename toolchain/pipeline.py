"""vtool's Relax pipeline per target family (what differs per family is its entry in
toolchain/families.py: model passes, Relax backend, schedule rules, PassContext).

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

from vtool.toolchain.families import family_named


def pass_config(family: str) -> dict[str, Any]:
    """The PassContext config tvm.compile runs under for this family (toolchain/families.py)."""
    return dict(family_named(family).pass_config)


def pass_context(family: str) -> Any:
    """The PassContext a build of this family compiles under (CPU builds: the ambient one).
    `vtool tune` extracts kernels under it too: passes and configs that differ would give
    kernels whose hashes no build looks up."""
    return family_named(family).pass_context()


def describe(family: str, gemm: str = "tir") -> dict[str, Any]:
    """The manifest's record of the pipeline a library was built with."""
    entry = family_named(family)
    return entry.describe_pipeline(entry, gemm)


def kernel_passes() -> list[tvm.transform.Pass]:
    """Legalize + fuse: after these the module holds the fused TIR kernels the schedule
    pass sees (`vtool tune` extracts them with the same passes, so hashes match)."""
    return [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR()]


def build_pipeline(target: tvm.target.Target, family: str, gemm: str = "tir",
                   records: Any = None, until_schedules: bool = False) -> tvm.transform.Pass:
    """The family's model passes, (with gemm="cublas", the prefill/batched matmuls to
    cuBLAS,) FuseTransposeMatmul, the family's Relax backend's library dispatch, legalize +
    fuse, the family's schedule rules (tuning records first when `records`, a
    vtool.toolchain.records.RecordSet, is given), the backend's dataflow lowering and
    finalize passes. until_schedules: stop before the schedule pass (`vtool tune` extracts
    the kernels there)."""
    entry = family_named(family)
    backend = entry.backend()
    schedule_pass = entry.rules(records)
    # the family's own Relax passes (CUDA: the split-KV decode attention), then the cuBLAS offload
    offload: list[tvm.transform.Pass] = [make() for _name, make in entry.model_passes]
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
