"""Linear layers and embeddings whose weights stay in GGUF block form (Q8_0, Q4_0, Q4_1).

The weight is never materialized as floats: each kernel reads the quants and the block
scales and dequantizes in registers, inside the GEMV/GEMM, accumulating in float32
(y = x . dequant(W)^T). The dequantization is exact (GGUF scales are float16, the
quants small integers), so the result differs from a float32 matmul over the
dequantized weights only in summation order.

Kernel shape, for the CPU schedules (vtool.schedules.cpu.quantized), which find these
kernels by their block names:
  vtool_dequant[n, c, j]  weight[n, 16c + j] as float32: a view in chunks of 16, so
                          one Q4 block (16 bytes) is two chunks: low nibbles, high nibbles
  vtool_qmatmul[..., n]   sum over (c, j) of x[..., 16c + j] * vtool_dequant[n, c, j]
  vtool_qtake[i, k]       row ids[i] of the table, dequantized (the embedding)
The schedule inlines vtool_dequant into the GEMV (decode) or dequantizes one tile of
rows into a scratch buffer reused by every row of x (prefill).
"""
from __future__ import annotations

import functools

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from vtool.models.quant_formats import BLOCK, KERNEL_FORMATS, TILE_ROWS, keepable, part_dtype, part_shape, parts

CHUNK = 16  # weights per vtool_dequant chunk: half a block
DEQUANT_BLOCK = "vtool_dequant"
MATMUL_BLOCK = "vtool_qmatmul"
TAKE_BLOCK = "vtool_qtake"


def _weight(fmt: str, w: list[te.Tensor], n, c, j) -> tirx.PrimExpr:
    """weight[n, CHUNK*c + j] as float32, from the tiled parts `w` (qweight, scale[, min])."""
    qweight, scale = w[0], w[1]
    t, r, b = n // TILE_ROWS, n % TILE_ROWS, c // 2
    d = scale[t, b, r].astype("float32")  # float16 in memory, as GGUF stores it
    if fmt == "Q8_0":
        return qweight[t, b, r, (c % 2) * CHUNK + j].astype("float32") * d
    # Q4: chunk c is the low (even c) or high (odd c) nibbles of the block's 16 bytes
    q = tirx.bitwise_and(tirx.shift_right(qweight[t, b, r, j], ((c % 2) * 4).astype("uint8")),
                         tirx.const(15, "uint8"))
    if fmt == "Q4_0":
        return (q.astype("float32") - tirx.const(8.0, "float32")) * d
    return q.astype("float32") * d + w[2][t, b, r].astype("float32")


def matmul_te(fmt: str, x: te.Tensor, *w: te.Tensor) -> te.Tensor:
    """[..., K] x quantized [N, K] -> [..., N] float32."""
    *lead, k = x.shape
    n = w[0].shape[0] * TILE_ROWS  # qweight is [tiles, blocks, TILE_ROWS, bytes]
    dequant = te.compute((n, k // CHUNK, CHUNK), lambda r, c, j: _weight(fmt, list(w), r, c, j),
                         name=DEQUANT_BLOCK)
    c = te.reduce_axis((0, k // CHUNK), name="c")
    j = te.reduce_axis((0, CHUNK), name="j")

    def row(*idx):
        xv = x[(*idx[:-1], c * CHUNK + j)]
        return te.sum(xv.astype("float32") * dequant[idx[-1], c, j], axis=[c, j])

    return te.compute((*lead, n), row, name=MATMUL_BLOCK)


def take_te(fmt: str, dtype: str, ids: te.Tensor, *w: te.Tensor) -> te.Tensor:
    """Rows `ids` of a quantized [V, K] table, dequantized to `dtype`: [n, K]."""
    k = int(w[0].shape[1]) * BLOCK  # qweight is [tiles, blocks, TILE_ROWS, bytes]
    return te.compute(
        (ids.shape[0], k),
        lambda i, col: _weight(fmt, list(w), ids[i], col // CHUNK, col % CHUNK).astype(dtype),
        name=TAKE_BLOCK)


class _QuantizedWeight(nn.Module):
    """The parts of one quantized [rows, cols] weight, as parameters named after them."""

    def __init__(self, fmt: str, rows: int, cols: int):
        if not keepable(fmt, rows, cols):
            raise ValueError(f"a [{rows}, {cols}] weight cannot stay in {fmt} blocks (formats with kernels: "
                             f"{', '.join(KERNEL_FORMATS)}; rows % {TILE_ROWS} == 0, cols % {BLOCK} == 0)")
        self.fmt, self.rows, self.cols = fmt, rows, cols
        for part in parts(fmt):
            setattr(self, part, nn.Parameter(part_shape(fmt, part, rows, cols), part_dtype(fmt, part)))

    def _parts(self) -> list[Tensor]:
        return [getattr(self, part) for part in parts(self.fmt)]

    def _matmul(self, x: Tensor) -> Tensor:
        """x [..., cols] -> [..., rows] float32."""
        return op.tensor_expr_op(functools.partial(matmul_te, self.fmt), f"{self.fmt.lower()}_matmul",
                                 [x, *self._parts()])


class QuantizedLinear(_QuantizedWeight):
    """y = x . dequant(W)^T (+ b): Linear's contract (float32 accumulation, output in the
    compute dtype) with the weight kept in blocks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str, fmt: str):
        super().__init__(fmt, out_features, in_features)
        self.out_features = out_features
        self.bias = nn.Parameter((out_features,), dtype) if bias else None
        self.compute_dtype = dtype

    def forward(self, x: Tensor) -> Tensor:
        y = self._matmul(x)
        if self.compute_dtype != "float32":
            y = y.astype(self.compute_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y


class QuantizedEmbedding(_QuantizedWeight):
    """A token embedding kept in blocks: gather-and-dequantize for the input, and the
    tied lm_head's GEMV over the same table."""

    def __init__(self, num: int, dim: int, dtype: str, fmt: str):
        super().__init__(fmt, num, dim)
        self.dtype = dtype

    def forward(self, ids: Tensor) -> Tensor:
        return op.tensor_expr_op(functools.partial(take_te, self.fmt, self.dtype), f"{self.fmt.lower()}_take",
                                 [ids, *self._parts()])

    def lm_head(self, h: Tensor) -> Tensor:
        """h [..., dim] -> logits [..., num] float32."""
        return self._matmul(h)
