"""toolchain/reshape_chains.py: a chain of Relax reshapes becomes one reshape (which TVM's
RewriteDataflowReshape then turns into a view instead of a copy kernel), an inner reshape that
something else reads is kept for it, and the function computes the same values (run by TVM's VM)."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import relax as R
from tvm.script import tirx as T

from vtool.toolchain.reshape_chains import collapse_reshape_chains


def _reshape_calls(func: relax.Function) -> list[relax.Call]:
    calls: list[relax.Call] = []

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.reshape":
            calls.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return calls


def _run(mod: tvm.IRModule, x: np.ndarray) -> list[np.ndarray]:
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x))
    return [o.numpy() for o in out] if hasattr(out, "__len__") and not hasattr(out, "numpy") else [out.numpy()]


def test_a_chain_of_three_reshapes_becomes_one():
    @tvm.script.ir_module
    class Chain:
        @R.function
        def main(x: R.Tensor((2, 3, 12), "float32")) -> R.Tensor((6, 4, 3), "float32"):
            with R.dataflow():
                a = R.reshape(x, (2, 3, 4, 3))
                b = R.reshape(a, (6, 4, 3, 1))
                c = R.reshape(b, (6, 4, 3))
                R.output(c)
            return c

    out = collapse_reshape_chains()(Chain)
    calls = _reshape_calls(out["main"])
    assert len(calls) == 1
    assert [int(d) for d in calls[0].args[1].values] == [6, 4, 3]
    assert calls[0].args[0].same_as(out["main"].params[0])  # straight from x
    x = np.arange(72, dtype=np.float32).reshape(2, 3, 12)
    np.testing.assert_array_equal(_run(out, x)[0], x.reshape(6, 4, 3))


def test_an_inner_reshape_read_elsewhere_is_kept_for_its_reader():
    @tvm.script.ir_module
    class Shared:
        @R.function
        def main(x: R.Tensor((4, 6), "float32")):
            with R.dataflow():
                a = R.reshape(x, (2, 2, 6))
                b = R.reshape(a, (24,))
                c = R.add(a, a)
                R.output(b, c)
            return (b, c)

    out = collapse_reshape_chains()(Shared)
    calls = _reshape_calls(out["main"])
    # b reads x directly now; a stays, because c reads it
    assert sorted(tuple(int(d) for d in call.args[1].values) for call in calls) == [(2, 2, 6), (24,)]
    assert all(call.args[0].same_as(out["main"].params[0]) for call in calls)
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    b, c = _run(out, x)
    np.testing.assert_array_equal(b, x.reshape(24))
    np.testing.assert_array_equal(c, (x + x).reshape(2, 2, 6))


def test_a_symbolic_chain_collapses_and_a_lone_reshape_is_untouched():
    @tvm.script.ir_module
    class Symbolic:
        @R.function
        def main(x: R.Tensor(("n", 8), "float32"), y: R.Tensor((4, 4), "float32")):
            n = T.int64()
            with R.dataflow():
                a = R.reshape(x, (n, 2, 4))
                b = R.reshape(a, (n * 8,))
                d = R.reshape(y, (16,))
                R.output(b, d)
            return (b, d)

    out = collapse_reshape_chains()(Symbolic)
    calls = _reshape_calls(out["main"])
    assert len(calls) == 2
    x, y = out["main"].params
    assert sum(call.args[0].same_as(x) for call in calls) == 1  # b = reshape(x, (n * 8,))
    assert sum(call.args[0].same_as(y) for call in calls) == 1  # d, as it was
