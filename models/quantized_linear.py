"""Linear layers and embeddings whose weights stay in GGUF block form (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS).

The weight is never materialized as floats: each kernel reads the quants and the block
scales and dequantizes in registers, inside the GEMV/GEMM, accumulating in float32
(y = x . dequant(W)^T). The dequantization is exact (GGUF scales are float16, the
quants small integers), so the result differs from a float32 matmul over the
dequantized weights only in summation order.

Kernel shape, for the CPU schedules (vtool.schedules.cpu.quantized), which find these
kernels by their block names:
  vtool_dequant[n, c, j]  weight[n, 16c + j] as float32: a view in chunks of 16, so
                          one Q4 block (16 bytes) is two chunks: low nibbles, high nibbles;
                          the K-quants' scales are constant over a chunk (Q6_K's is per chunk)
  vtool_qmatmul[..., n]   sum over (c, j) of x[..., 16c + j] * vtool_dequant[n, c, j]
  vtool_qtake[i, k]       row ids[i] of the table, dequantized (the embedding)
The schedule inlines vtool_dequant into the GEMV (decode) or dequantizes one tile of
rows into a scratch buffer reused by every row of x (prefill).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Protocol

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from vtool.models.weights import format_runs
from vtool.runtime.weights.ggml_blocks import (FORMATS, IQ4_VALUES, SUPER_BLOCK, TILE_ROWS, block_cols, keepable,
                                              part_dtype, part_shape, parts)

CHUNK = 16  # weights per vtool_dequant chunk: half a block
DEQUANT_BLOCK = "vtool_dequant"
MATMUL_BLOCK = "vtool_qmatmul"
TAKE_BLOCK = "vtool_qtake"
DEQUANT_WHOLE_BLOCK = "vtool_dequantize"


BLOCK_MMA_ROWS = 128  # weight rows of one thread block of the tensor-core kernel
BLOCK_MMA_MIN_BLOCKS = 528  # thread blocks a matmul wants (four per SM of an H100/H200) before splitting k


def block_mma_symbol(fmt: str) -> str:
    """The FFI function of the tensor-core matmul over `fmt` blocks that a CUDA library exports
    (toolchain/native/block_mma.cu): x[..., k] (bf16/f16), the weight's parts, then two float32
    outputs: partial[splits, ..., n] (the sum over k in `splits` parts, a scratch) and out[..., n]
    (their sum, in split order)."""
    return f"vtool_block_mma_{fmt.lower()}"


def block_mma_splits(rows: int, cols: int) -> int:
    """Parts the kernel splits the sum over k of a [rows, cols] weight into: a matrix of few
    rows (o, down) fills the GPU's SMs only with several thread blocks along k, each writing its
    own partial [m, rows], which the kernel's second launch adds in order (deterministic, no
    atomics)."""
    row_blocks = -(-rows // BLOCK_MMA_ROWS)
    steps = -(-cols // 128)  # 4 blocks of 32 weights a step
    return max(1, min(steps, -(-BLOCK_MMA_MIN_BLOCKS // row_blocks)))


def _nibble(qweight: te.Tensor, t, b, r, c, j) -> tirx.PrimExpr:
    """Chunk c's 4-bit quant j: the low (even c) or high (odd c) nibbles of block b's 16 bytes."""
    return tirx.bitwise_and(tirx.shift_right(qweight[t, b, r, j], ((c % 2) * 4).astype("uint8")),
                            tirx.const(15, "uint8"))


def _iq4_level(q: tirx.PrimExpr) -> tirx.PrimExpr:
    """IQ4_NL's / IQ4_XS's level of a 4-bit code, as float32: a tree of selects on its bits."""
    levels = [tirx.const(float(v), "float32") for v in IQ4_VALUES]
    for bit in range(4):
        set_ = tirx.bitwise_and(tirx.shift_right(q, tirx.const(bit, "uint8")), tirx.const(1, "uint8")) != \
            tirx.const(0, "uint8")
        levels = [tirx.Select(set_, levels[2 * i + 1], levels[2 * i]) for i in range(len(levels) // 2)]
    return levels[0]


def _f32(v: tirx.PrimExpr) -> tirx.PrimExpr:
    return v.astype("float32")  # float16 scales, small integers: widened exactly


def _weight(fmt: str, w: list[te.Tensor], n, c, j) -> tirx.PrimExpr:
    """weight[n, CHUNK*c + j] as float32, from the tiled parts `w` (in ggml_blocks.parts order).
    Every product below is exact in float32 (at most 24 significant bits), so the one rounding
    is Q4_1's and Q4_K's add, as in gguf-py: the result is gguf.quants.dequantize's, bit for bit."""
    qweight = w[0]
    t, r, b = n // TILE_ROWS, n % TILE_ROWS, c // 2
    if fmt == "Q8_0":
        return _f32(qweight[t, b, r, (c % 2) * CHUNK + j]) * _f32(w[1][t, b, r])
    if fmt in ("Q2_K", "Q3_K"):  # 2-bit quants: chunk c at bits 2(c % 4) of 64-weight group c // 4
        s = c // (SUPER_BLOCK // CHUNK)
        q2 = tirx.bitwise_and(tirx.shift_right(qweight[t, c // 4, r, j], ((c % 4) * 2).astype("uint8")),
                              tirx.const(3, "uint8"))
        if fmt == "Q2_K":  # parts: qweight, scale (d), min (dmin), sub_scale (sc | m << 4 per 16)
            sm = w[3][t, c, r]
            d = _f32(w[1][t, s, r]) * _f32(tirx.bitwise_and(sm, tirx.const(15, "uint8")))
            m = _f32(w[2][t, s, r]) * _f32(tirx.shift_right(sm, tirx.const(4, "uint8")))
            return d * _f32(q2) - m
        # Q3_K, parts: qweight, qhigh (the third bits, as Q5_0's), scale, sub_scale (signed, per 16)
        e = (c % 2) * CHUNK + j
        high = tirx.bitwise_and(tirx.shift_right(w[1][t, b, r, e // 8], (e % 8).astype("uint8")),
                                tirx.const(1, "uint8"))
        q3 = tirx.bitwise_or(q2, tirx.shift_left(high, tirx.const(2, "uint8")))
        return (_f32(w[2][t, s, r]) * _f32(w[3][t, c, r])) * (_f32(q3) - tirx.const(4.0, "float32"))
    q = _nibble(qweight, t, b, r, c, j)
    if fmt == "IQ4_NL":  # parts: qweight, scale
        return _iq4_level(q) * _f32(w[1][t, b, r])
    if fmt == "IQ4_XS":  # parts: qweight, scale (d per 256), sub_scale (ls - 32 per 32)
        return (_f32(w[1][t, c // (SUPER_BLOCK // CHUNK), r]) * _f32(w[2][t, b, r])) * _iq4_level(q)
    if fmt == "Q4_0":
        return (_f32(q) - tirx.const(8.0, "float32")) * _f32(w[1][t, b, r])
    if fmt == "Q4_1":
        return _f32(q) * _f32(w[1][t, b, r]) + _f32(w[2][t, b, r])
    if fmt in ("Q5_0", "Q5_1", "Q5_K"):  # qhigh (w[1]): element e's 5th bit at bit e % 8 of byte e // 8
        e = (c % 2) * CHUNK + j
        high = tirx.bitwise_and(tirx.shift_right(w[1][t, b, r, e // 8], (e % 8).astype("uint8")),
                                tirx.const(1, "uint8"))
        q = tirx.bitwise_or(q, tirx.shift_left(high, tirx.const(4, "uint8")))
        if fmt == "Q5_0":  # parts: qweight, qhigh, scale
            return (_f32(q) - tirx.const(16.0, "float32")) * _f32(w[2][t, b, r])
        if fmt == "Q5_1":  # parts: qweight, qhigh, scale, min
            return _f32(q) * _f32(w[2][t, b, r]) + _f32(w[3][t, b, r])
        w = [w[0], *w[2:]]  # Q5_K: then as Q4_K's parts
    s = c // (SUPER_BLOCK // CHUNK)  # the 256-weight super-block
    if fmt in ("Q4_K", "Q5_K"):  # parts: qweight, scale (d), min (dmin), sub_scale, sub_min
        d = _f32(w[1][t, s, r]) * _f32(w[3][t, b, r])
        m = _f32(w[2][t, s, r]) * _f32(w[4][t, b, r])
        return d * _f32(q) - m
    # Q6_K, parts: qweight (low 4 bits), qhigh (2 bits at 2(c % 4) of its 64-weight group), scale, sub_scale
    high = tirx.bitwise_and(tirx.shift_right(w[1][t, c // 4, r, j], ((c % 4) * 2).astype("uint8")),
                            tirx.const(3, "uint8"))
    q6 = tirx.bitwise_or(q, tirx.shift_left(high, tirx.const(4, "uint8")))
    d = _f32(w[2][t, s, r]) * _f32(w[3][t, c, r])
    return d * (_f32(q6) - tirx.const(32.0, "float32"))


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
    k = int(w[0].shape[1]) * FORMATS[fmt].qweight_group  # qweight is [tiles, groups, TILE_ROWS, bytes]
    return te.compute(
        (ids.shape[0], k),
        lambda i, col: _weight(fmt, list(w), ids[i], col // CHUNK, col % CHUNK).astype(dtype),
        name=TAKE_BLOCK)


def dequantize_te(fmt: str, dtype: str, *w: te.Tensor) -> te.Tensor:
    """The whole quantized [N, K] weight dequantized to `dtype`: [N, K]."""
    n = w[0].shape[0] * TILE_ROWS
    k = int(w[0].shape[1]) * FORMATS[fmt].qweight_group
    return te.compute((n, k), lambda r, col: _weight(fmt, list(w), r, col // CHUNK, col % CHUNK).astype(dtype),
                      name=DEQUANT_WHOLE_BLOCK)


class Int8Kernels(Protocol):
    """Integer-dot matmuls over kept blocks with Q8_0 activation rows, for the formats in
    `formats`. The toolchain hands them in (vtool.schedules.cpu.int8_gemv.Int8GemvKernels):
    models/ does not import schedules/."""

    formats: tuple[str, ...]

    def matmul(self, fmt: str, rows: int, cols: int, lead: tuple[int | None, ...]) -> tirx.PrimFunc:
        """x of shape `lead` + [cols] (None: a symbolic dim), float32 -> `lead` + [rows] float32."""


class _QuantizedWeight(nn.Module):
    """The parts of one quantized [rows, cols] weight, as parameters named after them."""

    def __init__(self, fmt: str, rows: int, cols: int):
        if not keepable(fmt, rows, cols):
            raise ValueError(f"a [{rows}, {cols}] weight cannot stay in {fmt} blocks (formats with kernels: "
                             f"{', '.join(FORMATS)}; rows % {TILE_ROWS} == 0, cols % {block_cols(fmt)} == 0)")
        self.fmt, self.rows, self.cols = fmt, rows, cols
        for part in parts(fmt):
            setattr(self, part, nn.Parameter(part_shape(fmt, part, rows, cols), part_dtype(fmt, part)))

    def _parts(self) -> list[Tensor]:
        return [getattr(self, part) for part in parts(self.fmt)]

    # The integer-dot kernels of the Q8_0-activation matmuls and where they run ("decode": one
    # new position per sequence; "all"), set for the whole model by use_int8_gemv; None keeps
    # every matmul on the float path.
    int8_kernels: Int8Kernels | None = None
    int8_rows: str = "decode"
    # Prompts (and other matmuls over more than decode's one row per sequence) dequantize the
    # weight into a temporary of the compute dtype and take the float matmul (on CUDA: tensor
    # cores, cuBLAS), set by dequantize_prompts; decode rows keep the in-register GEMV.
    dequantize_prompts: bool = False
    # Formats whose batched-decode matmuls (batch_decode: one new position for each of a symbolic
    # number of sequences) call the tensor-core kernel (toolchain/block_mma.py), set by use_block_mma.
    block_mma: tuple[str, ...] = ()

    def _matmul(self, x: Tensor, prompt: bool = False) -> Tensor:
        """x [..., cols] -> [..., rows] float32. `prompt`: x comes from a prompt (prefill),
        even when it is one row (the logits of its last position)."""
        lead = x.shape[:-1]
        decode_rows = not prompt and isinstance(lead[-1], int) and lead[-1] == 1  # [1, 1] or [batch, 1]
        kernels = self.int8_kernels
        if kernels is not None and self.fmt in kernels.formats and (self.int8_rows == "all" or decode_rows):
            # Activation rows quantized to Q8_0 blocks, quants multiplied by quants (llama.cpp's
            # scheme): one row a GEMV, symbolic rows (batches, prompts) a GEMM. The kernels read
            # float32 rows; a bfloat16/float16 build's are widened first (exactly). Before, such
            # builds took the float path here while their manifest said q8_0 (2.9x slower decode).
            x32 = x if x.dtype == "float32" else x.astype("float32")
            dims = tuple(d if isinstance(d, int) else None for d in lead)
            func = kernels.matmul(self.fmt, self.rows, self.cols, dims)
            return op.tensor_ir_op(func, f"{self.fmt.lower()}_int8_matmul", [x32, *self._parts()],
                                   Tensor.placeholder([*lead, self.rows], "float32"))
        if decode_rows and self.fmt in self.block_mma and x.dtype in ("bfloat16", "float16"):
            # one sequence (decode): the functions take the single row through their GEMV, which
            # reads no partial sums (a one-split scratch, the smallest)
            one_row = isinstance(lead[0], int) and lead[0] == 1
            splits = 1 if one_row else block_mma_splits(self.rows, self.cols)
            return _block_mma(self.fmt, x, self._parts(), splits, self.rows)
        if self.dequantize_prompts and not decode_rows:
            w = op.tensor_expr_op(functools.partial(dequantize_te, self.fmt, x.dtype), f"{self.fmt.lower()}_dequantize",
                                  self._parts())
            return op.matmul(x, op.permute_dims(w), out_dtype="float32")  # as a dense Linear's
        return op.tensor_expr_op(functools.partial(matmul_te, self.fmt), f"{self.fmt.lower()}_matmul",
                                 [x, *self._parts()])


def use_int8_gemv(model: nn.Module, kernels: Int8Kernels | None, rows: str = "decode") -> int:
    """Route the quantized layers' matmuls in `model` to integer-dot `kernels` (None: the float
    path): those over decode rows (one new position per sequence) or, with rows="all", every
    one. Returns how many layers can take them."""
    count = 0
    for module in walk_modules(model):
        if isinstance(module, _QuantizedWeight):
            module.int8_kernels, module.int8_rows = kernels, rows
            count += kernels is not None and module.fmt in kernels.formats
    return count


def dequantize_prompts(model: nn.Module) -> int:
    """Make the quantized layers of `model` dequantize their weight for matmuls over prompts
    (see _QuantizedWeight.dequantize_prompts). Returns how many layers."""
    return set_in_modules(model, _QuantizedWeight, dequantize_prompts=True)


def _block_mma(fmt: str, x: Tensor, parts: list[Tensor], splits: int, rows: int) -> Tensor:
    """x [..., cols] times the blocks on the tensor cores -> [..., rows] float32: one call of the
    library's kernel, whose two outputs are the partial sums of its splits (a scratch) and their
    sum (op.extern takes one output only, so the call is made here)."""
    from tvm import relax
    from tvm.relax.frontend.nn.core import wrap_nested

    lead = list(x.shape[:-1])
    outs = [relax.TensorType([splits, *lead, rows], "float32"), relax.TensorType([*lead, rows], "float32")]
    call = relax.op.call_dps_packed(block_mma_symbol(fmt), relax.Tuple([x._expr, *(p._expr for p in parts)]),
                                    out_ty=outs)
    _partial, y = wrap_nested(call, f"{fmt.lower()}_block_mma")
    return y


def use_block_mma(model: nn.Module, formats: tuple[str, ...]) -> int:
    """Send the batched-decode matmuls of `model`'s layers kept in `formats` to the tensor-core
    kernel (see _QuantizedWeight.block_mma). Returns how many layers take it."""
    set_in_modules(model, _QuantizedWeight, block_mma=tuple(formats))
    return sum(1 for m in walk_modules(model) if isinstance(m, _QuantizedWeight) and m.fmt in formats)


def set_in_modules(model: nn.Module, kind: type, **attrs: object) -> int:
    """Set `attrs` on every `kind` module in `model` (a whole-model switch a build turns on
    before export); returns how many modules."""
    count = 0
    for module in walk_modules(model):
        if isinstance(module, kind):
            for name, value in attrs.items():
                setattr(module, name, value)
            count += 1
    return count


@contextlib.contextmanager
def decode_numerics(model: nn.Module) -> Iterator[None]:
    """While an entry point is traced: the quantized layers that take integer-dot kernels in
    decode take them for every row, so a few positions scored together (speculative
    verification) get the activations decode gives each of them."""
    changed = [m for m in walk_modules(model) if isinstance(m, _QuantizedWeight) and m.int8_kernels is not None
               and m.int8_rows == "decode"]
    for module in changed:
        module.int8_rows = "all"
    try:
        yield
    finally:
        for module in changed:
            module.int8_rows = "decode"


def walk_modules(module: nn.Module):  # noqa: ANN202 - a generator of modules
    yield module
    for child in vars(module).values():
        if isinstance(child, nn.ModuleList):  # a Module whose children sit in a list
            for item in child:
                yield from walk_modules(item)
        elif isinstance(child, nn.Module):
            yield from walk_modules(child)


class QuantizedLinear(_QuantizedWeight):
    """y = x . dequant(W)^T (+ b): Linear's contract (float32 accumulation, output in the
    compute dtype) with the weight kept in blocks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str, fmt: str):
        super().__init__(fmt, out_features, in_features)
        self.out_features = out_features
        self.bias = nn.Parameter((out_features,), dtype) if bias else None
        self.compute_dtype = dtype

    def forward(self, x: Tensor, prompt: bool = False) -> Tensor:
        y = self._matmul(x, prompt)
        if self.compute_dtype != "float32":
            y = y.astype(self.compute_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y


class SplitQuantizedLinear(nn.Module):
    """A fused linear (q|k|v, gate|up) whose parts are kept in different block formats (a
    Q4_K_M file's Q5_0 q/k and Q8_0 v): one QuantizedLinear per run of consecutive parts that
    share a format (`runs.<i>`, models/weights.py format_runs), their outputs concatenated, so
    every part keeps its own blocks and integer-dot kernel instead of the whole being dequantized."""

    def __init__(self, in_features: int, part_rows: tuple[int, ...], bias: bool, dtype: str, spec: str):
        runs = format_runs(spec)
        if len(part_rows) != sum(count for _, _, count in runs):
            raise ValueError(f"split format {spec!r} names {sum(c for _, _, c in runs)} parts, the layer has "
                             f"{len(part_rows)}")
        self.out_features = sum(part_rows)
        self.runs = nn.ModuleList([QuantizedLinear(in_features, sum(part_rows[first:first + count]), False, dtype, fmt)
                                   for fmt, first, count in runs])
        self.bias = nn.Parameter((self.out_features,), dtype) if bias else None

    def forward(self, x: Tensor, prompt: bool = False) -> Tensor:
        y = op.concat([run(x, prompt) for run in self.runs], dim=-1)
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

    def lm_head(self, h: Tensor, prompt: bool = False) -> Tensor:
        """h [..., dim] -> logits [..., num] float32."""
        return self._matmul(h, prompt)
