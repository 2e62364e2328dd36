"""A hand-written CUDA GEMV over weights kept in GGUF blocks, for a few rows of x (decode,
batched decode): Q4_0, Q4_1, Q8_0, Q4_K and Q6_K (the other kept formats keep
schedules/cuda/quantized.py's schedule of the per-element expression).

Why not a schedule: models/quantized_linear.py's `vtool_dequant` scales and offsets every weight
on its own (about ten instructions a weight, arithmetic-bound on the H200). Here each block's
scale and min are applied once per block:

    sum_j (d * q_j + m) * x_j  =  d * sum_j q_j * x_j  +  m * sum_j x_j

so a weight costs a byte permute and one multiply-add per row of x. A 4-bit quant q goes into
the top of the mantissa of 1.0 (the byte 0x80 | q << 3 into bits 16..23 under 0x3F: the float
1 + q / 16, exact; Q6_K's 6-bit quants 0x80 | q << 1, 1 + q / 64), so a block's dot is
part = sum (1 + q / 16) * x and sum q * x = 16 * (part - sum x) once per block, with the block
sum of x that the min needs anyway (no subtract per weight). Q8_0's 8-bit quants leave no room
for the 0x80: they become 2^23 + (q + 128) and are subtracted. The block sum of x is shared by
the tile's four rows.

Layout (runtime/weights/ggml_blocks.py): a tile of TILE_ROWS = 4 rows keeps its blocks side by
side, [tile, block, row, bytes]. A thread takes one 32-weight block of all four rows of a tile:
four 16-byte loads of one contiguous 64-byte run (Q8_0: eight), so a warp reads 2 KB in one go.
It walks its blocks one at a time with a stride of the block's lanes (32 per warp, KW warps
splitting one tile's reduction when the matrix has few tiles), keeps one float sum per (row of
x, row of the tile), and the warp adds the lanes with shuffles (warps of one tile then through
shared memory). Each
row of x is read once per block per thread and used for the tile's four rows; up to MAX_ROWS
rows of x share every weight's conversion. More rows (a batched decode's bucket, up to 32) run
in groups of MAX_ROWS, one thread block per (group, tiles), the groups of a tile next to each
other in the grid so they read its weights from L2 together; a group past the rows in use idles.

The result goes through the matmul's epilogue (the cast to the model's dtype, a residual add),
taken from the fused function's last block and applied to each output value.

`cpu=True` builds the same arithmetic with serial loops for the host (a test checks the index
and bit arithmetic against numpy without a GPU): the thread loops run one after another and the
lane sums go through a scratch buffer instead of shuffles.
"""
from __future__ import annotations

import re

import tvm
from tvm import s_tir, tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import tirx as IBT

MATMUL_BLOCK = "vtool_qmatmul"  # models/quantized_linear.py's names
DEQUANT_BLOCK = "vtool_dequant"
FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
TILE_ROWS = 4
BLOCK = 32
LANES = 32
THREADS = 128  # per thread block: KW warps on one tile times 4 // KW tiles
TARGET_WARPS = 4096  # about 31 warps per SM of a 132-SM H100/H200: split K across warps below it
MAX_ROWS = 4  # rows of x per thread block (more: groups of them side by side; 8 took 254 registers)
MAGIC = 0x4B000000  # the float 2^23: its low mantissa byte holds a small integer exactly
ONE_HIGH = 0x3F000000  # the high byte of the float 1.0 (0x3F800000; the 0x80 comes with the quant's byte)
_PART = re.compile(r"(sub_scale|sub_min|qweight|qhigh|scale|min)\d*$")


class Unsupported(Exception):
    """The function is not one this kernel takes: the caller keeps the scheduled expression."""


def find_block(sch: s_tir.Schedule, name: str) -> s_tir.SBlockRV | None:
    """The block named `name`, or None."""
    try:
        return sch.get_sblock(name)
    except Exception:  # noqa: BLE001 - no such block
        return None


_BINARY = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.FloorDiv, tirx.FloorMod, tirx.Mod, tirx.Min, tirx.Max,
           tirx.EQ, tirx.NE, tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.And, tirx.Or, tirx.RShift, tirx.LShift,
           tirx.BitwiseAnd, tirx.BitwiseOr, tirx.BitwiseXor)


