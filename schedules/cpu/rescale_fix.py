"""A fix to TVM 0.27's serial CPU attention kernels: the rescale of the running output.

TVM's CPU paged prefill (`_attention_prefill_cpu`: full and sliding-window) and its CPU tree
attention keep the online softmax's rescale factor in `scale_O`, a 1-element buffer, and then
multiply every output element by `scale_O[d_idx]`: a read out of bounds for every d_idx > 0
(its decode kernel reads `scale_O[0]`, as intended). LLVM may happen to fold the load to
element 0 (the tests pass either way), but the read is undefined behaviour, and an
uninitialised value reached the output once in a sliding-window test. Every such load becomes
`scale_O[0]`.

The kernels vtool replaces by its own (schedules/cpu/attention.py, head dims of 16s) never
reach this; the ones it keeps (other head dims; the window-freeing cache's kernels) do. Only
attention kernels (a `sm_scale` parameter) are walked.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

BUFFER = "scale_O"


def _is_zero(indices) -> bool:  # indices: an Array of PrimExpr
    return len(indices) == 1 and isinstance(indices[0], tirx.IntImm) and indices[0].value == 0


def fix_rescale_reads(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """`func` with every `scale_O[i]` read made `scale_O[0]`, or None when it has none to fix."""
    if not any(isinstance(p, tirx.Var) and p.name == "sm_scale" for p in func.params):
        return None
    hits: list[tvm.ir.TensorLoad] = []

    def first(load: tvm.ir.TensorLoad) -> tvm.ir.TensorLoad:
        if getattr(load.source, "name", None) != BUFFER or _is_zero(load.indices):
            return load
        hits.append(load)
        return tirx.BufferLoad(load.source, [tirx.IntImm("int32", 0)])

    out = tvm_ffi.structural_map(func, [(tvm.ir.TensorLoad, first)])
    return out if hits else None
