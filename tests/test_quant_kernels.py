"""The quantized kernels (vtool.models.quantized_linear) under the CPU schedules
(vtool.schedules.cpu.quantized), compiled one by one for this CPU and held to numpy over
gguf.quants.dequantize of the same blocks (K-quant blocks from tests/support/quant_gguf.py's
encoders: gguf-py cannot quantize K-quants).

Tolerance: the kernels dequantize exactly and accumulate in float32, so only summation
order differs from the float64 reference: |y - ref| <= 1e-5 * sum_k |x_k * w_k| per output
(float32 rounding over K <= 576 terms, with a wide margin). The embedding gather is exact.
"""
from __future__ import annotations

import functools
import re

import gguf
import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import te, tirx  # noqa: E402

from quant_gguf import quantize  # noqa: E402
from vtool.runtime.weights.ggml_blocks import part_dtype, part_shape, parts  # noqa: E402
from vtool.models.quantized_linear import matmul_te, take_te  # noqa: E402
from vtool.runtime.weights.quant_blocks import repack  # noqa: E402
from vtool.schedules.cpu import vector_lanes  # noqa: E402
from vtool.schedules.cpu.quantized import schedule_quantized_matmul  # noqa: E402
from vtool.targets import buildable  # noqa: E402

FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")
K_FORMATS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # columns a multiple of 256
TARGET = tvm.target.Target(buildable("host").tvm)


def _blocks(fmt: str, n: int, k: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    w = (np.random.default_rng(seed).standard_normal((n, k)) * 0.5).astype(np.float32)
    raw = quantize(w, gguf.GGMLQuantizationType[fmt])
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(n, k)
    return repack(fmt, raw, k), deq


def _placeholders(fmt: str, n: int, k: int) -> list[te.Tensor]:
    return [te.placeholder(part_shape(fmt, p, n, k), part_dtype(fmt, p), name=p) for p in parts(fmt)]


@functools.lru_cache(maxsize=None)
def _matmul(fmt: str, n: int, k: int, rows: int | None, lanes: int):
    """Compiled [1, rows, k] x [n, k]^T; rows None = symbolic (the prefill/GEMM schedule)."""
    m = tirx.Var("m", "int64") if rows is None else rows
    x = te.placeholder((1, m, k), "float32", name="x")
    w = _placeholders(fmt, n, k)
    func = te.create_prim_func([x, *w, matmul_te(fmt, x, *w)])
    scheduled = schedule_quantized_matmul(func, lanes)
    assert scheduled is not None, "the quantized matmul rule did not recognise its kernel"
    with TARGET:
        return tvm.compile(tvm.IRModule({"main": scheduled}), target=TARGET)


def _run(lib, inputs: list[np.ndarray], out_shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in inputs] + [tvm.runtime.empty(out_shape, dtype, dev)]
    lib(*args)
    return args[-1].numpy()


def _check(y: np.ndarray, x: np.ndarray, deq: np.ndarray) -> None:
    ref = x.astype(np.float64) @ deq.T.astype(np.float64)
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(deq).T.astype(np.float64)) + 1e-30
    worst = float((np.abs(y - ref) / bound).max())
    assert worst <= 1.0, f"error {worst:.2f}x the tolerance"


@pytest.mark.parametrize("fmt, n, k", [(f, n, k) for f in FORMATS for n, k in [(64, 96), (200, 576)]]
                         + [(f, n, k) for f in K_FORMATS for n, k in [(64, 256), (200, 768)]])
def test_gemv_matches_numpy(fmt, n, k):
    w, deq = _blocks(fmt, n, k, seed=n + k)
    x = np.random.default_rng(1).standard_normal((1, 1, k)).astype(np.float32)
    y = _run(_matmul(fmt, n, k, 1, vector_lanes(TARGET)), [x, *w.values()], (1, 1, n))
    _check(y[0], x[0], deq)


@pytest.mark.parametrize("fmt", FORMATS + K_FORMATS)
def test_gemv_is_vectorized_and_parallel(fmt):
    """The decode GEMV's code, not only its result: tiles run on the thread pool and each
    tile's two chunks x ROWS rows are vector FMAs of the target's width (a schedule that
    fell back to a scalar loop would still compute the right numbers)."""
    from vtool.schedules.cpu.quantized import ROWS

    lanes = vector_lanes(TARGET)
    ir = _matmul(fmt, 64, 256, 1, lanes).mod.inspect_source("ll")
    assert "TVMBackendParallelLaunch" in ir
    fmas = len(re.findall(rf"call <{lanes} x float> @llvm\.fmuladd\.v{lanes}f32", ir))
    assert fmas >= 2 * ROWS, f"{fmt}: {fmas} vector FMAs of {lanes} lanes in the GEMV"


@pytest.mark.parametrize("fmt", FORMATS + K_FORMATS)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_gemm_matches_numpy(fmt, m):
    """Symbolic row count (prefill, batched decode): tails of every size."""
    n, k = 72, 256 if fmt in K_FORMATS else 160
    w, deq = _blocks(fmt, n, k, seed=m)
    x = np.random.default_rng(m).standard_normal((1, m, k)).astype(np.float32)
    y = _run(_matmul(fmt, n, k, None, vector_lanes(TARGET)), [x, *w.values()], (1, m, n))
    _check(y[0], x[0], deq)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q6_K"])
