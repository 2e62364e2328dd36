"""CPU schedule rules (x86 now; NEON with the CPU-speed work)."""
from __future__ import annotations

import tvm


def cpu_schedule_pass() -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name="VtoolCPUSchedules")
    def _apply(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return mod

    return _apply
