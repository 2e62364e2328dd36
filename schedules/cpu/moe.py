"""CPU schedule for the mixture-of-experts gather-GEMV (models/moe.py gather_gemv, block "moe_gemv"):

    out[t, j, n] = sum_c x[t, j or 0, c] * W[idx[t, j], n, c]

The expert is a load from idx inside the weight's index, so only the chosen experts' rows are
read. As schedules/cpu/matmul.py does for the dense GEMV: the reduction over c is split into
vector lanes and rfactored (a contiguous vector multiply-add over x's row and W's row), output
rows are taken ROWS at a time, and the (token, chosen expert, row tile) loop is spread over
threads. A reduction length no lane count divides (an odd expert size) stays a scalar loop,
still parallel over rows. The router kernel ("moe_route", a few dozen flops per token) stays
as written.
"""
from __future__ import annotations

from tvm import s_tir, tirx

GEMV_BLOCK = "moe_gemv"  # models/moe.py's name for it (schedules/ does not import models/)
ROWS = 4


def schedule_moe_gemv(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """`func` scheduled, or None when it is not a MoE gather-GEMV."""
    try:
        sch = s_tir.Schedule(func)
        block = sch.get_sblock(GEMV_BLOCK)
    except Exception:  # noqa: BLE001 - no such block: another kernel
        return None
    t, j, n, c = sch.get_loops(block)
    iters = sch.get(block).iter_vars
    k_extent, n_extent = iters[-1].dom.extent, iters[-2].dom.extent
    if not isinstance(k_extent, tirx.IntImm) or not isinstance(n_extent, tirx.IntImm):
        return None
    k_extent, n_extent = int(k_extent), int(n_extent)
    while lanes > 1 and k_extent % lanes:
        lanes //= 2
    rows = ROWS if n_extent % ROWS == 0 else 1
    if lanes >= 4:
        _, ci = sch.split(c, [None, lanes])
        partial = sch.rfactor(ci, factor_axis=0)
        t, j, n, co, ci = sch.get_loops(partial)
        no, ni = sch.split(n, [None, rows])
        sch.reorder(t, j, no, co, ni, ci)
        outer = sch.fuse(t, j, no)
        sch.parallel(outer)
        sch.unroll(ni)
        sch.vectorize(ci)
        sch.decompose_reduction(partial, co)
        sch.reverse_compute_at(block, outer)
    else:
        no, ni = sch.split(n, [None, rows])
        sch.reorder(t, j, no, c, ni)
        outer = sch.fuse(t, j, no)
        sch.parallel(outer)
        sch.unroll(ni)
        sch.decompose_reduction(block, c)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
