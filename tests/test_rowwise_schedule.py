"""The CPU row-wise rule (schedules/cpu/rowwise.py) against the unscheduled kernels it
replaces, on the fused kernels of real tiny models (RMSNorm over hidden rows and over
Qwen3's per-head q/k rows, silu * mul, residual adds), at symbolic sizes inside and around
its vector and thread splits. The oracle is the legalized kernel itself, compiled
unscheduled: elementwise outputs must be bit-identical, reductions within float32
rounding of a reordered sum. End-to-end parity with transformers is the parity tests'
job (they run these kernels scheduled).
"""
from __future__ import annotations

import numpy as np
import pytest

from vtool.schedules.cpu.rowwise import schedule_rowwise
from vtool.schedules.views import becomes_view
from vtool.toolchain.records import shape_vars
from vtool.toolchain.tune import extract_kernels

LANES = 8


def _run(func, target, bindings):  # noqa: ANN001, ANN202 - the output of func on seeded random inputs
    import tvm

    from vtool.toolchain.tune_measure import _compile, _random_args

    lib = _compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    args = _random_args(func, bindings, tvm.runtime.cpu())
    lib["main"](*args)
    return args[-1].numpy()


@pytest.mark.parametrize("shape", ["llama-gqa", pytest.param("qwen3-qknorm", marks=pytest.mark.slow)])
def test_rowwise_kernels_equal_the_unscheduled_ones(shape, tiny_shape_dir):
    from tvm import tirx

    _, target, mod = extract_kernels(tiny_shape_dir(shape), "x86-avx2", "float32", "none")
    checked = []
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None or "matmul" in gv.name_hint:
            continue
        if int(func.attrs.get("op_pattern", 0)) > 4 or becomes_view(func):
            continue
        scheduled = schedule_rowwise(func, LANES)
        if scheduled is None:
            continue
        assert scheduled.script() != func.script()
        reduction = "rms_norm" in gv.name_hint
        for size in (1, 3, 37):  # one row, fewer rows than threads, a ragged count
            bindings = {v: size for v in shape_vars(func)}
            want, got = _run(func, target, bindings), _run(scheduled, target, bindings)
            if reduction:
                np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6, err_msg=gv.name_hint)
            else:
                np.testing.assert_array_equal(got, want, err_msg=gv.name_hint)
            if not bindings:
                break
        checked.append(gv.name_hint)
    assert any(n.startswith("rms_norm") for n in checked), checked
    assert any("silu" in n for n in checked), checked
    if shape == "qwen3-qknorm":  # the q/k norms: rows are (token, head) pairs
        assert sum(n.startswith("rms_norm") for n in checked) > 3, checked


def test_the_cpu_pass_leaves_reshapes_alone(tiny_shape_dir):
    import tvm
    from tvm import tirx

    from vtool.schedules import rules_for

    _, target, mod = extract_kernels(tiny_shape_dir("llama-gqa"), "x86-avx2", "float32", "none")
    reshapes = {gv.name_hint: func for gv, func in mod.functions_items()
                if isinstance(func, tirx.PrimFunc) and becomes_view(func)}
    assert reshapes
    with target:
        scheduled = rules_for("cpu")(tvm.IRModule(dict(mod.functions_items())))
    for name, func in reshapes.items():
        after = next(f for gv, f in scheduled.functions_items() if gv.name_hint == name)
        tvm.ir.assert_structural_equal(after, func)
