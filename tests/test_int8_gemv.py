"""The integer-dot decode GEMVs (schedules/cpu/int8_gemv.py) against an oracle nobody here wrote:
gguf-py quantizes random weights (Q8_0, Q4_0, Q4_1) and the activation row (Q8_0, as
llama.cpp's dot products take it) and dequantizes both; the product of the two
dequantized operands is what the kernel must compute, up to float32 summation order.

Each ISA runs where this CPU can execute it (AVX2 on any x86-64 CI machine of today;
AVX-512 VNNI on Ice Lake / Zen 4 and later) and is skipped, saying why, elsewhere."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import tvm

from vtool.models.int8_activations import int8_isa as isa_for
from vtool.schedules.cpu.int8_gemv import FORMATS, gemm_func, gemv_func
from vtool.runtime.weights import quant_blocks
from vtool.targets.host import host_cpu_features

Q = gguf.GGMLQuantizationType
MCPU = {"avx512vnni": "cascadelake", "avx2": "haswell"}
NEEDS = {"avx512vnni": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "avx2": {"avx2", "fma", "f16c"}}
# (rows, cols): a tile or two, the default model's shapes, a wide row and a tall lm_head slice
SHAPES = [(4, 32), (8, 64), (1536, 576), (576, 1536), (64, 4096), (4096, 128)]
QUICK_SHAPES = {(4, 32), (1536, 576)}  # the others are slow


def _runnable(isa: str) -> None:
    missing = NEEDS[isa] - set(host_cpu_features())
    if missing:
        pytest.skip(f"this CPU cannot execute {isa} code (missing {', '.join(sorted(missing))})")


def _compile(fmt: str, isa: str, n: int, k: int, gemm: bool = False):
    func = gemm_func(fmt, isa, n, k, (1, tvm.tirx.Var("m", "int64"))) if gemm else gemv_func(fmt, isa, n, k, lead=2)
    func = func.with_attr("global_symbol", "main")
    target = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": MCPU[isa]})
    return tvm.compile(tvm.IRModule({"main": func}), target=target)["main"]


def _oracle(fmt: str, w_raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x [k] or [m, k] -> y [n] or [m, n]."""
    w = gguf.quants.dequantize(w_raw, getattr(Q, fmt))
    rows = np.atleast_2d(x)
    xq = gguf.quants.dequantize(gguf.quants.quantize(rows, Q.Q8_0), Q.Q8_0)
    return (xq.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32).reshape(*x.shape[:-1], -1)


def _parts(fmt: str, raw: np.ndarray, k: int) -> list:
    parts = quant_blocks.repack(fmt, raw, k)
    return [tvm.runtime.tensor(parts[p]) for p in quant_blocks.FORMATS[fmt].parts]


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [pytest.param(n, k, marks=() if (n, k) in QUICK_SHAPES else pytest.mark.slow)
                                 for n, k in SHAPES])
def test_gemv_equals_q8_0_activations_times_dequantized_weights(isa, fmt, n, k):
    _runnable(isa)
    rng = np.random.default_rng(n * 7 + k)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 0.2, (n, 1))).astype(np.float32)
    x = (rng.standard_normal(k) * 3).astype(np.float32)
    x[:32] = 0  # an all-zero block: d_x = 0 must not divide by zero
    raw = gguf.quants.quantize(w, getattr(Q, fmt))
    parts = quant_blocks.repack(fmt, raw, k)
    args = [tvm.runtime.tensor(x.reshape(1, 1, k))] + [tvm.runtime.tensor(parts[p])
                                                         for p in quant_blocks.FORMATS[fmt].parts]
    y = tvm.runtime.tensor(np.full((1, 1, n), np.nan, np.float32))
    _compile(fmt, isa, n, k)(*args, y)
    got, want = y.numpy()[0, 0], _oracle(fmt, raw, x)
    scale = float(np.abs(want).max())
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale + 1e-6)


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_rows_in_chunks_and_the_rest(isa, fmt):
    """Symbolic row counts (prefill, batches): chunks of 4 rows share each weight load, the
    remainder goes one row at a time; every row must equal its own GEMV."""
    _runnable(isa)
    n, k = 64, 256
    rng = np.random.default_rng(11)
    raw = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.1).astype(np.float32), getattr(Q, fmt))
    run = _compile(fmt, isa, n, k, gemm=True)
    for m in (1, 3, 4, 9):
        x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
        y = tvm.runtime.tensor(np.full((1, m, n), np.nan, np.float32))
        run(tvm.runtime.tensor(x[None]), *_parts(fmt, raw, k), y)
        want = _oracle(fmt, raw, x)
        np.testing.assert_allclose(y.numpy()[0], want, rtol=0, atol=2e-5 * float(np.abs(want).max()),
                                   err_msg=f"{m} rows")


