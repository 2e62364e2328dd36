"""CUDA schedules for matmuls over weights kept in GGUF blocks (models/quantized_linear.py's
`vtool_qmatmul`, found by block name): the weight is dequantized in registers inside the kernel,
never written out as floats.

Few rows of x (decode, batched decode up to LOW_BATCH rows, short verification steps): for
Q4_0, Q4_1, Q8_0, Q4_K and Q6_K the hand-written GEMV of quantized_gemv.py (each block's scale
and min applied once per block, a lane takes one block of a tile's four rows, rows of x in
groups of four); for the other formats, up to OLD_BATCH rows, a schedule of the per-element
expression (_gemv, below). A symbolic row count runs the first bucket that holds it.

_gemv: one thread block per ROWS output rows; threadIdx.z takes a row of x (the rows share
the block's weights: read from memory once, from L1 by the others), threadIdx.y an output row,
and the 32 lanes of threadIdx.x walk its reduction one 16-weight chunk at a time (chunk c =
half a 32-weight block: the low or high nibbles of its 16 bytes), several chunks unrolled so
their loads are in flight together; each lane sums its chunks in a register and the warp adds
the lanes (TVM's cross-thread reduction). A tile's ROWS rows keep their blocks side by side
(runtime/weights/ggml_blocks.py: [tiles, blocks, TILE_ROWS, bytes]), so the block's warps read
contiguous bytes. The inner 16 weights of a chunk are unrolled. The matmul's epilogue (the cast
to the model's dtype, a residual add) runs per output row after the reduction.

More rows (prompts, large batches): DLight's Matmul over the same kernel (the dequantization
inlined into its tile loads). A kernel whose row count is symbolic holds both and picks at run
time, as schedules/cuda/__init__.py's low-batch dispatch does for float matmuls.
"""
from __future__ import annotations

import re

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl

from vtool.schedules.cuda import quantized_gemv
from vtool.schedules.cuda.quantized_gemv import find_block

MATMUL_BLOCK = "vtool_qmatmul"  # models/quantized_linear.py's names (schedules/ does not import models/)
DEQUANT_BLOCK = "vtool_dequant"
ROWS = 4  # output rows per thread block: one tile of TILE_ROWS rows
LANES = 32
LOW_BATCH = 32  # rows of x up to which the hand-written GEMV runs (quantized_gemv.py's formats)
OLD_BATCH = 8  # and the schedule of the per-element expression (the other formats)
MAX_UNROLL = 32  # chunks per lane unrolled whole up to this many
# A symbolic row count runs the GEMV of the first bucket that holds it: the hand-written one
# (one row; up to 4; up to 32 in groups of 4 rows, those past the rows in use idle), or the
# schedule of the per-element expression (the other formats).
ROW_BUCKETS = (1, 4, LOW_BATCH)
OLD_BUCKETS = (1, 2, 4, OLD_BATCH)


def has_quantized_matmul(func: tirx.PrimFunc) -> bool:
    return find_block(s_tir.Schedule(func), MATMUL_BLOCK) is not None


def _gemv(func: tirx.PrimFunc, bucket: int = LOW_BATCH) -> tirx.PrimFunc:
    """The GEMV schedule; a symbolic row count takes `bucket` rows of threads (at most that many rows)."""
    sch = s_tir.Schedule(func)
    matmul = sch.get_sblock(MATMUL_BLOCK)
    dequant = find_block(sch, DEQUANT_BLOCK)
    if dequant is not None:
        sch.compute_inline(dequant)
    # The epilogue: elementwise blocks after the matmul. All but the last are inlined into the
    # next; the last is computed per output row once the row's reduction is done.
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    names = [sch.get(b).name_hint for b in blocks]
    after = blocks[names.index(MATMUL_BLOCK) + 1:]
    for block in after[:-1]:
        sch.compute_inline(block)
    *lead, n, c, j = sch.get_loops(matmul)
    dtypes = {str(sch.get(loop).loop_var.ty.dtype) for loop in (*lead, n, c, j)}
    if len(dtypes) != 1:  # TVM's LowerCrossThreadReduction skips such a block silently (see moe.py)
        raise ValueError(f"{MATMUL_BLOCK}: loops of types {sorted(dtypes)}; the cross-thread reduction needs one")
    m = sch.fuse(*lead) if len(lead) > 1 else lead[0]
    if not isinstance(sch.get(m).extent, tirx.IntImm):  # a symbolic row count, <= LOW_BATCH here
        mo, m = sch.split(m, [None, bucket])
        sch.bind(mo, "blockIdx.y")  # one block row (the dispatch's guard), never more
    no, ni = sch.split(n, [None, ROWS])
    co, ci = sch.split(c, [None, LANES])
    chunks = sch.get(co).extent
    # Every chunk of a lane unrolled (K <= 16384: 32 or fewer), so all its loads can be in flight
    # at once (H200, 8B-shape Q4_1 decode: 4.15 ms a token, 4.23 ms with 4 at a time; byte
    # loads and one chunk at a time took 9.8 ms).
    static = int(chunks) if isinstance(chunks, tirx.IntImm) else 0
    unroll = static if 0 < static <= MAX_UNROLL else next((u for u in (8, 4, 2) if static % u == 0), 1)
    coo, coi = sch.split(co, [None, unroll])
    sch.reorder(no, m, ni, ci, coo, coi, j)
    sch.bind(no, "blockIdx.x")
    # The rows of x are threads of one block: the weights come from memory once and from L1 for
    # the other rows, but every row dequantizes them again (H200, 8B shape: batch 8 took 7x
    # batch 1). Rows innermost in each lane (dequantize once, multiply into every row, then rfactor)
    # was tried: TVM could not size the per-lane sums of a symbolic row count as a register array.
    sch.bind(m, "threadIdx.z")
    sch.bind(ni, "threadIdx.y")
    sch.bind(ci, "threadIdx.x")
    _vector_loads(sch, matmul, coi)
    sch.unroll(coi)  # several chunks' loads in flight per lane, not one at a time
    sch.unroll(j)
    if after:
        sch.reverse_compute_at(after[-1], ni)
        sch.set_scope(matmul, 0, "local")  # each thread holds its row's sum after the warp's reduction
    return sch.mod["main"]


