"""Schedule rules per target family, applied to the TIR kernels after legalization.

Each subpackage is one rule set (`cpu`, `cuda`) exporting `schedule_pass()`; the
target-family table (vtool.toolchain.families) names the rule set of each family, so this
package knows no family names. `rules_for(rule_set)` returns one module pass; each rule
leaves alone a kernel it does not recognise, so an unscheduled kernel is slow but never
wrong. With tuning records (vtool.toolchain.records), a kernel whose structural hash has a
record gets the record's MetaSchedule trace instead (or, for a static-shape bucket of a
symbolic kernel, a dispatch between the tuned bucket and the rule schedule); the rules see
every other kernel.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import tvm

from vtool import VtoolError


def rules_for(rule_set: str, records: Any = None) -> tvm.transform.Pass:
    """The rule pass of `rule_set` (a subpackage of vtool.schedules); with `records` (a
    vtool.toolchain.records.RecordSet), the records' pass wrapped around it."""
    rules = _rules(rule_set)
    if records is None:
        return rules
    return records.schedule_pass(rules)


def _rules(rule_set: str) -> tvm.transform.Pass:
    name = f"{__name__}.{rule_set}"
    if not rule_set.isidentifier() or importlib.util.find_spec(name) is None:
        raise VtoolError(f"no schedule rule set {rule_set!r} under vtool.schedules")
    return importlib.import_module(name).schedule_pass()
