"""One reshape for a chain of reshapes: R.reshape(R.reshape(x, a), b) -> R.reshape(x, b).

Why: a model's own reshape next to one inside TVM's KV-cache wrapper (the decoder's
(b, s, heads, d) q|k|v, which attention_with_fused_qkv reshapes again to (b * s, heads, d), and
the same pair around its output) legalizes to two reshape kernels that FuseOps fuses into one
copy kernel. RewriteDataflowReshape only turns a kernel that is a single reshape into a view
(vm.builtin.reshape), so each layer ran two copy kernels per step. Collapsed, each pair is one
reshape, which becomes a view: no kernel, no copy. An inner reshape that something else still
reads stays for that reader.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

PASS_NAME = "VtoolCollapseReshapeChains"


def _collapse(func: relax.Function) -> relax.Function:
    source, inner_shape, outer_shape = wildcard(), wildcard(), wildcard()
    chain = is_op("relax.reshape")(is_op("relax.reshape")(source, inner_shape), outer_shape)

    def rewrite(_expr: relax.Expr, matches: dict) -> relax.Expr:
        return relax.op.reshape(matches[source], matches[outer_shape])

    return rewrite_call(chain, rewrite, func)


def collapse_reshape_chains() -> tvm.transform.Pass:
    """The module pass: every Relax function's reshape chains collapsed (to a fixed point:
    rewrite_call repeats until nothing matches, so a chain of three is one reshape too)."""

    @tvm.transform.module_pass(opt_level=0, name=PASS_NAME)
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs, global_infos=mod.global_infos)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                out[gv] = _collapse(func)
        return relax.transform.DeadCodeElimination()(out)

    return _pass
