"""Rotary position embeddings applied by the model (ModelConfig.model_rope), not by the KV cache.

TVM's paged KV cache rotates q and k with one theta for every layer. Gemma-3 rotates its
sliding-window layers with another base (rope_local_base_freq) than its global layers, and
its global layers may use linear scaling, so those models build the cache with RopeMode.NONE
and rotate here, at the positions the cache reports for this step's query tokens
(PagedKVCache.get_query_positions): the same positions the cache's own rotation would use.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend.nn import Tensor, op


def inverse_frequencies(head_dim: int, theta: float, linear_factor: float = 1.0) -> np.ndarray:
    """transformers' inv_freq: 1 / theta^(2i/d) in float32, divided by a linear scaling factor."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = np.float32(1.0) / (np.float32(theta) ** exponent)
    return (inv / np.float32(linear_factor)).astype(np.float32)


def longrope_inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> tuple[np.ndarray, float]:
    """Phi-3's longrope (transformers' _compute_longrope_parameters): inv_freq = 1 / (ext *
    theta^(2i/d)) in float32, ext the long factors when scaling["long"] (models/phi3.py decides
    which set, once per build), the short ones otherwise; and the attention factor that scales
    cos and sin (sqrt(1 + ln(factor) / ln(original_max_position_embeddings)), or the config's)."""
    ext = np.asarray(scaling["long_factor" if scaling["long"] else "short_factor"], dtype=np.float32)
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    # theta ** exponent rounded from float64: torch's float32 pow agrees with that on all but a
    # few head dims' single values (numpy's float32 pow is off by an ulp on a third of them)
    power = (np.float64(theta) ** exponent.astype(np.float64)).astype(np.float32)
    inv = np.float32(1.0) / (ext * power)
    return inv.astype(np.float32), float(scaling["attention_factor"])


def apply_rope(x: Tensor, positions: Tensor, inv_freq: np.ndarray, scale: float = 1.0) -> Tensor:
    """x [n, heads, d] rotated as transformers' rotate_half pairs (i, i + d/2), in float32; cos
    and sin times `scale` (longrope's attention factor; 1: none)."""
    inv = Tensor.from_const(inv_freq)

    def rotate(xt: te.Tensor, pos: te.Tensor, freq: te.Tensor) -> te.Tensor:
        n, heads, d = xt.shape
        half = d // 2

        def at(i, h, k):
            j = tirx.if_then_else(k < half, k, k - half)
            angle = pos[i].astype("float32") * freq[j]
            other = tirx.if_then_else(k < half, -xt[i, h, k + half], xt[i, h, k - half]).astype("float32")
            if scale == 1.0:
                return (xt[i, h, k].astype("float32") * tirx.cos(angle) + other * tirx.sin(angle)).astype(xt.dtype)
            factor = tirx.const(scale, "float32")
            return (xt[i, h, k].astype("float32") * (tirx.cos(angle) * factor)
                    + other * (tirx.sin(angle) * factor)).astype(xt.dtype)

        return te.compute((n, heads, d), at, name="model_rope")

    return op.tensor_expr_op(rotate, name_hint="model_rope", args=[x, positions, inv])
