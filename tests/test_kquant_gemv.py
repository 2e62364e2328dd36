"""The K-quant decode GEMVs with Q8_K activations (schedules/cpu/kquant_gemv.py) against an oracle
nobody here wrote: random weights encoded to Q4_K / Q6_K blocks (tests/support/quant_gguf.py)
and dequantized by gguf-py; the
activation row goes through llama.cpp's Q8_K quantizer (quantize_row_q8_K_ref, transcribed in
numpy by tests/support/hf_oracle.py, as gguf-py has no Q8_K quantizer); the product of the two
dequantized operands is what the kernel must compute, up to float32 summation order.

Each ISA runs where this CPU can execute it and is skipped, saying why, elsewhere. Shapes are
small: the whole file runs in well under a minute."""
from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import tvm
from hf_oracle import q8_k_blocks
from quant_gguf import quantize
from vtool.models.int8_activations import Q8_K_FORMATS
from vtool.runtime.weights import quant_blocks
from vtool.schedules.cpu import kquant_gemv
from vtool.schedules.cpu.int8_gemv import Int8GemvKernels
from vtool.targets.host import host_cpu_features

Q = gguf.GGMLQuantizationType
MCPU = {"avx512vnni": "cascadelake", "avx2": "haswell"}
NEEDS = {"avx512vnni": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "avx2": {"avx2", "fma", "f16c"}}
SHAPES = [(4, 256), (64, 768)]  # one tile and one super-block; several of each


def _runnable(isa: str) -> None:
    missing = NEEDS[isa] - set(host_cpu_features())
    if missing:
        pytest.skip(f"this CPU cannot execute {isa} code (missing {', '.join(sorted(missing))})")


@functools.lru_cache(maxsize=None)
def _compiled(fmt: str, isa: str, n: int, k: int, gemm: bool):
    if gemm:
        func = kquant_gemv.gemm_func(fmt, isa, n, k, (1, tvm.tirx.Var("m", "int64")))
    else:
        func = kquant_gemv.gemv_func(fmt, isa, n, k, 2)
    target = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": MCPU[isa]})
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]


def _weights(fmt: str, n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 0.2, (n, 1))).astype(np.float32)
    w[:, :32] += 0.3  # a sub-block with a large positive offset: Q4_K's min term matters
    raw = quantize(w, getattr(Q, fmt))  # gguf-py has no K-quant encoder: tests/support/quant_gguf.py's
    parts = quant_blocks.repack(fmt, raw, k)
    return raw, [tvm.runtime.tensor(parts[p]) for p in quant_blocks.FORMATS[fmt].parts]


def _oracle(fmt: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x [m, k] -> [m, n]: Q8_K(x) dequantized times gguf-py's dequantized weights, in float64."""
    w = gguf.quants.dequantize(raw, getattr(Q, fmt)).astype(np.float64)
    d, q = q8_k_blocks(x)
    xq = (d[..., None].astype(np.float64) * q.reshape(*d.shape, -1)).reshape(x.shape)
    return (xq @ w.T).astype(np.float32)


def _inputs(k: int, m: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
    if k > 256:  # (not the only one: an all-zero row would pass against any weights)
        x[0, :256] = 0  # an all-zero super-block: d_x = 0 must not divide by zero
        x[0, 300] = -40.0  # a negative largest value: iscale > 0 there
    return x


@pytest.mark.parametrize("isa", kquant_gemv.ISAS)
@pytest.mark.parametrize("fmt", kquant_gemv.FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_equals_q8_k_activations_times_dequantized_weights(isa, fmt, n, k):
    _runnable(isa)
    raw, parts = _weights(fmt, n, k, seed=n + k)
    x = _inputs(k, 1, seed=k)
    y = tvm.runtime.tensor(np.full((1, 1, n), np.nan, np.float32))
    _compiled(fmt, isa, n, k, False)(tvm.runtime.tensor(x.reshape(1, 1, k)), *parts, y)
    got, want = y.numpy()[0, 0], _oracle(fmt, raw, x)[0]
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(np.abs(want).max()) + 1e-6)


@pytest.mark.parametrize("isa", kquant_gemv.ISAS)
@pytest.mark.parametrize("fmt", kquant_gemv.FORMATS)
def test_gemm_rows_equal_the_gemv(isa, fmt):
    """Several rows (batched decode, speculative verification): each row equals the GEMV of
    that row bit for bit, and the oracle up to summation order."""
    _runnable(isa)
    n, k, m = 8, 512, 5
    raw, parts = _weights(fmt, n, k, seed=3)
    x = _inputs(k, m, seed=4)
    y = tvm.runtime.tensor(np.full((1, m, n), np.nan, np.float32))
    _compiled(fmt, isa, n, k, True)(tvm.runtime.tensor(x[None]), *parts, y)
    got = y.numpy()[0]
    gemv = _compiled(fmt, isa, n, k, False)
    for row in range(m):
        one = tvm.runtime.tensor(np.full((1, 1, n), np.nan, np.float32))
        gemv(tvm.runtime.tensor(x[row].reshape(1, 1, k)), *parts, one)
        np.testing.assert_array_equal(got[row], one.numpy()[0, 0], err_msg=f"row {row}")
    want = _oracle(fmt, raw, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("isa", kquant_gemv.ISAS)
def test_activation_ties_round_to_even(isa):
    """iscale * x exactly halfway between integers rounds to even, as llama.cpp's nearest_int
    (the float magic-number trick) does: 127 / -127 makes iscale = 1 and the quants x."""
    _runnable(isa)
    n, k = 4, 256
    x = np.zeros((1, k), np.float32)
    x[0, 0] = -127.0
    x[0, 1:9] = [0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 100.5, -100.5]
    x[0, 40:44] = [3.5, -3.5, 4.5, -4.5]
    d, q = q8_k_blocks(x)
    assert d[0, 0] == 1.0 and list(q[0, 1:9]) == [0, 0, 2, -2, 2, -2, 100, -100]
    raw, parts = _weights("Q6_K", n, k, seed=5)
    y = tvm.runtime.tensor(np.zeros((1, 1, n), np.float32))
    _compiled("Q6_K", isa, n, k, False)(tvm.runtime.tensor(x.reshape(1, 1, k)), *parts, y)
    np.testing.assert_allclose(y.numpy()[0, 0], _oracle("Q6_K", raw, x)[0], rtol=0, atol=1e-4)


def test_formats_and_refusals():
    assert kquant_gemv.FORMATS == Q8_K_FORMATS
    assert set(Q8_K_FORMATS) <= set(Int8GemvKernels("avx2").formats)
    with pytest.raises(ValueError, match="k % 256"):
        kquant_gemv.gemv_func("Q4_K", "avx2", 8, 128, 2)
    with pytest.raises(ValueError, match="no Q8_K-activation GEMV"):
        kquant_gemv.gemv_func("Q4_1", "avx2", 8, 256, 2)
