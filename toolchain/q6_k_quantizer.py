"""GGML's Q6_K quantizer (llama.cpp's `quantize_row_q6_K_ref`, no importance matrix) in numpy,
for `--quantization q6_k`: like toolchain/q4_k_quantizer.py, a port that keeps the C code's
float32 order of operations and sums, so its blocks equal llama-quantize's
(tests/bench/k_quants_vs_llama_quantize.py --type Q6_K).

A super-block is 256 weights: 16 groups of 16, each an int8 scale of the super-block's
float16 d, and 6-bit quants (4 low bits in ql, 2 high bits in qh): w = d*sc*(q - 32). Per
group make_qx_quants(16, 32, x, L, rmse_type 1) picks the scale among 19 candidates that
maximizes (sum w*x*l)^2 / sum w*l^2 with weights x^2; the 16 scales are then rounded to int8
(the largest in magnitude to -128) and the quants recomputed with the rounded values.
"""
from __future__ import annotations

import numpy as np

from vtool.toolchain.q4_k_quantizer import F32, QK_K, nearest_int, seq_sum, super_blocks

GROUP = 16
NMAX = 32
BLOCK_BYTES = 210  # ql[128], qh[64], scales[16] (int8), d (float16)
GROUP_MAX_EPS = F32(1e-15)


def _levels(iscale: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.clip(nearest_int(iscale * x), -NMAX, NMAX - 1).astype(F32)


def _make_qx_quants(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(16, 32, x, L, 1, NULL) for every column of x [16, n]: (scale [n],
    L [16, n] as float32 in -32..31, the C code's L minus nmax)."""
    first = np.abs(x).argmax(axis=0)  # the first value of the largest magnitude
    mx = x[first, np.arange(x.shape[1])]
    zero = np.abs(mx) < GROUP_MAX_EPS
    w = x * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(-NMAX) / mx
        L = _levels(iscale, x)
        sumlx = seq_sum(w * x * L)
        suml2 = seq_sum(w * L * L)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            iscale = -(F32(NMAX) + F32(0.1) * F32(step)) / mx
            laux = _levels(iscale, x)
            sumlx = seq_sum(w * x * laux)
            suml2 = seq_sum(w * laux * laux)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            L = np.where(better, laux, L)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    # an all-zero group: L stored as 0, i.e. level -32 (what a zero d keeps, below)
    return np.where(zero, F32(0), scale), np.where(zero, F32(-NMAX), L)


def quantize_q6_k(data: np.ndarray) -> np.ndarray:
    """A float [..., K] tensor (K % 256 == 0) as Q6_K blocks: uint8 [..., K // 256 * 210]."""
    lead, k, blocks = super_blocks(data, "Q6_K", GROUP)  # [super-blocks, 16, 16]
    nb = blocks.shape[0]
    scales, first = _make_qx_quants(np.ascontiguousarray(blocks.reshape(-1, GROUP).T))
    scales = scales.reshape(nb, 16)
    first = first.T.reshape(nb, 16, GROUP)
    # the scale of the largest magnitude, the first one where several tie
    pick = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(nb), pick]
    empty = np.abs(max_scale) < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = np.where(empty, F32(0), F32(-128.0) / max_scale)
        d16 = np.where(empty, F32(0), F32(1) / iscale).astype(np.float16)
        sc = np.minimum(nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
        d = d16.astype(F32)[:, None] * sc.astype(F32)  # [nb, 16]
        q = np.clip(nearest_int(blocks / d[:, :, None]), -NMAX, NMAX - 1)
    q = np.where((d == 0)[:, :, None], first.astype(np.int32), q)
    L = (q + NMAX).astype(np.uint8).reshape(nb, 2, 4, 32)  # two halves of 128: four runs of 32
    ql = np.concatenate([L[:, :, 0] & 0xF | (L[:, :, 2] & 0xF) << 4, L[:, :, 1] & 0xF | (L[:, :, 3] & 0xF) << 4],
                        axis=2).reshape(nb, 128)
    qh = (L[:, :, 0] >> 4 | (L[:, :, 1] >> 4) << 2 | (L[:, :, 2] >> 4) << 4 | (L[:, :, 3] >> 4) << 6).reshape(nb, 64)
    out = np.zeros((nb, BLOCK_BYTES), dtype=np.uint8)
    live = ~empty
    out[live, 0:128] = ql[live]
    out[live, 128:192] = qh[live]
    out[live, 192:208] = sc[live].view(np.uint8)
    out[:, 208:210] = d16.reshape(nb, 1).view(np.uint8)
    return out.reshape(*lead, (k // QK_K) * BLOCK_BYTES)
