"""CPU schedule for row-wise kernels: elementwise chains (silu * mul, residual adds, casts)
and per-row reductions (RMSNorm), over [..., rows, features].

Legalized, these are serial scalar loops: at 128 tokens the default model's silu * mul
took 559 us and its RMSNorm 77 us under no schedule, where MetaSchedule found 250 and 9 us.
Here the same-shape elementwise blocks are inlined into the output block; its leading
loops are fused into one row loop spread over threads, and its feature loop is vectorized.
Per-row blocks (an RMSNorm's sum of squares and its rsqrt) are computed inside the row
loop; in a single-threaded kernel (a decode step's) the reduction runs as `lanes`
interleaved partial sums (rfactor) added at the end. Elementwise results are the
unscheduled kernel's bit for bit; a reduction's may move in the last bits (FMA
contraction of the inlined square; the partial sums' order).
"""
from __future__ import annotations

from tvm import s_tir, tirx

_SPATIAL = int(tirx.IterVar.DataPar)
# Below this many output elements a static kernel runs on one thread: waking the pool
# costs about a microsecond, more than a decode step's 576-wide RMSNorm or add takes.
PARALLEL_MIN_ELEMENTS = 1 << 15


def _write_ndim(sch: s_tir.Schedule, block: s_tir.SBlockRV) -> int:
    writes = sch.get(block).writes
    return len(writes[0].region) if len(writes) == 1 else -1


def _spatial(sch: s_tir.Schedule, block: s_tir.SBlockRV) -> bool:
    return all(int(iv.iter_type) == _SPATIAL for iv in sch.get(block).iter_vars)


def _vectorize_reduction(sch: s_tir.Schedule, block: s_tir.SBlockRV, lanes: int) -> None:
    """Sum a row in `lanes` interleaved partial sums, a vector add per step, then add the
    partials (rfactor): about 5x faster than the serial sum on a 576-wide RMSNorm. The order
    of the additions changes, so the result moves in the last bits. A reduction that does
    not split evenly stays serial."""
    k = sch.get_loops(block)[-1]
    extent = sch.get(k).extent
    if not isinstance(extent, tirx.IntImm) or int(extent) % lanes or int(extent) < 2 * lanes:
        return
    try:
        _, ki = sch.split(k, [None, lanes])
        partial = sch.rfactor(ki, factor_axis=0)
        *_, ko, ki = sch.get_loops(partial)
        sch.vectorize(ki)
        sch.decompose_reduction(partial, ko)
    except Exception:  # noqa: BLE001 - left as split: still correct, serial
        return


def schedule_rowwise(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """`func` scheduled, or None when it is not a row-wise kernel this rule knows."""
    try:
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except Exception:  # noqa: BLE001 - no root block: a hand-written kernel
        return None
    if not blocks or len(sch.get(blocks[-1]).writes) != 1:
        return None
    out_ndim = _write_ndim(sch, blocks[-1])
    if out_ndim < 2 or not _spatial(sch, blocks[-1]):
        return None
    try:
        for block in blocks[:-1]:  # same-shape elementwise producers: computed where used
            if _spatial(sch, block) and _write_ndim(sch, block) == out_ndim:
                sch.compute_inline(block)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        out = blocks[-1]
        loops = sch.get_loops(out)
        if len(loops) != out_ndim:
            return None
        row = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
        features = sch.get(loops[-1]).extent
        rows = sch.get(row).extent
        # a decode step's small static kernels stay on one thread
        static = isinstance(rows, tirx.IntImm) and isinstance(features, tirx.IntImm)
        parallel = not static or int(rows) * int(features) >= PARALLEL_MIN_ELEMENTS
        for block in reversed(blocks[:-1]):  # per-row producers (sum of squares, rsqrt)
            if _write_ndim(sch, block) == out_ndim - 1:
                sch.compute_at(block, row, preserve_unit_loops=True)
                if not parallel and not _spatial(sch, block):
                    # (inside a parallel loop the partial sums' buffer becomes a workspace
                    # allocation per row: a 128-row RMSNorm took 3.8 ms that way)
                    _vectorize_reduction(sch, block, lanes)
        if parallel:
            sch.parallel(row)
        if isinstance(features, tirx.IntImm) and int(features) % lanes == 0 and int(features) >= lanes:
            _, vec = sch.split(loops[-1], [None, lanes])
            sch.vectorize(vec)
        return sch.mod["main"]
    except Exception:  # noqa: BLE001 - a shape this rule does not fit stays unscheduled
        return None
