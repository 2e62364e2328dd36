"""Every CPU kernel declared free of aliasing parameters, so LLVM keeps sums in registers.

TVM 0.27's LLVM codegen gives a function's buffers distinct alias information only when the
function carries `tirx.noalias`; and as soon as one PrimFunc of a module lacks the attribute,
the buffers of every function in that module are marked as possibly aliased (checked: a
module of one scheduled NT matmul and TVM's `shape_func`, which has no noalias attribute,
compiles the matmul's micro-kernel with its sums stored to memory after every multiply-add;
alone, or beside functions that all carry the attribute, the sums stay in registers and are
stored once per block of inputs). A model library always holds such functions (the KV cache's
kernels, the shape functions Relax generates), so the float32 micro-kernel of
schedules/cpu/matmul.py ran at about half its speed inside every library (135 against 255
GFLOP/s at 512 x 960 x 576 on 2 cores).

Declaring them noalias is sound for how they are called: the noalias promise is broken only
when memory one parameter writes is reached through another parameter, and TVM's KV cache
hands its kernels distinct tensors for what they write (outputs, log-sum-exps, pages); the
tensors it passes twice (a ragged prefill's query and key index arrays are one array) are
only read. The shape functions write the one shape heap they are given.

It runs last in a CPU build's Relax pipeline (toolchain/pipeline.py), after the finalize passes
have added the shape functions.
"""
from __future__ import annotations

import tvm
from tvm import tirx

NOALIAS = "tirx.noalias"
PASS_NAME = "VtoolDeclareNoAlias"


def declare_noalias(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """`func` with the noalias attribute, or None when it has it already."""
    if func.attrs is not None and bool(func.attrs.get(NOALIAS, False)):
        return None
    return func.with_attr(NOALIAS, True)


def declare_noalias_pass() -> tvm.transform.Pass:
    """A module pass giving every PrimFunc of the module the noalias attribute."""

    @tvm.transform.module_pass(opt_level=0, name=PASS_NAME)
    def _declare(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {gv: declared for gv, func in mod.functions_items()
                   if isinstance(func, tirx.PrimFunc) and (declared := declare_noalias(func)) is not None}
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return _declare