@pytest.mark.parametrize("lanes", [8, 4])
@pytest.mark.parametrize("rows", [1, None])
def test_narrower_vector_tiers(fmt, lanes, rows):
    """The AVX2 (8 lanes) and SSE (4 lanes) splits of a 16-weight chunk."""
    n, k, m = 40, 256, 5
    w, deq = _blocks(fmt, n, k, seed=lanes)
    m = 1 if rows == 1 else m
    x = np.random.default_rng(lanes).standard_normal((1, m, k)).astype(np.float32)
    y = _run(_matmul(fmt, n, k, rows, lanes), [x, *w.values()], (1, m, n))
    _check(y[0], x[0], deq)


@pytest.mark.parametrize("fmt", FORMATS + K_FORMATS)
def test_take_gathers_dequantized_rows(fmt):
    v, k = 48, 256 if fmt in K_FORMATS else 96
    w, deq = _blocks(fmt, v, k, seed=3)
    ids = np.array([0, 47, 5, 5, 22], dtype=np.int32)
    ids_t = te.placeholder((tirx.Var("n", "int64"),), "int32", name="ids")
    wp = _placeholders(fmt, v, k)
    func = te.create_prim_func([ids_t, *wp, take_te(fmt, "float32", ids_t, *wp)])
    with TARGET:
        lib = tvm.compile(tvm.IRModule({"main": func}), target=TARGET)
    np.testing.assert_array_equal(_run(lib, [ids, *w.values()], (len(ids), k)), deq[ids])


# --- the CPU prefill attention that replaces TVM's serial kernel (schedules/cpu/attention.py) -------
# Here because the quantized builds are what made it the prefill's bottleneck. Held to TVM's own
# kernel on the same inputs: online softmax changes only the summation order (float32).

@pytest.mark.parametrize("lens,kv_lens,causal", [([5], [5], 1), ([37, 1, 20], [37, 1, 20], 1),
                                                 ([7, 3], [19, 3], 1), ([17], [17], 0), ([130], [130], 1)])
def test_prefill_attention_matches_tvms_kernel(lens, kv_lens, causal):
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_ragged_cpu

    from vtool.schedules.cpu.attention import NAME, rewrite_prefill_ragged

    h_kv, h_q, d = 3, 9, 64
    orig = _attention_prefill_ragged_cpu(h_kv, h_q, d, d, "float32", {}).with_attr("global_symbol", NAME)
    new = rewrite_prefill_ragged(NAME, orig)
    assert new is not None and rewrite_prefill_ragged("other_name", orig) is None
    rng = np.random.default_rng(3)
    tq, tk = sum(lens), sum(kv_lens)
    inputs = [rng.standard_normal((tq, h_q, d)).astype("float32"), np.cumsum([0] + lens).astype("int32"),
              rng.standard_normal((tk, h_kv, d)).astype("float32"), rng.standard_normal((tk, h_kv, d)).astype("float32"),
              np.cumsum([0] + kv_lens).astype("int32"), np.zeros(tq, "int32"), np.zeros(len(lens), "int32")]
    results = []
    for func in (orig, new):
        lib = tvm.compile(tvm.IRModule({"main": func}), target=TARGET)
        dev = tvm.cpu()
        args = [tvm.runtime.tensor(a, dev) for a in inputs]
        out = tvm.runtime.tensor(np.zeros((tq, h_q, d), "float32"), dev)
        lse = tvm.runtime.tensor(np.zeros((tq, h_q), "float32"), dev)
        lib["main"](*args, out, lse, causal, 0, 1.0, 10000.0, 0.125)
        results.append((out.numpy(), lse.numpy()))
    np.testing.assert_allclose(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(results[1][1], results[0][1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_lens", [[1], [16], [37], [130, 1, 17]])
def test_decode_attention_matches_tvms_kernel(kv_lens):
    """The paged decode attention (one query per sequence) against TVM's serial kernel, on
    pages handed out in a shuffled order (as a KV cache's free list does)."""
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode_cpu

    from vtool.schedules.cpu.attention import DECODE_NAME, rewrite_decode_paged

    h_kv, h_q, d, page = 2, 8, 64, 16
    orig = _attention_decode_cpu(h_kv, h_q, d, "float32", False, {}).with_attr("global_symbol", DECODE_NAME)
    new = rewrite_decode_paged(DECODE_NAME, orig)
    assert new is not None and rewrite_decode_paged("other_name", orig) is None
    rng = np.random.default_rng(len(kv_lens) * 7 + kv_lens[0])
    n_pages = [(n + page - 1) // page for n in kv_lens]
    total = sum(n_pages)
    order = rng.permutation(total + 3).astype("int32")[:total]  # some pages unused
    inputs = [rng.standard_normal((len(kv_lens), h_q, d)).astype("float32"),
              rng.standard_normal((total + 3, 2, h_kv, page, d)).astype("float32"),
              np.cumsum([0] + n_pages).astype("int32"), order,
              np.array([n - (p - 1) * page for n, p in zip(kv_lens, n_pages)], "int32"),
              np.zeros(len(kv_lens), "int32"), np.zeros(len(kv_lens), "int32")]
    results = []
    for func in (orig, new):
        lib = tvm.compile(tvm.IRModule({"main": func}), target=TARGET)
        dev = tvm.cpu()
        args = [tvm.runtime.tensor(a, dev) for a in inputs]
        out = tvm.runtime.tensor(np.zeros((len(kv_lens), h_q, d), "float32"), dev)
        lse = tvm.runtime.tensor(np.zeros((len(kv_lens), h_q), "float32"), dev)
        lib["main"](*args, out, lse, 0, 1.0, 10000.0, 0.125)
        results.append((out.numpy(), lse.numpy()))
    np.testing.assert_allclose(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(results[1][1], results[0][1], atol=1e-5, rtol=1e-5)
