"""The integer-dot decode GEMVs (schedules/cpu/int8_gemv.py) against an oracle nobody here wrote:
gguf-py quantizes random weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; IQ4_NL blocks come from
tests/support/quant_gguf.py's encoder) and the activation row (Q8_0, as
llama.cpp's dot products take it) and dequantizes both; the product of the two
dequantized operands is what the kernel must compute, up to float32 summation order.

Each ISA runs where this CPU can execute it (AVX2 on any x86-64 CI machine of today;
AVX-512 VNNI on Ice Lake / Zen 4 and later) and is skipped, saying why, elsewhere."""
from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st

from quant_gguf import quantize
from vtool.models.int8_activations import int8_isa as isa_for
from vtool.schedules.cpu.int8_gemv import DEFAULT_CHUNK, FORMATS, MAX_CHUNK, gemm_func, gemv_func
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
    raw = quantize(w, getattr(Q, fmt))  # gguf-py's quantizer (IQ4_NL: tests/support/quant_gguf.py's encoder)
    parts = quant_blocks.repack(fmt, raw, k)
    args = [tvm.runtime.tensor(x.reshape(1, 1, k))] + [tvm.runtime.tensor(parts[p])
                                                         for p in quant_blocks.FORMATS[fmt].parts]
    y = tvm.runtime.tensor(np.full((1, 1, n), np.nan, np.float32))
    _compile(fmt, isa, n, k)(*args, y)
    got, want = y.numpy()[0, 0], _oracle(fmt, raw, x)
    scale = float(np.abs(want).max())
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale + 1e-6)


@functools.lru_cache(maxsize=None)
def _gemm_and_gemv(fmt: str, isa: str, n: int, k: int, rows_per_chunk: int):
    gemm = gemm_func(fmt, isa, n, k, (1, tvm.tirx.Var("m", "int64")), rows_per_chunk=rows_per_chunk)
    return _compile_func(gemm, isa), _compile(fmt, isa, n, k)


def _compile_func(func, isa: str):
    target = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": MCPU[isa]})
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]


def _gemm_rows_check(fmt: str, isa: str, m: int, seed: int, rows_per_chunk: int = DEFAULT_CHUNK) -> None:
    """m rows through the GEMM: each row equals the GEMV of that row bit for bit (speculative
    verification scores k + 1 positions with the GEMM and must give decode's numerics), and
    the oracle up to float32 summation order."""
    n, k = 64, 256
    rng = np.random.default_rng(seed)
    raw = quantize((rng.standard_normal((n, k)) * rng.uniform(0.01, 0.3, (n, 1))).astype(np.float32),
                   getattr(Q, fmt))
    gemm, gemv = _gemm_and_gemv(fmt, isa, n, k, rows_per_chunk)
    parts = _parts(fmt, raw, k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
    x[rng.integers(m), :32] = 0  # an all-zero block in one row
    y = tvm.runtime.tensor(np.full((1, m, n), np.nan, np.float32))
    gemm(tvm.runtime.tensor(x[None]), *parts, y)
    got = y.numpy()[0]
    for row in range(m):
        one = tvm.runtime.tensor(np.full((1, 1, n), np.nan, np.float32))
        gemv(tvm.runtime.tensor(x[row].reshape(1, 1, k)), *parts, one)
        np.testing.assert_array_equal(got[row], one.numpy()[0, 0], err_msg=f"row {row} of {m}")
    want = _oracle(fmt, raw, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(np.abs(want).max()), err_msg=f"{m} rows")


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_rows_equal_the_gemv_for_1_to_9_rows(isa, fmt):
    """Every row count a verify step of k <= 8 drafts gives: full passes of DEFAULT_CHUNK rows,
    then one pass of the remaining count."""
    _runnable(isa)
    for m in range(1, 10):
        _gemm_rows_check(fmt, isa, m, seed=m)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_rows_equal_the_gemv_any_rows_any_chunk(isa, fmt):
    """Under hypothesis: row counts past a few passes, and every pass size the kernel allows."""
    _runnable(isa)

    @settings(max_examples=20, deadline=None)
    @given(m=st.integers(1, 40), chunk=st.sampled_from([1, 3, 4, DEFAULT_CHUNK, MAX_CHUNK]), seed=st.integers(0, 2**16))
    def check(m, chunk, seed):
        _gemm_rows_check(fmt, isa, m, seed, chunk)

    check()


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_panels_give_the_gemv_rows(isa, fmt):
    """Panels of 2 passes of 4 rows (256 columns = 8 blocks of 32 quantized bytes per row, panels
    of 8 rows): 33 rows are 4 whole panels and a last one of 1 row; every row equals the GEMV's bit
    for bit, and the oracle up to float32 summation order."""
    _runnable(isa)
    n, k, m = 64, 256, 33
    rng = np.random.default_rng(17)
    raw = quantize((rng.standard_normal((n, k)) * rng.uniform(0.01, 0.3, (n, 1))).astype(np.float32),
                   getattr(Q, fmt))
    parts = _parts(fmt, raw, k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
    gemm = _compile_func(gemm_func(fmt, isa, n, k, (1, tvm.tirx.Var("m", "int64")), rows_per_chunk=4,
                                   panel_bytes=8 * k), isa)
    y = tvm.runtime.tensor(np.full((1, m, n), np.nan, np.float32))
    gemm(tvm.runtime.tensor(x[None]), *parts, y)
    got = y.numpy()[0]
    gemv = _compile(fmt, isa, n, k)
    for row in range(m):
        one = tvm.runtime.tensor(np.full((1, 1, n), np.nan, np.float32))
        gemv(tvm.runtime.tensor(x[row].reshape(1, 1, k)), *parts, one)
        np.testing.assert_array_equal(got[row], one.numpy()[0, 0], err_msg=f"row {row} of {m}")
    want = _oracle(fmt, raw, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(np.abs(want).max()))


def test_rows_per_chunk_out_of_range_is_refused():
    with pytest.raises(ValueError, match="rows_per_chunk"):
        gemm_func("Q4_1", "avx2", 64, 256, (1, tvm.tirx.Var("m", "int64")), rows_per_chunk=MAX_CHUNK + 1)


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
        gemv_func("Q4_K", "avx2", 8, 256, 2)  # the K-quants' kernels are kquant_gemv.py's (Q8_K activations)


def test_activations_option_resolves_and_refuses_by_name():
    from vtool import VtoolError
    from vtool.targets import buildable
    from vtool.toolchain.build import resolve_activations

    q41 = {"model.layers.0.mlp.down_proj": "Q4_1"}
    # auto: integer dots for prompts too (issue 16: every kept format's integer GEMM beats the float one)
    assert resolve_activations("auto", buildable("x86-avx512-vnni"), q41) == "q8_0"
    assert resolve_activations("auto", buildable("x86-avx2"), q41) == "q8_0"
    assert resolve_activations("q8_0", buildable("x86-avx2"), q41) == "q8_0"
    assert resolve_activations("decode", buildable("x86-avx512"), q41) == "decode"
    assert resolve_activations("auto", buildable("x86-portable"), q41) == "none"  # no integer-dot tier
    assert resolve_activations("auto", buildable("x86-avx2"), {"lm_head": "Q6_K"}) == "q8_0"  # Q8_K activations
    assert resolve_activations("auto", buildable("x86-portable"), {"lm_head": "Q6_K"}) == "none"
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