def _is_load(node) -> bool:
    return isinstance(node, tvm.ir.expr.TensorLoad)


def _children(node) -> list:
    if isinstance(node, _BINARY):
        return [node.a, node.b]
    if isinstance(node, tirx.Cast):
        return [node.value]
    if _is_load(node):
        return list(node.indices)
    if isinstance(node, tirx.Select):
        return [node.condition, node.true_value, node.false_value]
    if isinstance(node, tirx.BufferStore):
        return [node.value, *node.indices]
    if isinstance(node, tvm.ir.expr.Call):
        return list(node.args)
    if isinstance(node, (tirx.IntImm, tirx.FloatImm, tirx.Var)):
        return []
    raise Unsupported(f"expression node {type(node).__name__}")


def _nodes(node) -> list:
    """Every node of an expression (or a BufferStore), parents first."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(_children(n))
    return out


def _rewrite(node, fn):
    """`node` rebuilt bottom-up with fn(n) in place of each n where it returns one."""
    hit = fn(node)
    if hit is not None:
        return hit
    if isinstance(node, _BINARY):
        return type(node)(_rewrite(node.a, fn), _rewrite(node.b, fn))
    if isinstance(node, tirx.Cast):
        return tirx.Cast(node.ty.dtype, _rewrite(node.value, fn))
    if _is_load(node):
        return tirx.BufferLoad(node.source, [_rewrite(i, fn) for i in node.indices])
    if isinstance(node, tirx.Select):
        return tirx.Select(_rewrite(node.condition, fn), _rewrite(node.true_value, fn),
                           _rewrite(node.false_value, fn))
    if isinstance(node, (tirx.IntImm, tirx.FloatImm, tirx.Var)):
        return node
    raise Unsupported(f"epilogue node {type(node).__name__}")


def _has_select(stmt) -> bool:
    try:
        return any(isinstance(n, tirx.Select) for n in _nodes(stmt))
    except Unsupported:
        return True  # not a plain expression: not one of the formats here


def _format(parts: dict, dequant_body) -> str:
    names = set(parts)
    qweight = parts.get("qweight")
    if qweight is None:
        raise Unsupported("no qweight")
    if names == {"qweight", "scale"}:
        if str(qweight.dtype) == "int8":
            return "Q8_0"
        if _has_select(dequant_body):
            raise Unsupported("IQ4_NL")
        return "Q4_0"
    if names == {"qweight", "scale", "min"}:
        return "Q4_1"
    if names == {"qweight", "scale", "min", "sub_scale", "sub_min"}:
        return "Q4_K"
    if names == {"qweight", "qhigh", "scale", "sub_scale"} and int(parts["qhigh"].shape[-1]) == 16 \
            and int(qweight.shape[1]) == 2 * int(parts["qhigh"].shape[1]):
        return "Q6_K"
    raise Unsupported(f"parts {sorted(names)}")


class _Analysis:
    """What the kernel needs from the fused function: x, the weight's parts, the row count and
    the epilogue."""

    def __init__(self, func: tirx.PrimFunc):
        sch = s_tir.Schedule(func)
        matmul = find_block(sch, MATMUL_BLOCK)
        dequant = find_block(sch, DEQUANT_BLOCK)
        if matmul is None or dequant is None:
            raise Unsupported("blocks")
        self.parts = {}
        for region in sch.get(dequant).reads:
            match = _PART.search(region.source.name)
            if match is None:
                raise Unsupported(f"read {region.source.name}")
            self.parts[match.group(1)] = region.source
        self.fmt = _format(self.parts, sch.get(dequant).body)
        mm = sch.get(matmul)
        reads = [r.source for r in mm.reads]
        self.x = reads[0]
        if self.x.same_as(sch.get(dequant).writes[0].source) or len(self.x.shape) < 2:
            raise Unsupported("x")
        offset = self.x.elem_offset
        if not (isinstance(offset, tirx.IntImm) and int(offset) == 0) or self.x.strides:
            raise Unsupported("x is a view")  # the kernel reads it as a dense [rows, K] array
        self.mm_buffer = mm.writes[0].source
        qweight = self.parts["qweight"]
        self.tiles = int(qweight.shape[0])
        self.n = self.tiles * TILE_ROWS
        self.k = int(self.x.shape[-1])
        if self.k % 256 and self.fmt in ("Q4_K", "Q6_K") or self.k % BLOCK:
            raise Unsupported("K")
        self.lead = list(self.x.shape[:-1])
        if list(self.mm_buffer.shape[:-1]) != self.lead and len(self.mm_buffer.shape) != len(self.x.shape):
            raise Unsupported("matmul shape")
        symbolic = [e for e in self.lead if not isinstance(e, tirx.IntImm)]
        if len(symbolic) > 1:
            raise Unsupported("two symbolic row dims")
        rows = 1
        for extent in self.lead:
            rows = rows * extent
        self.rows = rows  # an int-valued PrimExpr
        # The epilogue: every elementwise block after the matmul inlined into the last one.
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        names = [sch.get(b).name_hint for b in blocks]
        after = blocks[names.index(MATMUL_BLOCK) + 1:]
        for block in after[:-1]:
            sch.compute_inline(block)
        self.store = None
        if after:
            last = sch.get(after[-1])
            store = last.body
            if not isinstance(store, tirx.BufferStore):
                raise Unsupported("epilogue body")
            ivars = [iv.var for iv in last.iter_vars]
            if len(ivars) != len(self.x.shape) or any(not idx.same_as(v) for idx, v in zip(store.indices, ivars)):
                raise Unsupported("epilogue indices")
            nodes = _nodes(store.value)
            _rewrite(store.value, lambda n: None)  # raises on a node it cannot rebuild
            loads = [n for n in nodes if _is_load(n) and n.source.same_as(self.mm_buffer)]
            if any(any(not a.same_as(b) for a, b in zip(ld.indices, ivars)) for ld in loads):
                raise Unsupported("epilogue reads the matmul elsewhere")
            if any(_is_load(n) and not n.source.same_as(self.mm_buffer) and n.source.scope() != "global"
                   for n in nodes):
                raise Unsupported("epilogue reads a scratch buffer")
            self.store, self.ivars = store, ivars
        elif self.mm_buffer.scope() != "global" or not any(self.mm_buffer.same_as(p) for p in func.params):
            raise Unsupported("matmul output is not a parameter")

    def lead_index(self, i) -> list:
        """The lead indices of flat row i of x."""
        idx = []
        for extent in reversed(self.lead):
            if isinstance(extent, tirx.IntImm) and int(extent) == 1:
                idx.append(tirx.const(0, "int64"))
            else:
                idx.append(tirx.floormod(i, extent) if len(idx) < len(self.lead) - 1 else i)
                i = tirx.floordiv(i, extent)
        return list(reversed(idx))

    def emit_output(self, value, i, n) -> None:
        """Store one matmul value (float32) of flat row i, column n through the epilogue."""
        idx = [tirx.Cast("int64", e) for e in [*self.lead_index(i), n]]
        if self.store is None:
            IBT.buffer_store(self.mm_buffer, value, idx)
            return
        def replace(node):
            if _is_load(node) and node.source.same_as(self.mm_buffer):
                return value
            if isinstance(node, tirx.Var):
                for v, e in zip(self.ivars, idx):
                    if node.same_as(v):
                        return e
            return None

        IBT.buffer_store(self.store.buffer, _rewrite(self.store.value, replace), idx)


def _f32(v):
    return T.Cast("float32", v)


def gemv(func: tirx.PrimFunc, bucket: int, cpu: bool = False) -> tirx.PrimFunc:
    """The kernel for `func` (a vtool_qmatmul function) over at most `bucket` rows of x
    (all of them when its row count is static). Raises Unsupported."""
    a = _Analysis(func)
    if isinstance(a.rows, (int, tirx.IntImm)):
        R = int(a.rows)
        static_rows = True
    else:
        R = bucket
        static_rows = False
    if R > 32 or R < 1:
        raise Unsupported(f"{R} rows")
    # More than MAX_ROWS rows: groups of MAX_ROWS, one thread block each, side by side in the
    # grid (the fastest index), so the groups of one tile read its weights from L2 together.
    groups = (R + MAX_ROWS - 1) // MAX_ROWS
    R = (R + groups - 1) // groups
    if groups * R != (int(a.rows) if static_rows else bucket):
        static_rows = False  # a row guard for the last group
    fmt, tiles, nb = a.fmt, a.tiles, a.k // BLOCK
    kw = 1
    while kw < 4 and tiles * kw < TARGET_WARPS:
        kw *= 2
    tz = THREADS // LANES // kw
    grid = (tiles + tz - 1) // tz
    per_round = LANES * kw
    iters = (nb + per_round - 1) // per_round
    ragged = nb % per_round != 0 or tiles % tz != 0
    words = 8 if fmt == "Q8_0" else 4  # uint32 words of quants per (block, row)
    rows_expr = a.rows
    M = R * TILE_ROWS  # sums per thread
    xbuf = a.x
    x_dtype = str(xbuf.dtype)
    m_flat = a.rows
    x_data = xbuf.data
    x_vec = min(8, 16 // (tvm.DataType(x_dtype).bits // 8))  # elements per 16-byte load
    P = a.parts
    QW = P["qweight"]
    QH = P.get("qhigh")
    SC, MN, SSC, SMN = P.get("scale"), P.get("min"), P.get("sub_scale"), P.get("sub_min")
    q_bytes = int(QW.shape[-1])  # 16, or 32 for Q8_0
    two_halves = fmt == "Q6_K"  # two scales per block (one per 16 weights)
    needs_sum = fmt in ("Q4_0", "Q4_1", "Q4_K", "Q6_K")
    one = needs_sum  # 4/6-bit quants as 1 + q / 2^qbits; not Q8_0: its 8 bits leave no room for the 0x80
    qbits = 6 if fmt == "Q6_K" else 4
    emit = a.emit_output
    K = a.k

    def prmt(word, e):
        """Byte e of `word` as the float 2^23 + byte."""
        if cpu:
            bits = T.bitwise_or(T.bitwise_and(T.shift_right(word, T.uint32(8 * e)), T.uint32(0xFF)),
                                T.uint32(MAGIC))
        else:
            bits = T.call_pure_extern("uint32", "__byte_perm", word, T.uint32(MAGIC), T.uint32(0x7540 + e))
        return T.reinterpret("float32", bits)

    def prmt_one(word, e):
        """Byte e of `word` (0x80 | v << (7 - qbits)) as the float 1 + v / 2^qbits: the byte
        into bits 16..23 (its top bit the exponent's lowest), 0x3F above, zeros below."""
        if cpu:
            bits = T.bitwise_or(T.shift_left(T.bitwise_and(T.shift_right(word, T.uint32(8 * e)), T.uint32(0xFF)),
                                             T.uint32(16)), T.uint32(ONE_HIGH))
        else:
            bits = T.call_pure_extern("uint32", "__byte_perm", word, T.uint32(ONE_HIGH), T.uint32(0x7044 + 256 * e))
        return T.reinterpret("float32", bits)

    def xrow(i):
        if static_rows and groups == 1:
            return i
        return T.min(i, rows_expr - 1)

    def row_ok(i):
        if static_rows and groups == 1:
            return T.bool(True)
        return i < rows_expr


    # pylint: disable=too-many-locals,too-many-statements,too-many-branches
    @T.macro
    def block_sums(t, b, g0, acc, X, qw, qh, xv, xf, wf, part, sx, lo):
        """Add block b of tile t (all four rows) times the R rows of x into acc[i * 4 + r]."""
        for r in T.unroll(TILE_ROWS):
            for v in T.vectorized(q_bytes if cpu else 16):
                qw[r, v] = QW[t, b, r, v]
            if q_bytes == 32:
                for v in T.vectorized(16):
                    qw[r, 16 + v] = QW[t, b, r, 16 + v]
            if fmt == "Q6_K":
                for v in T.vectorized(16):
                    qh[r, v] = QH[t, b // 2, r, v]
        for h in T.unroll(2):
            for v in T.unroll(M):
                part[h, v] = T.float32(0)
            for i in T.unroll(R):
                sx[h, i] = T.float32(0)
        for jj in T.unroll(words // 2):
            # the activations of words 2jj and 2jj + 1: elements 8jj.. (and 16 + 8jj.. of the
            # high nibbles), 16-byte loads of each row of x
            for i in T.unroll(R):
                for c in T.unroll(8 // x_vec):
                    for v in T.vectorized(x_vec):
                        xv[i, c * x_vec + v] = X[xrow(g0 + i), b * BLOCK + 8 * jj + c * x_vec + v]
                        if fmt != "Q8_0":
                            xv[i, 8 + c * x_vec + v] = X[xrow(g0 + i), b * BLOCK + 16 + 8 * jj + c * x_vec + v]
            for jw in T.unroll(2):
                j = 2 * jj + jw
                # the 8 (Q8_0: 4) activations word j meets, per row of x, as float32
                for i in T.unroll(R):
                    for e in T.unroll(4):
                        xf[i, e] = _f32(xv[i, 4 * jw + e])
                        if fmt != "Q8_0":
                            xf[i, 4 + e] = _f32(xv[i, 8 + 4 * jw + e])
                    if needs_sum:
                        for e in T.unroll(4):
                            sx[0, i] = sx[0, i] + xf[i, e]
                            if two_halves:
                                sx[1, i] = sx[1, i] + xf[i, 4 + e]
                            else:
                                sx[0, i] = sx[0, i] + xf[i, 4 + e]
                for r in T.unroll(TILE_ROWS):
                    word: T.let[T.uint32] = T.reinterpret("uint32", qw.vload([r, 4 * j], "uint8x4"))
                    if fmt == "Q8_0":
                        lo[0] = T.bitwise_xor(word, T.uint32(0x80808080))  # q + 128
                        for e in T.unroll(4):
                            wf[e] = prmt(lo[0], e) - T.float32(8388608.0 + 128.0)
                        for i in T.unroll(R):
                            for e in T.unroll(4):
                                part[0, i * 4 + r] = part[0, i * 4 + r] + wf[e] * xf[i, e]
                    else:
                        lo[0] = T.bitwise_and(word, T.uint32(0x0F0F0F0F))
                        lo[1] = T.bitwise_and(T.shift_right(word, T.uint32(4)), T.uint32(0x0F0F0F0F))
                        if fmt == "Q6_K":
                            hword: T.let[T.uint32] = T.reinterpret("uint32", qh.vload([r, 4 * j], "uint8x4"))
                            shift: T.let[T.uint32] = T.Cast("uint32", (b % 2) * 4)
                            lo[0] = T.bitwise_or(lo[0], T.shift_left(T.bitwise_and(
                                T.shift_right(hword, shift), T.uint32(0x03030303)), T.uint32(4)))
                            lo[1] = T.bitwise_or(lo[1], T.shift_left(T.bitwise_and(
                                T.shift_right(hword, shift + T.uint32(2)), T.uint32(0x03030303)), T.uint32(4)))
                        if one:
                            # v < 2^qbits in each byte -> 0x80 | v << (7 - qbits): one multiply-add
                            lo[0] = lo[0] * T.uint32(1 << (7 - qbits)) + T.uint32(0x80808080)
                            lo[1] = lo[1] * T.uint32(1 << (7 - qbits)) + T.uint32(0x80808080)
                            for e in T.unroll(4):
                                wf[e] = prmt_one(lo[0], e)
                                wf[4 + e] = prmt_one(lo[1], e)
                        else:
                            for e in T.unroll(4):
                                wf[e] = prmt(lo[0], e) - T.float32(8388608.0)
                                wf[4 + e] = prmt(lo[1], e) - T.float32(8388608.0)
                        for i in T.unroll(R):
                            for e in T.unroll(4):
                                part[0, i * 4 + r] = part[0, i * 4 + r] + wf[e] * xf[i, e]
                                if two_halves:
                                    part[1, i * 4 + r] = part[1, i * 4 + r] + wf[4 + e] * xf[i, 4 + e]
                                else:
                                    part[0, i * 4 + r] = part[0, i * 4 + r] + wf[4 + e] * xf[i, 4 + e]
        # the block's scales, once per (block, row); with `one`, part = sum (1 + q / 2^qbits) x
        # = sum x + sum q x / 2^qbits, so sum q x = 2^qbits * part - 2^qbits * sum x
        if one:
            for h in T.unroll(2 if two_halves else 1):
                for i in T.unroll(R):
                    for r in T.unroll(TILE_ROWS):
                        part[h, i * 4 + r] = T.float32(1 << qbits) * (part[h, i * 4 + r] - sx[h, i])
        for r in T.unroll(TILE_ROWS):
            if fmt == "Q8_0":
                d: T.let[T.float32] = _f32(SC[t, b, r])
                for i in T.unroll(R):
                    acc[i * 4 + r] = acc[i * 4 + r] + d * part[0, i * 4 + r]
            elif fmt == "Q4_0":
                d: T.let[T.float32] = _f32(SC[t, b, r])
                for i in T.unroll(R):
                    acc[i * 4 + r] = acc[i * 4 + r] + d * (part[0, i * 4 + r] - T.float32(8) * sx[0, i])
            elif fmt == "Q4_1":
                d: T.let[T.float32] = _f32(SC[t, b, r])
                m: T.let[T.float32] = _f32(MN[t, b, r])
                for i in T.unroll(R):
                    acc[i * 4 + r] = acc[i * 4 + r] + (d * part[0, i * 4 + r] + m * sx[0, i])
            elif fmt == "Q4_K":
                d: T.let[T.float32] = _f32(SC[t, b // 8, r]) * _f32(SSC[t, b, r])
                m: T.let[T.float32] = _f32(MN[t, b // 8, r]) * _f32(SMN[t, b, r])
                for i in T.unroll(R):
                    acc[i * 4 + r] = acc[i * 4 + r] + (d * part[0, i * 4 + r] - m * sx[0, i])
            else:  # Q6_K: w = (d * sc) * (q - 32), one sc per 16 weights: the block's halves
                d0: T.let[T.float32] = _f32(SC[t, b // 8, r]) * _f32(SSC[t, 2 * b, r])
                d1: T.let[T.float32] = _f32(SC[t, b // 8, r]) * _f32(SSC[t, 2 * b + 1, r])
                for i in T.unroll(R):
                    acc[i * 4 + r] = acc[i * 4 + r] + (d0 * (part[0, i * 4 + r] - T.float32(32) * sx[0, i])
                                                       + d1 * (part[1, i * 4 + r] - T.float32(32) * sx[1, i]))

    if cpu:
        @T.prim_func(s_tir=True, check_well_formed=False)
        def kernel():
            scratch = T.alloc_buffer((groups, grid, tz, kw, LANES, M), "float32")
            for gy, bx, tzi, ty, tx in T.grid(groups, grid, tz, kw, LANES):
                with T.sblock("lane"):
                    acc = T.sblock_alloc_buffer((M,), "float32", scope="local")
                    qw = T.sblock_alloc_buffer((TILE_ROWS, q_bytes), "uint8", scope="local")
                    qh = T.sblock_alloc_buffer((TILE_ROWS, 16), "uint8", scope="local")
                    xv = T.sblock_alloc_buffer((R, 16), x_dtype, scope="local")
                    xf = T.sblock_alloc_buffer((R, 8), "float32", scope="local")
                    wf = T.sblock_alloc_buffer((8,), "float32", scope="local")
                    part = T.sblock_alloc_buffer((2, M), "float32", scope="local")
                    sx = T.sblock_alloc_buffer((2, R), "float32", scope="local")
                    lo = T.sblock_alloc_buffer((2,), "uint32", scope="local")
                    X = T.decl_buffer((m_flat, K), x_dtype, data=x_data)
                    for v in T.serial(M):
                        acc[v] = T.float32(0)
                    t: T.let[T.int64] = T.Cast("int64", bx * tz + tzi)
                    for it in T.serial(iters):
                        b: T.let[T.int64] = T.Cast("int64", (it * kw + ty) * LANES + tx)
                        if b < nb and t < tiles:
                            block_sums(t, b, gy * R, acc, X, qw, qh, xv, xf, wf, part, sx, lo)
                    for v in T.serial(M):
                        scratch[gy, bx, tzi, ty, tx, v] = acc[v]
            for gy, bx, tzi, v in T.grid(groups, grid, tz, M):
                with T.sblock("out"):
                    s = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    s[0] = T.float32(0)
                    for ty, tx in T.grid(kw, LANES):
                        s[0] = s[0] + scratch[gy, bx, tzi, ty, tx, v]
                    t: T.let[T.int64] = T.Cast("int64", bx * tz + tzi)
                    if t < tiles and row_ok(gy * R + v // 4):
                        emit(s[0], T.Cast("int64", gy * R + v // 4), t * 4 + v % 4)
        return kernel

    # a lane's blocks one at a time: unrolled (their loads in flight together) was slower on the
    # H200 (Q4_1 gate/up 25.3 us unrolled, 23.7-23.9 serial; the others alike or slower unrolled)
    lane_loop = T.serial
    group_axis, tile_axis = ("blockIdx.x", "blockIdx.y") if groups > 1 else ("blockIdx.y", "blockIdx.x")

    @T.prim_func(s_tir=True, check_well_formed=False)
    def kernel():
        for gy in T.thread_binding(groups, thread=group_axis):
          for bx in T.thread_binding(grid, thread=tile_axis):
            for tzi in T.thread_binding(tz, thread="threadIdx.z"):
                for ty in T.thread_binding(kw, thread="threadIdx.y"):
                    for tx in T.thread_binding(LANES, thread="threadIdx.x"):
                        with T.sblock("vtool_qgemv"):
                            acc = T.sblock_alloc_buffer((M,), "float32", scope="local")
                            red = T.sblock_alloc_buffer((tz, kw, M), "float32", scope="shared")
                            qw = T.sblock_alloc_buffer((TILE_ROWS, q_bytes), "uint8", scope="local")
                            qh = T.sblock_alloc_buffer((TILE_ROWS, 16), "uint8", scope="local")
                            xv = T.sblock_alloc_buffer((R, 16), x_dtype, scope="local")
                            xf = T.sblock_alloc_buffer((R, 8), "float32", scope="local")
                            wf = T.sblock_alloc_buffer((8,), "float32", scope="local")
                            part = T.sblock_alloc_buffer((2, M), "float32", scope="local")
                            sx = T.sblock_alloc_buffer((2, R), "float32", scope="local")
                            lo = T.sblock_alloc_buffer((2,), "uint32", scope="local")
                            X = T.decl_buffer((m_flat, K), x_dtype, data=x_data)
                            for v in T.unroll(M):
                                acc[v] = T.float32(0)
                            t: T.let[T.int64] = T.Cast("int64", bx * tz + tzi)
                            if row_ok(gy * R):  # a group past the rows in use does nothing
                                for it in lane_loop(iters):
                                    b: T.let[T.int64] = T.Cast("int64", (it * kw + ty) * LANES + tx)
                                    if ragged:
                                        if b < nb and t < tiles:
                                            block_sums(t, b, gy * R, acc, X, qw, qh, xv, xf, wf, part, sx, lo)
                                    else:
                                        block_sums(t, b, gy * R, acc, X, qw, qh, xv, xf, wf, part, sx, lo)
                            for v in T.unroll(M):
                                for s in T.unroll(5):
                                    acc[v] = acc[v] + T.call_extern(
                                        "float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF), acc[v],
                                        T.shift_right(16, s), 32)
                            if kw > 1:
                                if tx == 0:
                                    for v in T.unroll(M):
                                        red[tzi, ty, v] = acc[v]
                                T.tvm_storage_sync("shared")
                                if ty == 0:
                                    for v in T.unroll(M):
                                        if tx == v % LANES:
                                            acc[v] = red[tzi, 0, v]
                                            for w in T.unroll(1, kw):
                                                acc[v] = acc[v] + red[tzi, w, v]
                                            if t < tiles and row_ok(gy * R + v // 4):
                                                emit(acc[v], T.Cast("int64", gy * R + v // 4), t * 4 + v % 4)
                            else:
                                for v in T.unroll(M):
                                    if tx == v % LANES:
                                        if t < tiles and row_ok(gy * R + v // 4):
                                            emit(acc[v], T.Cast("int64", gy * R + v // 4), t * 4 + v % 4)
    return kernel

