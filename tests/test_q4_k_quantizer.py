"""toolchain/q4_k_quantizer.py, the numpy port of llama.cpp's quantize_row_q4_K_ref that
`--quantization q4_k` uses (gguf-py cannot make K-quants).

- llama.cpp as the oracle: `llama-quantize --pure ... Q4_K` (the llama.cpp of the
  llama-cpp-python sdist) was run by tests/bench/q4_k_vs_llama_quantize.py --digest on the
  inputs of tests/support/q4_k_cases.py, and the sha256 of its blocks is held here: the port
  must write the same bytes (that bench compares block by block where llama.cpp is built:
  20,480 of 20,480 super-blocks identical, normal weights and crafted corner rows);
- hypothesis: scaling a tensor by a power of two scales d and dmin by it and leaves every
  quant and 6-bit scale as it was (every float operation of the search commutes with it);
  gguf-py reads the blocks back within two quantization steps of every weight;
- zeros quantize to zeros, and rows that are not a multiple of 256 are refused by name.
"""
from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from q4_k_cases import source_file
from vtool.toolchain.q4_k_quantizer import BLOCK_BYTES, quantize_q4_k

# tests/bench/q4_k_vs_llama_quantize.py --digest (llama.cpp of llama-cpp-python 0.3.36)
LLAMA_QUANTIZE_SHA256 = {
    (0, False): "7db40806a6192b60e4006113b4aec7b9abdff72c020552e0268a45b88fcecaba",
    (0, True): "812cc918d1a7a412a94d9ad1ee2ee32f8287d7e0967534aef267532ee0ef9738",
}


@pytest.mark.parametrize("seed, corners", sorted(LLAMA_QUANTIZE_SHA256))
def test_blocks_are_llama_quantizes(tmp_path, seed: int, corners: bool) -> None:
    h = hashlib.sha256()
    count = 0
    for t in sorted(gguf.GGUFReader(source_file(seed, tmp_path, corners)).tensors, key=lambda t: t.name):
        data = np.asarray(t.data, dtype=np.float32)
        if data.ndim == 2:
            h.update(t.name.encode())
            h.update(quantize_q4_k(data).tobytes())
            count += 1
    assert count >= 10
    assert h.hexdigest() == LLAMA_QUANTIZE_SHA256[(seed, corners)]


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
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 6), spread=st.sampled_from([1e-3, 0.5, 3.0, 200.0]),
       offset=st.sampled_from([0.0, 0.3, -0.7]))
def test_gguf_py_reads_the_blocks_back_within_two_steps(seed, rows, spread, offset) -> None:
    """Each weight within 2 * range / 15 of its value, the range of a group of 32 taken down to
    0 as Q4_K's min is (seen: 1.3 at most over 2,400 groups)."""
    x = (np.random.default_rng(seed).standard_normal((rows, 512)) * spread + offset * spread).astype(np.float32)
    y = gguf.quants.dequantize(quantize_q4_k(x), gguf.GGMLQuantizationType.Q4_K).reshape(x.shape)
    groups = x.reshape(rows, -1, 32)
    span = groups.max(axis=-1) - np.minimum(groups.min(axis=-1), 0)
    err = np.abs(y - x).reshape(rows, -1, 32).max(axis=-1)
    assert np.all(err <= 2 * span / 15 + 1e-3 * spread)


def test_zeros_stay_zeros() -> None:
    blocks = quantize_q4_k(np.zeros((4, 512), np.float32))
    assert not blocks.any()


def test_rows_that_are_not_super_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="Q4_K needs rows of a multiple of 256"):
        quantize_q4_k(np.ones((2, 288), np.float32))
