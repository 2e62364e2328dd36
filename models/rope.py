"""Rotary position embeddings applied by the model (ModelConfig.model_rope), not by the KV cache.

TVM's paged KV cache rotates q and k with one theta for every layer. Gemma-3 rotates its
sliding-window layers with another base (rope_local_base_freq) than its global layers, and
its global layers may use linear scaling, so those models build the cache with RopeMode.NONE
and rotate here, at the positions the cache reports for this step's query tokens
(PagedKVCache.get_query_positions): the same positions the cache's own rotation would use.
Linear and YaRN scaling are applied here too, for any decoder (models/config.py sets model_rope):
TVM's cache has a yarn of its own that neither rounds the correction range nor scales cos and
sin, so it is not transformers' (or llama.cpp's) YaRN.
"""
from __future__ import annotations

import math

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend.nn import Tensor, op


def inverse_frequencies(head_dim: int, theta: float, linear_factor: float = 1.0) -> np.ndarray:
    """transformers' inv_freq: 1 / theta^(2i/d) in float32, divided by a linear scaling factor."""
    inv = np.float32(1.0) / _theta_powers(head_dim, theta)
    return (inv / np.float32(linear_factor)).astype(np.float32)


def _theta_powers(head_dim: int, theta: float) -> np.ndarray:
    """theta^(2i/d) in float32, rounded from float64: torch's float32 pow agrees with that on
    all but a few head dims' single values (numpy's float32 pow is off by an ulp on a third of them)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (np.float64(theta) ** exponent.astype(np.float64)).astype(np.float32)


def longrope_inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> tuple[np.ndarray, float]:
    """Phi-3's longrope (transformers' _compute_longrope_parameters): inv_freq = 1 / (ext *
    theta^(2i/d)) in float32, ext the long factors when scaling["long"] (models/phi3.py decides
    which set, once per build), the short ones otherwise; and the attention factor that scales
    cos and sin (sqrt(1 + ln(factor) / ln(original_max_position_embeddings)), or the config's)."""
    ext = np.asarray(scaling["long_factor" if scaling["long"] else "short_factor"], dtype=np.float32)
    inv = np.float32(1.0) / (ext * _theta_powers(head_dim, theta))
    return inv.astype(np.float32), float(scaling["attention_factor"])


def yarn_inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> tuple[np.ndarray, float]:
    """YaRN (transformers' _compute_yarn_parameters, float32 as it computes them): each frequency
    mixes the original (extrapolated) and the factor-divided (interpolated) one by a linear ramp
    over the dimensions between the correction range of beta_fast and beta_slow rotations within
    the original context; and the attention factor on cos and sin (models/config.py resolved it)."""
    dim = head_dim  # transformers' name: the rotated dims
    factor = float(scaling["factor"])
    base, original = float(theta), float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(float(scaling["beta_fast"])), correction_dim(float(scaling["beta_slow"]))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    power = _theta_powers(dim, base)
    extrapolated = np.float32(1.0) / power
    interpolated = np.float32(1.0) / (np.float32(factor) * power)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = np.float32(1.0) - ramp  # the extrapolated frequency's share (1 - (1 - ramp) rounds as transformers')
    inv = interpolated * (np.float32(1.0) - keep) + extrapolated * keep
    return inv.astype(np.float32), float(scaling["attention_factor"])


class _HeadView:
    """x[i, first + h, k] as x[i, h, k]."""

    def __init__(self, x: te.Tensor, first: int):
        self.x, self.first, self.dtype = x, first, x.dtype

    def __getitem__(self, index):  # noqa: ANN001, ANN204 - te index tuples
        i, h, k = index
        return self.x[i, h + self.first, k] if self.first else self.x[i, h, k]


def apply_rope(x: Tensor, positions: Tensor, inv_freq: np.ndarray, scale: float = 1.0,
               heads: tuple[int, int] | None = None) -> Tensor:
    """x [n, heads, d] rotated as transformers' rotate_half pairs (i, i + r/2) over its first
    r = 2 * len(inv_freq) dims (all d of them unless partial_rotary_factor), in float32; cos
    and sin times `scale` (longrope's and yarn's attention factor; 1: none). `heads` (first,
    count): rotate only those heads of x (the query heads of a fused q|k|v, read in place)."""
    inv = Tensor.from_const(inv_freq)

    def rotate(whole: te.Tensor, pos: te.Tensor, freq: te.Tensor) -> te.Tensor:
        first, count = heads if heads is not None else (0, int(whole.shape[1]))
        xt = _HeadView(whole, first)
        n, d = whole.shape[0], whole.shape[2]
        rotary = 2 * int(inv_freq.shape[0])  # partial_rotary_factor: dims past it pass unrotated
        half = rotary // 2

        def rotated(i, h, k):
            j = tirx.if_then_else(k < half, k, k - half)
            angle = pos[i].astype("float32") * freq[j]
            other = tirx.if_then_else(k < half, -xt[i, h, k + half], xt[i, h, k - half]).astype("float32")
            if scale == 1.0:
                return (xt[i, h, k].astype("float32") * tirx.cos(angle) + other * tirx.sin(angle)).astype(xt.dtype)
            factor = tirx.const(scale, "float32")
            return (xt[i, h, k].astype("float32") * (tirx.cos(angle) * factor)
                    + other * (tirx.sin(angle) * factor)).astype(xt.dtype)

        def at(i, h, k):
            if rotary == int(d):
                return rotated(i, h, k)
            return tirx.if_then_else(k < rotary, rotated(i, h, tirx.min(k, rotary - 1)), xt[i, h, k])

        return te.compute((n, count, d), at, name="model_rope")

    return op.tensor_expr_op(rotate, name_hint="model_rope", args=[x, positions, inv])
