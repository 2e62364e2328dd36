"""CPU schedule for `C[m.., n] = sum_k A[m.., k] * W[n, k]` kernels (plus fused epilogues).

This covers the decode GEMVs (m = 1) and the prefill GEMMs (m = sequence length) that
FuseTransposeMatmul produces. The reduction over k is split into vector lanes and
rfactored, so the inner loop is a contiguous vector multiply-add over both A's row and
W's row; output rows are tiled in groups of ROWS and spread over threads, and each tile
of W stays in L1 while every row of A passes over it. DLight's CPU GEMV rule was slower
than no schedule at all on this shape (see the TVM notes); this one is not.
"""
from __future__ import annotations

from tvm import s_tir, tirx

ROWS = 4  # output features per inner tile: 4 rows of W in flight hide load latency


def _iter_kinds(sch: s_tir.Schedule, block: s_tir.SBlockRV) -> list[int]:
    return [int(iv.iter_type) for iv in sch.get(block).iter_vars]


def _find_reduction(sch: s_tir.Schedule) -> s_tir.SBlockRV | None:
    blocks = sch.get_child_blocks(sch.get_sblock("root")) if _has_root(sch) else []
    reductions = [b for b in blocks if tirx.IterVar.CommReduce in _iter_kinds(sch, b)]
    return reductions[0] if len(reductions) == 1 else None


def _has_root(sch: s_tir.Schedule) -> bool:
    try:
        sch.get_sblock("root")
        return True
    except Exception:  # noqa: BLE001 - TVM raises a generic error for a missing block
        return False


def _is_nt_matmul(sch: s_tir.Schedule, block: s_tir.SBlockRV) -> bool:
    """Spatial iters first, one reduction iter last, and a 2-D operand read as [n, k]
    where n is the last spatial iter and k the reduction iter."""
    stmt = sch.get(block)
    kinds = [int(iv.iter_type) for iv in stmt.iter_vars]
    if kinds[-1] != tirx.IterVar.CommReduce or tirx.IterVar.CommReduce in kinds[:-1] or len(kinds) < 2:
        return False
    n_var, k_var = stmt.iter_vars[-2].var, stmt.iter_vars[-1].var
    for region in stmt.reads:
        idx = [r.min for r in region.region]
        if len(idx) == 2 and idx[0].same_as(n_var) and idx[1].same_as(k_var):
            return True
    return False


def _static(extent) -> int | None:
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def schedule_nt_matmul(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """The scheduled function, or None when `func` is not an NT matmul this rule handles."""
    sch = s_tir.Schedule(func)
    block = _find_reduction(sch)
    if block is None or not _is_nt_matmul(sch, block):
        return None
    loops = sch.get_loops(block)
    iters = sch.get(block).iter_vars
    if len(loops) != len(iters):
        return None
    k_extent, n_extent = _static(iters[-1].dom.extent), _static(iters[-2].dom.extent)
    if k_extent is None or n_extent is None or n_extent % ROWS:
        return None
    while lanes > 1 and k_extent % lanes:
        lanes //= 2
    if lanes < 4:
        return None
    consumers = sch.get_consumers(block)
    *m_loops, n, k = loops
    m = sch.fuse(*m_loops) if len(m_loops) > 1 else m_loops[0]
    ko, ki = sch.split(k, [None, lanes])
    partial = sch.rfactor(ki, factor_axis=0)
    m, n, ko, ki = sch.get_loops(partial)
    no, ni = sch.split(n, [None, ROWS])
    sch.reorder(no, m, ko, ni, ki)
    sch.parallel(no)
    sch.unroll(ni)
    sch.vectorize(ki)
    sch.decompose_reduction(partial, ko)
    # The final sum over lanes and any fused epilogue (bias, residual add, cast) run per
    # (tile, row), so their buffers shrink to one tile instead of the whole output.
    sch.reverse_compute_at(block, m)
    for consumer in consumers:
        sch.reverse_compute_at(consumer, m)
    return sch.mod["main"]
