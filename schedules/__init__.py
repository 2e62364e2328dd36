"""Schedule rules per target family, applied to the TIR kernels after legalization.

`rules_for(family)` returns one module pass; each rule leaves alone a kernel it does
not recognise, so an unscheduled kernel is slow but never wrong. With tuning records
(vtool.toolchain.records), a kernel whose structural hash has a record gets the record's
MetaSchedule trace instead (or, for a static-shape bucket of a symbolic kernel, a dispatch
between the tuned bucket and the rule schedule); the rules see every other kernel.
"""
from __future__ import annotations

from typing import Any

import tvm


def rules_for(family: str, records: Any = None) -> tvm.transform.Pass:
    """The family's rule pass; with `records` (a vtool.toolchain.records.RecordSet), the
    records' pass wrapped around it."""
    rules = _rules(family)
    if records is None:
        return rules
    return records.schedule_pass(rules)


def _rules(family: str) -> tvm.transform.Pass:
    if family in ("x86", "arm"):  # one set of CPU rules; vector_lanes reads the target's width
        from vtool.schedules.cpu import cpu_schedule_pass

        return cpu_schedule_pass()
    if family == "cuda":
        from vtool.schedules.cuda import cuda_schedule_pass

        return cuda_schedule_pass()
    raise NotImplementedError(f"no schedule rules for target family {family!r}")