def _vector_loads(sch: s_tir.Schedule, matmul: s_tir.SBlockRV, chunk_loop: s_tir.LoopRV) -> None:
    """A lane's 16 bytes of quants for its chunk (and its 16 activations) copied into registers
    in vector loads before the unrolled 16 multiply-adds, instead of one byte (one value) per
    load: every block format reads its chunk's quants as 16 contiguous bytes of `qweight` (the
    Q6_K / Q2_K / Q3_K high bits likewise of `qhigh`), 16-byte aligned by the tiled layout."""
    reads = [(region.source.name, region.source.dtype) for region in sch.get(matmul).reads]
    for index, (name, dtype) in enumerate(reads):
        if not (re.search(r"(qweight|qhigh)\d*$", name) or index == 0):  # params get numeric suffixes
            continue  # index 0: x, the activations
        try:
            cache = sch.cache_read(matmul, index, "local")
            sch.compute_at(cache, chunk_loop)
            inner = sch.get_loops(cache)[-1]
            extent = sch.get(inner).extent
            lanes = 16 // (tvm.DataType(str(dtype)).bits // 8)  # 16 bytes: CUDA's widest load
            if isinstance(extent, tirx.IntImm) and int(extent) % min(lanes, int(extent)) == 0:
                lanes = min(lanes, int(extent))
                if lanes > 1:
                    sch.vectorize(sch.split(inner, [None, lanes])[1])
        except Exception:  # noqa: BLE001 - a region that is not one contiguous run: scalar loads
            continue


def _few_rows(func: tirx.PrimFunc, bucket: int, old: bool = True) -> tirx.PrimFunc | None:
    """The hand-written GEMV (quantized_gemv.py: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) where it takes
    `func`, else the schedule of the per-element expression (_gemv) up to OLD_BATCH rows; None
    past that (DLight's Matmul then)."""
    try:
        return func.with_body(quantized_gemv.gemv(func, bucket).body)
    except quantized_gemv.Unsupported:
        return _gemv(func, bucket) if old and bucket <= OLD_BATCH else None


def _general(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    space = dl.gpu.Matmul().apply(func, target, False)
    if isinstance(space, (list, tuple)):
        space = space[0] if len(space) == 1 else None
    return None if space is None else space.mod["main"]


def _rows(func: tirx.PrimFunc) -> int | tirx.PrimExpr:
    """The number of rows of x, the product of the matmul's leading extents: an int when they
    are all static."""
    sch = s_tir.Schedule(func)
    *lead, _n, _c, _j = sch.get_loops(sch.get_sblock(MATMUL_BLOCK))
    static, symbolic = 1, []
    for loop in lead:
        extent = sch.get(loop).extent
        if isinstance(extent, tirx.IntImm):
            static *= int(extent)
        else:
            symbolic.append(extent)
    if not symbolic:
        return static
    rows = symbolic[0] * static if static != 1 else symbolic[0]
    for extent in symbolic[1:]:
        rows = rows * extent
    return rows


def schedule_quantized(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """`func` scheduled, or None when it holds no quantized matmul."""
    if func.attrs is not None and func.attrs.get("tirx.is_scheduled", False):
        return None
    if not has_quantized_matmul(func):
        return None
    rows = _rows(func)
    if isinstance(rows, int):
        scheduled = _few_rows(func, rows) if rows <= LOW_BATCH else None
        if scheduled is None:
            scheduled = _general(func, target)
            if scheduled is None:
                return None
        return scheduled.with_attr("tirx.is_scheduled", True)
    general = _general(func, target)
    if general is None:
        return None
    body = general.body
    buckets = ROW_BUCKETS if _few_rows(func, ROW_BUCKETS[0], old=False) is not None else OLD_BUCKETS
    for bucket in reversed(buckets):  # the fewest threads that hold the rows (a padded decode batch)
        few = _few_rows(func, bucket)
        if few is not None:
            body = tirx.IfThenElse(tirx.op.tvm_thread_invariant(rows <= bucket), few.body, body)
    root = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", body))
    return (func.with_body(root)
            .with_attr("tirx.is_scheduled", True)
            .with_attr("tirx.HoistIfThenElseExprWithBlock", 1))
