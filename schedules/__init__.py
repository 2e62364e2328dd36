"""Schedule rules per target family, applied to the TIR kernels after legalization.

`rules_for(family)` returns one module pass; each rule leaves alone a kernel it does
not recognise, so an unscheduled kernel is slow but never wrong.
"""
from __future__ import annotations

import tvm


def rules_for(family: str) -> tvm.transform.Pass:
    if family == "x86":
        from vtool.schedules.cpu import cpu_schedule_pass

        return cpu_schedule_pass()
    if family == "cuda":
        from vtool.schedules.cuda import cuda_schedule_pass

        return cuda_schedule_pass()
    raise NotImplementedError(f"no schedule rules for target family {family!r}")
