"""Encoder attention as one kernel call, where the toolchain hands one in.

An encoder (models/bert.py, models/gemma_encoder.py) attends every query of a right-padded
batch to the token keys of its row. Written as Relax ops (q.k^T, a mask bias, softmax, p.v) it
runs anywhere, and on CUDA DLight schedules it; on the CPU no rule schedules those batched
matmuls, so CPU float32 builds get a kernel of their own instead
(schedules/cpu/encoder_attention.py, handed in by toolchain/build.py: models/ never imports
schedules/). `attend` returns None where there is none, and the caller keeps its ops.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol


class DenseAttentionKernels(Protocol):
    def takes(self, q_heads: int, kv_heads: int, head_dim: int) -> bool:
        """Whether `func` gives a kernel for these heads (the window does not matter)."""

    def func(self, q_heads: int, kv_heads: int, head_dim: int, sm_scale: float, window: int) -> Any:
        """A PrimFunc (qkv [b, n, q_heads + 2 kv_heads, d] float32, mask [b, n] int32) ->
        [b, n, q_heads, d] float32; `window` 0: none, else keys with |i - j| < window. None
        where it does not apply."""


class UsesDenseAttention:
    """Mixed into the encoder modules that attend: the kernels, None until a build sets them."""

    dense_attention_kernels: DenseAttentionKernels | None = None


def use_dense_attention(model: Any, kernels: DenseAttentionKernels) -> int:
    """Give every attending module of `model` the kernels; returns how many modules."""
    from vtool.models.quantized_linear import walk_modules  # imports TVM: only when a build asks

    count = 0
    for module in walk_modules(model):
        if isinstance(module, UsesDenseAttention):
            module.dense_attention_kernels = kernels
            count += 1
    return count


def takes(kernels: DenseAttentionKernels | None, dtype: str, q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `attend` will use the kernel for these heads (the window does not matter)."""
    return kernels is not None and dtype == "float32" and kernels.takes(q_heads, kv_heads, head_dim)


def flatten_rows(kernels: DenseAttentionKernels | None, h: Any, q_heads: int, kv_heads: int,
                 head_dim: int) -> tuple[Any, Callable[[Any], Any]]:
    """h [b, n, H] -> ([1, b * n, H], the inverse) where the kernel takes every layer (the
    projections then see one symbolic row count), else (h, identity)."""
    from tvm.relax.frontend.nn import op

    if not takes(kernels, h.dtype, q_heads, kv_heads, head_dim):
        return h, lambda x: x
    b, n, hidden = h.shape
    return op.reshape(h, (1, b * n, hidden)), lambda x: op.reshape(x, (b, n, x.shape[-1]))


def attend(kernels: DenseAttentionKernels | None, qkv: Any, mask: Any, q_heads: int, kv_heads: int, sm_scale: float,
           window: int = 0) -> Any:
    """qkv [..., heads, d] (q heads, k heads, v heads) over the rows of mask [b, n], either as
    [b, n, ...] or flattened [1, b * n, ...] -> [..., q_heads, d] through the kernel, or None
    (no kernel for this build or shape)."""
    from tvm.relax.frontend.nn import Tensor, op

    *lead, heads, d = qkv.shape
    if not takes(kernels, qkv.dtype, q_heads, kv_heads, int(d)):
        return None
    if heads != q_heads + 2 * kv_heads:
        raise ValueError(f"fused qkv has {heads} heads, expected {q_heads} + 2 x {kv_heads}")
    b, n = mask.shape
    func = kernels.func(q_heads, kv_heads, int(d), sm_scale, window)
    name = "dense_attention" + (f"_window{window}" if window else "")
    out = op.tensor_ir_op(func, name, [op.reshape(qkv, (b, n, heads, d)), mask],
                          Tensor.placeholder([b, n, q_heads, d], "float32"))
    return op.reshape(out, (*lead, q_heads, d))
