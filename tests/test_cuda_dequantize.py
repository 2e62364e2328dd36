"""The CUDA schedule of the prompts' whole-weight dequantization (schedules/cuda/dequantize.py).

Without a GPU: for every format kept in blocks, the CUDA build's schedule pass takes the
kernel, and its CUDA source loads a thread's quant bytes in one vector load and writes its
weights in one 16-byte store (DLight's Fallback, what it replaced, wrote one 2-byte weight per
thread). Its numbers are checked on a GPU: tests/bench/gpu_dequantize.py compares its output
bit for bit with the Fallback kernel's, and test_gpu_quantized.py's prompts run through it
against transformers.
"""
from __future__ import annotations

import re

import pytest

pytest.importorskip("tvm", reason="the schedules need the compiler (apache-tvm)")

import tvm  # noqa: E402
from tvm import te  # noqa: E402

from vtool.models.quantized_linear import dequantize_te  # noqa: E402
from vtool.runtime.weights.ggml_blocks import FORMATS, part_dtype, part_shape, parts  # noqa: E402
from vtool.schedules.cuda import cuda_schedule_pass  # noqa: E402
from vtool.schedules.cuda.dequantize import schedule_dequantize  # noqa: E402

TARGET = {"kind": "cuda", "arch": "sm_90a"}


def _kernel(fmt: str, rows, cols: int, dtype: str = "bfloat16"):  # noqa: ANN001, ANN202
    ws = [te.placeholder(part_shape(fmt, p, rows, cols) if isinstance(rows, int) else
                         (rows // 4, *part_shape(fmt, p, 4, cols)[1:]), part_dtype(fmt, p), name=f"layer_{p}1")
          for p in parts(fmt)]
    return te.create_prim_func([*ws, dequantize_te(fmt, dtype, *ws)])


def _source(func) -> str:  # noqa: ANN001
    target = tvm.target.Target(TARGET)
    with target:
        lib = tvm.tirx.build(tvm.IRModule({"main": func}), target=target)
    return lib.imports[0].inspect_source()


def test_every_kept_format_gets_the_vector_schedule_from_the_build_pass() -> None:
    """The pass a CUDA build runs picks the schedule (256 threads a block, not Fallback's 1024)."""
    assert len(FORMATS) == 12
    for fmt in FORMATS:
        cols = 512 if fmt in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS") else 96
        mod = tvm.IRModule({"main": _kernel(fmt, 12, cols)})
        with tvm.target.Target(TARGET):
            scheduled = cuda_schedule_pass()(mod)["main"]
        source = _source(scheduled)
        assert "__launch_bounds__(256)" in source, fmt
        assert source.count("*(uint4*)(vtool_dequantize_ptr") == 1, fmt  # 8 bf16 weights in one store
        assert "vtool_dequantize_ptr[" not in source, fmt  # and no weight stored alone
        if fmt in ("Q2_K", "Q3_K"):  # 64 weights to a group of 2-bit quants: read byte by byte
            assert "layer_qweight1_local_ptr" not in source
            continue
        # the thread's 8 quant bytes in one 8-byte load (Q8_0's quants are signed)
        assert re.search(r"\*\(u?int2\*\)\(layer_qweight1_local_ptr \+ 0\) = \*\(u?int2\*\)\(layer_qweight1_ptr", source), fmt


def test_float32_weights_take_four_to_a_store() -> None:
    source = _source(schedule_dequantize(_kernel("Q4_1", 8, 64, "float32")))
    assert source.count("*(float4*)(vtool_dequantize_ptr") == 1


@pytest.mark.parametrize("case", ["symbolic rows", "other blocks", "scheduled"])
def test_what_it_is_not_given_is_left_to_the_other_rules(case: str) -> None:
    if case == "symbolic rows":
        func = _kernel("Q4_0", tvm.tirx.Var("n", "int64") * 4, 64)
    elif case == "other blocks":  # the dequantization with a consumer fused in
        ws = [te.placeholder(part_shape("Q8_0", p, 8, 64), part_dtype("Q8_0", p), name=p) for p in parts("Q8_0")]
        w = dequantize_te("Q8_0", "float32", *ws)
        func = te.create_prim_func([*ws, te.compute(w.shape, lambda i, j: w[i, j] * 2.0, name="twice")])
    else:
        func = schedule_dequantize(_kernel("Q8_0", 8, 64))
    assert schedule_dequantize(func) is None
