"""FP8 weights made at load: e4m3 values with one float32 scale per output row (`--quantization fp8`).

The layout is runtime/weights/fp8_layout.py's (weight = RNE(W / s), s = max|W[row]| / 448); the
binder (runtime/artifact/library.py) calls load_fp8 for each FP8 parameter: an FP8 checkpoint's
own e4m3 weights and scales (compressed-tensors, ModelOpt, vLLM's fp8: per tensor or per row) are
taken as they are, a float checkpoint's are quantized by quantize_rows. As vLLM's
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
from typing import Callable, Sequence

import numpy as np

from vtool import VtoolError
from vtool.runtime.weights.checkpoint import Checkpoint
from vtool.runtime.weights.fp8_layout import E4M3_MAX, FP8_DTYPE, PARTS
from vtool.runtime.weights.transforms import apply_transform
from vtool.runtime.weights.weights_file import STORED_DTYPES  # float dtype -> the load() that keeps its bytes

STORED_FP8 = "F8_E4M3"  # an FP8 checkpoint's weights, in safetensors' name

# Weights are widened to float32 this many rows at a time: an 8B model's gate|up (28672 rows)
# would otherwise need a 470 MB float32 copy beside it.
ROWS_PER_CHUNK = 1024
MAX_THREADS = 16  # chunks quantized at once (the cast releases the GIL)


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
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


def dequantize_rows(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """q * s[:, None] in float32: the weight the compiled matmuls multiply by."""
    return q.astype(np.float32) * s.astype(np.float32)[:, None]


def scale_tensor(weight_name: str) -> str:
    """Where an FP8 checkpoint keeps a weight's scale: `<proj>.weight` -> `<proj>.weight_scale`
    (compressed-tensors, ModelOpt and vLLM's own fp8 checkpoints all name it so)."""
    return weight_name + "_scale"


def check_stored_scale(checkpoint: Checkpoint, name: str) -> None:
    """Refuse, by name, an FP8 weight whose scale tensor is missing or not per tensor ([] or [1])
    or per row ([rows] or [rows, 1]): reads the header only (the build calls it)."""
    infos = checkpoint.tensors()
    rows = infos[name].shape[0]
    holder = scale_tensor(name)
    if holder not in infos:
        raise Fp8Error(f"{checkpoint.path}: FP8 weight {name!r} has no scale tensor {holder!r}")
    shape = tuple(infos[holder].shape)
    if shape not in ((), (1,), (rows,), (rows, 1)):
        raise Fp8Error(f"{checkpoint.path}: {holder!r} has shape {list(shape)}: per-tensor ([] or [1]) and per-row "
                       f"([{rows}] or [{rows}, 1]) FP8 scales are read, block-wise ones (weight_block_size) are not")


def stored_scales(checkpoint: Checkpoint, name: str) -> np.ndarray:
    """The float32 scale of each row of the FP8 weight `name` as an FP8 checkpoint stores it:
    one for the tensor ([] or [1]), or one per row ([rows] or [rows, 1]); W = q * scale."""
    check_stored_scale(checkpoint, name)
    rows = checkpoint.tensors()[name].shape[0]
    holder = scale_tensor(name)
    scale = np.asarray(checkpoint.load(holder, "float32"), np.float32).reshape(-1)
    if not np.all(np.isfinite(scale)) or not np.all(scale > 0):
        raise Fp8Error(f"{checkpoint.path}: {holder!r} holds a scale that is not a positive finite number")
    return np.broadcast_to(scale, (rows,)).astype(np.float32)


def load_fp8(checkpoint: Checkpoint, sources: Sequence[str], transform: str) -> tuple[np.ndarray, np.ndarray]:
    """(q, s) of the FP8 parameter made from `sources` (rows stacked by `transform`): an FP8
    checkpoint's e4m3 rows and their stored scales as they are, or a float checkpoint's rows
    quantized here (quantize_rows). Float sources are read in their stored dtype, views of the
    mapped file; quantize_rows widens a chunk of rows at a time."""
    infos = checkpoint.tensors()
    stored = {infos[src].dtype for src in sources}
    if stored == {STORED_FP8}:
        q = apply_transform(transform, [checkpoint.load(src, FP8_DTYPE) for src in sources])
        return np.ascontiguousarray(q), np.concatenate([stored_scales(checkpoint, src) for src in sources])
    if STORED_FP8 in stored or not stored <= set(STORED_DTYPES):
        raise Fp8Error(f"{checkpoint.path}: {list(sources)} are stored as {sorted(stored)}; an FP8 parameter is made "
                       f"from e4m3 weights (an FP8 checkpoint) or float ones ({', '.join(STORED_DTYPES)}), not a mix")
    arrays = [checkpoint.load(src, STORED_DTYPES[infos[src].dtype]) for src in sources]
    return quantize_rows(apply_transform(transform, arrays), "+".join(sources))


class Fp8Rows:
    """The FP8 parts of the weights being bound. A weight's two parts are consecutive
    parameters made from the same sources, so each is made once and handed out twice."""

    def __init__(self) -> None:
        self._key: tuple[str, ...] | None = None
        self._parts: dict[str, np.ndarray] = {}

    def part(self, sources: Sequence[str], part: str,
             load: Callable[[], tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """Part `part` of the weight made from `sources`; load() gives (q, s) (load_fp8) when
        they are not already held."""
        if part not in PARTS:
            raise Fp8Error(f"unknown FP8 part {part!r}; the parts are {', '.join(PARTS)}")
        key = tuple(sources)
        if key != self._key:
            self._parts.clear()
            q, s = load()
            self._key, self._parts = key, {"weight": q, "weight_scale": s}
        return self._parts[part]