def test_isa_choice_by_cpu_name():
    assert isa_for("cascadelake", []) == "avx512vnni"
    assert isa_for("znver4", []) == "avx512vnni"
    assert isa_for("haswell", []) == "avx2"
    assert isa_for("skylake-avx512", []) == "avx2"  # AVX-512 without VNNI: the 256-bit path
    assert isa_for("x86-64", []) is None  # SSE2 only: the float path
    assert isa_for("generic", ["+avx512vnni"]) == "avx512vnni"


def test_shapes_a_tile_cannot_cover_are_refused():
    with pytest.raises(ValueError, match="n % 4"):
        gemv_func("Q4_1", "avx2", 6, 64, 2)
    with pytest.raises(ValueError, match="no int8 GEMV"):
        gemv_func("Q4_K", "avx2", 8, 256, 2)


def test_activations_option_resolves_and_refuses_by_name():
    from vtool import VtoolError
    from vtool.targets import buildable
    from vtool.toolchain.build import resolve_activations

    q41 = {"model.layers.0.mlp.down_proj": "Q4_1"}
    assert resolve_activations("auto", buildable("x86-avx512-vnni"), q41) == "decode"
    assert resolve_activations("auto", buildable("x86-avx2"), q41) == "decode"
    assert resolve_activations("q8_0", buildable("x86-avx2"), q41) == "q8_0"
    assert resolve_activations("decode", buildable("x86-avx512"), q41) == "decode"
    assert resolve_activations("auto", buildable("x86-portable"), q41) == "none"  # no integer-dot tier
    assert resolve_activations("auto", buildable("x86-avx2"), {"lm_head": "Q6_K"}) == "none"  # no int8 kernel
    assert resolve_activations("auto", buildable("x86-avx2"), {}) == "none"
    assert resolve_activations("none", buildable("x86-avx2"), q41) == "none"
    with pytest.raises(VtoolError, match="x86-portable has none"):
        resolve_activations("q8_0", buildable("x86-portable"), q41)
    with pytest.raises(VtoolError, match="keeps none"):
        resolve_activations("decode", buildable("x86-avx2"), {})
    with pytest.raises(VtoolError, match="unknown --activations 'int4'"):
        resolve_activations("int4", buildable("x86-avx2"), q41)


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
def test_activation_ties_round_away_from_zero(isa):
    """x / d_x exactly halfway between integers rounds away from zero, as GGML's reference
    quantizer (roundf) and gguf-py do; rounding to even would move these sums by d_x * w."""
    _runnable(isa)
    n, k = 8, 64
    x = np.zeros(k, np.float32)
    x[0] = x[32] = 127.0  # d_x = 1 in both blocks: x / d_x is x itself
    x[1:9] = [0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 100.5, -100.5]
    x[33:37] = [3.5, -3.5, 4.5, -4.5]
    w = np.random.default_rng(5).standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, Q.Q8_0)
    y = tvm.runtime.tensor(np.zeros((1, 1, n), np.float32))
    _compile("Q8_0", isa, n, k)(tvm.runtime.tensor(x.reshape(1, 1, k)), *_parts("Q8_0", raw, k), y)
    want = _oracle("Q8_0", raw, x)
    np.testing.assert_allclose(y.numpy()[0, 0], want, rtol=0, atol=1e-4)
