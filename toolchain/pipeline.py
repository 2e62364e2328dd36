"""vtool's Relax pipeline per target family.

TVM's "default" pipeline legalizes `x @ W.T` into a transpose of every weight on every
call plus a matmul; FuseTransposeMatmul turns that into one NT_matmul kernel (14x
faster decode on CPU, measured in the TVM notes). After legalization the target's
schedule rules from vtool.schedules run on the TIR kernels.
"""
from __future__ import annotations

import tvm
from tvm import relax

from vtool.schedules import rules_for


def build_pipeline(target: tvm.target.Target, family: str) -> tvm.transform.Pass:
    if family != "x86":
        raise NotImplementedError(f"no pipeline for target family {family!r} yet")
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    schedule_pass = rules_for(family)

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
