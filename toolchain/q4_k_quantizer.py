"""GGML's Q4_K quantizer (llama.cpp's `quantize_row_q4_K_ref`, no importance matrix) in numpy,
for `--quantization q4_k` of a float checkpoint. gguf-py dequantizes K-quants but cannot
make them, so this ports the reference: the same search, in float32, with the same order
of every float32 sum, so that blocks come out as llama-quantize writes them (checked
against llama.cpp's binary by tests/bench/k_quants_vs_llama_quantize.py; see docs/BUILD.md).

A super-block is 256 weights: 8 sub-blocks of 32, each with a 6-bit scale and a 6-bit min
(of the super-block's float16 d and dmin), and 4-bit quants: w = d*sc*q - dmin*m.
Per sub-block, make_qkx2_quants fits scale and min by weighted least squares (weights
sqrt(mean(x^2)) + |x|) over 21 candidate scales; the 8 scales and mins are then rounded to
6 bits and the quants recomputed with the rounded values.

Every group of the rows given is processed at once, as arrays [32, groups] whose sums run
down the columns (numpy adds a non-contiguous axis row by row, the C loop's order; along a
contiguous one it would sum pairwise): ~7 M weights a second on 2 cores, 16 rows at a time.
"""
from __future__ import annotations

import numpy as np

QK_K = 256
SUB = 32
BLOCK_BYTES = 144  # d, dmin (float16), scales[12], qs[128]
NMAX = 15
RMIN, RDELTA, NSTEP = -1.0, 0.1, 20

F32 = np.float32


def nearest_int(v: np.ndarray) -> np.ndarray:
    """GGML's nearest_int: add 1.5 * 2^23 in float32 and read the low mantissa bits (round
    half to even; |v| < 2^22)."""
    return ((v + F32(12582912.0)).view(np.int32) & 0x007FFFFF) - 0x00400000


def seq_sum(terms: np.ndarray) -> np.ndarray:
    """Sum of [32, n] over its first axis, element 0 first (C's `s += t` loop): numpy reduces a
    non-contiguous axis row by row into the result, where along a contiguous one it would
    sum pairwise and round differently."""
    return terms.sum(axis=0, dtype=F32)


def _quants(iscale: np.ndarray, x: np.ndarray, mn: np.ndarray) -> np.ndarray:
    return np.clip(nearest_int(iscale * (x - mn)), 0, NMAX).astype(F32)


def _make_qkx2_quants(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants(32, 15, x, weights, L, &the_min, Laux, -1, 0.1, 20, false) for every
    column of x [32, n] (float32 throughout, as the C code): (scale [n], the_min [n] (= -min),
    L [32, n] as float32)."""
    mn = np.minimum(x.min(axis=0), F32(0))  # min capped at 0
    mx = x.max(axis=0)
    sum_w = seq_sum(w)
    sum_x = seq_sum(w * x)
    flat = mx == mn  # every value equal: no quants, scale 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(NMAX) / (mx - mn)
        scale = F32(1) / iscale
        L = _quants(iscale, x, mn)
        diff = scale * L + mn - x
        best = seq_sum(w * (diff * diff))
        for step in range(NSTEP + 1):
            # the C loop reads `min` as it goes: a better fit moves it for the later steps
            iscale = (F32(RMIN) + F32(RDELTA) * F32(step) + F32(NMAX)) / (mx - mn)
            laux = _quants(iscale, x, mn)
            wl = w * laux
            sum_l = seq_sum(wl)
            sum_l2 = seq_sum(wl * laux)
            sum_xl = seq_sum(wl * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive, F32(0), this_min)
            d2 = this_scale * laux + this_min - x
            err = seq_sum(w * (d2 * d2))
            better = ~flat & (det > 0) & (err < best)
            L = np.where(better, laux, L)
            best = np.where(better, err, best)
            scale = np.where(better, this_scale, scale)
            mn = np.where(better, this_min, mn)
    return np.where(flat, F32(0), scale), -mn, np.where(flat, F32(0), L)


def super_blocks(data: np.ndarray, fmt: str, group: int) -> tuple[tuple[int, ...], int, np.ndarray]:
    """(leading shape, row length, the rows as float32 [super-blocks, 256 / group, group]) of a
    float [..., K] tensor, K a multiple of 256 (else refused, naming `fmt`)."""
    x = np.ascontiguousarray(data, dtype=F32)
    lead, k = x.shape[:-1], x.shape[-1]
    if k % QK_K:
        raise ValueError(f"{fmt} needs rows of a multiple of {QK_K} values, got {k}")
    return lead, k, x.reshape(-1, QK_K // group, group)


def quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """A float [..., K] tensor (K % 256 == 0) as Q4_K blocks: uint8 [..., K // 256 * 144]."""
    lead, k, blocks = super_blocks(data, "Q4_K", SUB)  # [super-blocks, 8, 32]
    nb = blocks.shape[0]
    subs = np.ascontiguousarray(blocks.reshape(-1, SUB).T)  # [32, groups]: sums run down the columns
    av_x = np.sqrt(seq_sum(subs * subs) / F32(SUB))
    weights = av_x + np.abs(subs)
    scales, mins, first = _make_qkx2_quants(subs, weights)
    first = first.T.reshape(nb, 8, SUB)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    # the C loop's running maxima start at 0 and take strictly larger values
    max_scale = np.maximum(scales.max(axis=1), F32(0)).astype(F32)
    max_min = np.maximum(mins.max(axis=1), F32(0)).astype(F32)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, (F32(63) / max_scale).astype(F32), F32(0)).astype(F32)
        inv_min = np.where(max_min > 0, (F32(63) / max_min).astype(F32), F32(0)).astype(F32)
    # uint8_t ls = nearest_int(...): the int is truncated to 8 bits, then capped at 63
    ls = np.minimum(nearest_int((inv_scale[:, None] * scales).astype(F32)) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(nearest_int((inv_min[:, None] * mins).astype(F32)) & 0xFF, 63).astype(np.uint8)
    packed = np.zeros((nb, 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    d16 = (max_scale / F32(63)).astype(F32).astype(np.float16)
    dmin16 = (max_min / F32(63)).astype(F32).astype(np.float16)
    # the quants again, from the rounded (6-bit, float16) scales and mins
    d = (d16.astype(F32)[:, None] * ls.astype(F32)).astype(F32)
    dm = (dmin16.astype(F32)[:, None] * lm.astype(F32)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = nearest_int(((blocks + dm[:, :, None]).astype(F32) / d[:, :, None]).astype(F32))
    q = np.clip(q, 0, NMAX)
    # a sub-block whose d is 0 keeps the search's quants (the C code skips it)
    q = np.where((d == 0)[:, :, None], first, q).astype(np.uint8)
    qs = q.reshape(nb, 4, 2, SUB)  # 64-weight groups: low nibbles the first 32, high the next
    nibbles = (qs[:, :, 0, :] | (qs[:, :, 1, :] << 4)).reshape(nb, 128)
    out = np.empty((nb, BLOCK_BYTES), dtype=np.uint8)
    out[:, 0:2] = d16.reshape(nb, 1).view(np.uint8)
    out[:, 2:4] = dmin16.reshape(nb, 1).view(np.uint8)
    out[:, 4:16] = packed
    out[:, 16:] = nibbles
    return out.reshape(*lead, (k // QK_K) * BLOCK_BYTES)
