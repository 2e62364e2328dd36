"""toolchain/q4_k_quantizer.py and q6_k_quantizer.py, the numpy ports of llama.cpp's
quantize_row_q4_K_ref and quantize_row_q6_K_ref that `--quantization q4_k` and `q6_k` use
(gguf-py cannot make K-quants).

- llama.cpp as the oracle: `llama-quantize --pure ... Q4_K` / `Q6_K` (the llama.cpp of the
  llama-cpp-python sdist) was run by tests/bench/k_quants_vs_llama_quantize.py --digest on the
  inputs of tests/support/k_quant_cases.py, and the sha256 of its blocks is held here: the
  ports must write the same bytes (that bench compares block by block where llama.cpp is
  built: every super-block identical, 30,720 of Q4_K and 20,480 of Q6_K, normal weights and
  crafted corner rows);
- hypothesis (Q4_K): scaling a tensor by a power of two scales d and dmin by it and leaves
  every quant and 6-bit scale as it was (every float operation of the search commutes with
  it); gguf-py reads the blocks of both types back within two quantization steps;
- zeros quantize to zeros, and rows that are not a multiple of 256 are refused by name.
"""
from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from k_quant_cases import source_file
from vtool.toolchain.q4_k_quantizer import BLOCK_BYTES, quantize_q4_k
from vtool.toolchain.q6_k_quantizer import quantize_q6_k

QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}
# tests/bench/k_quants_vs_llama_quantize.py --type T --digest (llama.cpp of llama-cpp-python 0.3.36)
LLAMA_QUANTIZE_SHA256 = {
    ("Q4_K", 0, False): "7db40806a6192b60e4006113b4aec7b9abdff72c020552e0268a45b88fcecaba",
    ("Q4_K", 0, True): "812cc918d1a7a412a94d9ad1ee2ee32f8287d7e0967534aef267532ee0ef9738",
    ("Q6_K", 0, False): "4209f68573975fee3e9c596e17e0395d96c1dd3da5437c7774e0381680d0bd18",
    ("Q6_K", 0, True): "67ba6e09445c62d5346607e7308dd6ac8afe3f13ca24256975fb75d3074b8bf9",
}


@pytest.mark.parametrize("qtype, seed, corners", sorted(LLAMA_QUANTIZE_SHA256))
def test_blocks_are_llama_quantizes(tmp_path, qtype: str, seed: int, corners: bool) -> None:
    h = hashlib.sha256()
    count = 0
    for t in sorted(gguf.GGUFReader(source_file(seed, tmp_path, corners)).tensors, key=lambda t: t.name):
        data = np.asarray(t.data, dtype=np.float32)
        if data.ndim == 2:
            h.update(t.name.encode())
            h.update(QUANTIZERS[qtype](data).tobytes())
            count += 1
    assert count >= 10
    assert h.hexdigest() == LLAMA_QUANTIZE_SHA256[(qtype, seed, corners)]


def _parts(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    b = blocks.reshape(-1, BLOCK_BYTES)
    return b[:, 0:2].copy().view(np.float16)[:, 0], b[:, 2:4].copy().view(np.float16)[:, 0], b[:, 4:]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 6), supers=st.integers(1, 3),
       shift=st.integers(-3, 3), spread=st.sampled_from([0.5, 3.0]), offset=st.sampled_from([0.0, 0.3, -0.7]))
def test_a_power_of_two_scales_d_and_dmin_and_nothing_else(seed, rows, supers, shift, spread, offset) -> None:
    x = (np.random.default_rng(seed).standard_normal((rows, 256 * supers)) * spread + offset).astype(np.float32)
    d0, m0, rest0 = _parts(quantize_q4_k(x))
    d1, m1, rest1 = _parts(quantize_q4_k(x * np.float32(2.0 ** shift)))
    # exact while d and dmin stay float16 normals (a subnormal rounds on its own grid)
    assume(all(np.all((v == 0) | (np.abs(v.astype(np.float32)) >= 2.0 ** -14)) for v in (d0, m0, d1, m1)))
    assert np.array_equal(rest0, rest1)
    assert np.array_equal(d1, (d0.astype(np.float32) * 2.0 ** shift).astype(np.float16))
    assert np.array_equal(m1, (m0.astype(np.float32) * 2.0 ** shift).astype(np.float16))


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(sorted(QUANTIZERS)), seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 6),
       spread=st.sampled_from([1e-3, 0.5, 3.0, 200.0]), offset=st.sampled_from([0.0, 0.3, -0.7]))
def test_gguf_py_reads_the_blocks_back_within_two_steps(qtype, seed, rows, spread, offset) -> None:
    """Q4_K: each weight within 2 * range / 15 of its value, the range of a group of 32 taken
    down to 0 as Q4_K's min is (seen: 1.3 at most over 2,400 groups). Q6_K: within
    2 * max|x| / 32 of a group of 16 (symmetric 6-bit levels)."""
    x = (np.random.default_rng(seed).standard_normal((rows, 512)) * spread + offset * spread).astype(np.float32)
    y = gguf.quants.dequantize(QUANTIZERS[qtype](x), gguf.GGMLQuantizationType[qtype]).reshape(x.shape)
    if qtype == "Q4_K":
        groups = x.reshape(rows, -1, 32)
        step = (groups.max(axis=-1) - np.minimum(groups.min(axis=-1), 0)) / 15
    else:
        groups = x.reshape(rows, -1, 16)
        step = np.abs(groups).max(axis=-1) / 32
    err = np.abs(y - x).reshape(groups.shape).max(axis=-1)
    assert np.all(err <= 2 * step + 1e-3 * spread)


@pytest.mark.parametrize("qtype", sorted(QUANTIZERS))
def test_zeros_stay_zeros(qtype: str) -> None:
    blocks = QUANTIZERS[qtype](np.zeros((4, 512), np.float32))
    assert not blocks.any()


@pytest.mark.parametrize("qtype", sorted(QUANTIZERS))
def test_rows_that_are_not_super_blocks_are_refused(qtype: str) -> None:
    with pytest.raises(ValueError, match=f"{qtype} needs rows of a multiple of 256"):
        QUANTIZERS[qtype](np.ones((2, 288), np.float32))
