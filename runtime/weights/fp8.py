"""FP8 weights made at load: e4m3 values with one float32 scale per output row (`--quantization fp8`).

The layout is runtime/weights/fp8_layout.py's (weight = RNE(W / s), s = max|W[row]| / 448); the
binder (runtime/artifact/library.py) calls quantize_rows for each FP8 parameter. As vLLM's
`--quantization fp8` on a bf16/f16 checkpoint, the weights are quantized when they are loaded,
from the float checkpoint the artifact is run with: the artifact holds no second copy of them,
and the rounding is ml_dtypes' float32 -> e4m3 cast (round to nearest even, the cast torch and
CUDA's __nv_fp8_e4m3 do), deterministic.
e4m3 keeps 3 mantissa bits: a weight's relative error is at most 2^-4 (half a step), and a
row's largest weights are represented to within 1/16 of themselves.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from vtool import VtoolError
from vtool.runtime.weights.fp8_layout import E4M3_MAX, PARTS

# Weights are widened to float32 this many rows at a time: an 8B model's gate|up (28672 rows)
# would otherwise need a 470 MB float32 copy beside it.
ROWS_PER_CHUNK = 1024


class Fp8Error(VtoolError):
    """A weight that cannot be made FP8: non-finite values, a shape the kernels cannot take."""


def e4m3() -> np.dtype:
    import ml_dtypes  # imported when FP8 is used: its import costs resident memory (checkpoint.numpy_dtype)

    return np.dtype(ml_dtypes.float8_e4m3fn)


def quantize_rows(w: np.ndarray, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """A float [rows, cols] weight -> (q float8_e4m3fn [rows, cols], s float32 [rows]), as the
    module docstring defines them. `name` is for the error a non-finite value gets."""
    if w.ndim != 2:
        raise Fp8Error(f"{name}: FP8 weights are 2-D [rows, cols]; got shape {list(w.shape)}")
    rows, cols = w.shape
    q = np.empty((rows, cols), dtype=e4m3())
    s = np.empty(rows, dtype=np.float32)

    def chunk_rows(start: int) -> None:
        chunk = np.asarray(w[start:start + ROWS_PER_CHUNK], dtype=np.float32)
        amax = np.max(np.abs(chunk), axis=1) if cols else np.zeros(len(chunk), np.float32)
        if not np.all(np.isfinite(amax)):
            bad = start + int(np.flatnonzero(~np.isfinite(amax))[0])
            raise Fp8Error(f"{name}: row {bad} holds a non-finite value (inf or nan); it has no FP8 scale")
        scale = amax / np.float32(E4M3_MAX)
        scale[scale == 0] = 1.0  # a zero row (or one so small its scale underflows): q = 0 either way
        s[start:start + len(chunk)] = scale
        # |chunk / scale| <= 448 up to float32 rounding, which the clip takes back inside the
        # finite range: ml_dtypes maps a value past 448 + half a step to nan, as e4m3fn has no inf.
        owned = w.dtype != np.float32  # the chunk is a widened copy, not a view of the caller's weight
        ratio = np.divide(chunk, scale[:, None], out=chunk if owned else None)
        np.clip(ratio, -E4M3_MAX, E4M3_MAX, out=ratio)
        q[start:start + len(chunk)] = ratio.astype(q.dtype)

    starts = range(0, rows, ROWS_PER_CHUNK)
    if len(starts) == 1:
        chunk_rows(0)
    else:  # the cast to e4m3 is most of the time and numpy releases the GIL for it: chunks in threads
        with ThreadPoolExecutor(min(len(starts), _threads())) as pool:
            for done in [pool.submit(chunk_rows, start) for start in starts]:
                done.result()  # in row order, so a non-finite value names its first row
    return q, s


def _threads() -> int:
    return max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def dequantize_rows(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """q * s[:, None] in float32: the weight the compiled matmuls multiply by."""
    return q.astype(np.float32) * s.astype(np.float32)[:, None]


class Fp8Rows:
    """The FP8 parts of the weights being bound. A weight's two parts are consecutive
    parameters made from the same sources, so each is quantized once and handed out twice."""

    def __init__(self) -> None:
        self._key: tuple[str, ...] | None = None
        self._parts: dict[str, np.ndarray] = {}

    def part(self, sources: Sequence[str], part: str, load_rows) -> np.ndarray:  # noqa: ANN001 - a callable
        """Part `part` of the weight made from `sources`; load_rows() gives that weight as one
        float [rows, cols] array (the sources' rows stacked) when it is not already held."""
        if part not in PARTS:
            raise Fp8Error(f"unknown FP8 part {part!r}; the parts are {', '.join(PARTS)}")
        key = tuple(sources)
        if key != self._key:
            self._parts.clear()
            q, s = quantize_rows(load_rows(), "+".join(sources))
            self._key, self._parts = key, {"weight": q, "weight_scale": s}
        return self._parts[part]
