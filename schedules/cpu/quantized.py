"""CPU schedules for the quantized kernels of vtool.models.quantized_linear.

The kernels are found by their block names: `vtool_qmatmul` (the reduction over chunks
c of 16 weights and lanes j) reading `vtool_dequant` (weight[n, 16c + j] from the
quants and block scales).

GEMV (every row count static and 1: decode): the dequantization is inlined, so quants go
from memory into vector registers, are widened, converted and scaled there and feed the
multiply-add; nothing is stored. The 16 weights of a chunk are the vector lanes (one Q4
block's 16 bytes give two chunks: low nibbles, high nibbles), rfactored into per-lane
partial sums; ROWS output rows form a tile so one vector of x serves four weight rows;
tiles run in parallel over threads.

GEMM (a symbolic row count: prefill, batched decode): each thread dequantizes a tile of
GEMM_ROWS weight rows into a float32 scratch buffer (in L1: GEMM_ROWS x K x 4 bytes) once,
and every row of x passes over it, each x vector feeding GEMM_ROWS multiply-adds. Not yet
done: a register tile over several rows of x (its tail predicate kept the accumulators
out of registers when tried), so prefill runs at about float32 speed.
"""
from __future__ import annotations

from tvm import s_tir, tirx

DEQUANT_BLOCK = "vtool_dequant"  # names set by vtool.models.quantized_linear
MATMUL_BLOCK = "vtool_qmatmul"
ROWS = 4  # weight rows per tile
GEMM_ROWS = 8  # weight rows per tile (GEMM): 8 accumulators, each x vector feeds 8 FMAs


def _block(sch: s_tir.Schedule, name: str) -> s_tir.SBlockRV | None:
    try:
        return sch.get_sblock(name)
    except Exception:  # noqa: BLE001 - TVM raises a generic error for a missing block
        return None


def _static(extent: tirx.PrimExpr) -> int | None:
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def schedule_quantized_matmul(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """The scheduled function, or None when `func` holds no quantized matmul."""
    sch = s_tir.Schedule(func)
    matmul, dequant = _block(sch, MATMUL_BLOCK), _block(sch, DEQUANT_BLOCK)
    if matmul is None or dequant is None:
        return None
    iters = sch.get(matmul).iter_vars
    if len(sch.get_loops(matmul)) != len(iters) or _static(iters[-1].dom.extent) != 16:
        return None
    n_extent = _static(iters[-3].dom.extent)
    if n_extent is None or n_extent % ROWS:
        return None
    m_extents = [_static(iv.dom.extent) for iv in iters[:-3]]
    consumers = sch.get_consumers(matmul)
    lanes = min(lanes, 16)
    if all(e == 1 for e in m_extents):
        _gemv(sch, matmul, dequant, lanes, consumers)
    else:
        _gemm(sch, matmul, dequant, lanes, consumers)
    return sch.mod["main"]


def _rfactor_lanes(sch: s_tir.Schedule, matmul: s_tir.SBlockRV, lanes: int):
    """Fuse the row loops, split the chunk's 16 weights into vector lanes and rfactor them:
    returns the partial-sum block and its loops (m, n, c, j_outer or None, j_lane)."""
    *m_loops, _, _, j = sch.get_loops(matmul)
    if len(m_loops) > 1:
        sch.fuse(*m_loops)
    if lanes < 16:
        _, j = sch.split(j, [None, lanes])
    partial = sch.rfactor(j, factor_axis=len(sch.get(matmul).iter_vars) - 2)  # lanes innermost: contiguous
    loops = sch.get_loops(partial)
    if lanes < 16:
        m, n, c, jo, ji = loops
    else:
        (m, n, c, ji), jo = loops, None
    return partial, m, n, c, jo, ji


def _gemv(sch: s_tir.Schedule, matmul: s_tir.SBlockRV, dequant: s_tir.SBlockRV, lanes: int,
          consumers: list[s_tir.SBlockRV]) -> None:
    sch.compute_inline(dequant)
    partial, m, n, c, jo, ji = _rfactor_lanes(sch, matmul, lanes)
    no, ni = sch.split(n, [None, ROWS])
    cb, ch = sch.split(c, [None, 2])  # a block's two chunks: one 16-byte load of Q4 feeds both
    inner = [ch] + ([jo] if jo is not None else []) + [ni, ji]
    sch.reorder(no, m, cb, *inner)
    sch.parallel(no)
    for loop in inner[:-1]:
        sch.unroll(loop)
    sch.vectorize(ji)
    sch.decompose_reduction(partial, cb)
    # the sum over lanes and any fused epilogue run per tile, so their buffers are one tile
    sch.reverse_compute_at(matmul, m)
    for consumer in consumers:
        sch.reverse_compute_at(consumer, m)


def _gemm(sch: s_tir.Schedule, matmul: s_tir.SBlockRV, dequant: s_tir.SBlockRV, lanes: int,
          consumers: list[s_tir.SBlockRV]) -> None:
    partial, m, n, c, jo, ji = _rfactor_lanes(sch, matmul, lanes)
    no, ni = sch.split(n, [None, GEMM_ROWS])
    inner = ([jo] if jo is not None else []) + [ni, ji]
    sch.reorder(no, m, c, *inner)
    sch.parallel(no)
    for loop in inner[:-1]:
        sch.unroll(loop)
    sch.vectorize(ji)
    sch.decompose_reduction(partial, c)
    # one tile of weight rows, dequantized once per thread iteration, read by every row of x
    sch.compute_at(dequant, no)
    *_, dj = sch.get_loops(dequant)
    sch.vectorize(dj)
    sch.reverse_compute_at(matmul, m)
    for consumer in consumers:
        sch.reverse_compute_at(consumer, m)
