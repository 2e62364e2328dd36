"""CPU schedule for `C[m.., n] = sum_k A[m.., k] * W[n, k]` kernels (plus fused epilogues).

This covers the decode GEMVs (m = 1) and the prefill GEMMs (m = sequence length) that
FuseTransposeMatmul produces, with two schedules:

* Few rows (`_schedule_rows`): the reduction over k is split into vector lanes and
  rfactored, so the inner loop is a contiguous vector multiply-add over both A's row and
  W's row; output rows are tiled in groups of ROWS and spread over threads, and each tile
  of W stays in L1 while every row of A passes over it. DLight's CPU GEMV rule was slower
  than no schedule at all on this shape (see the TVM notes); this one is not. Its inner
  loop loads a vector of W for every multiply-add, so past a few rows it is load-bound:
  about half of what a BLAS gets from the same cores.
* Many rows (`_schedule_gemm`, GEMM_MIN_ROWS and more): a register-tiled micro-kernel, as
  BLAS libraries have it. W's rows are packed, per thread, into panels of `vectors` x lanes
  outputs by KB inputs laid out k-major (one panel, 16-36 KB, in L1); each tile of `rows` rows
  of A then keeps rows x vectors vectors of sums in registers and per k does `rows` broadcasts
  of A, `vectors` vector loads of the panel and rows x vectors multiply-adds. The tile is 8 x 3
  on AVX-512 where the outputs are a multiple of 48 (24 sums: only 32 registers hold them), 6 x 2
  otherwise (`micro_tiles`). Rows go in blocks of BLOCK_ROWS that stay in L2 while every panel
  passes over them (each panel packed again per block: cheap next to the block's sums). The
  rows are padded to a multiple of the tile's (a copy of A, zeros past the end) so the tile
  needs no bounds check, and the result is cropped into C, the fused epilogue applied per row of
  the crop. Measured on the 2-core Xeon (AVX-512) at 455 x 2304 x 768: 245 GFLOP/s with 6 x 2
  tiles, 266-311 with 8 x 3, against OpenBLAS's 285-300 in the same run and the row schedule's
  140 (tests/bench/cpu_gemm.py). Its sums stay in registers only with every kernel of the
  library noalias (schedules/cpu/noalias.py).

A kernel with static rows gets the schedule for its size. One whose rows are a symbolic size
(a decoder's prompt chunk, a batch) gets both under one root block, chosen per call by the
row count. Where only one schedule fits, it takes every size: the row schedule cannot fuse
two symbolic leading dims, so an encoder's [batch, length] projections (which ran
unscheduled, serial scalar loops, before) take the micro-kernel.
"""
from __future__ import annotations

import dataclasses

from tvm import s_tir, sym, tirx
from tvm.s_tir.stmt import SBlock, SBlockRealize

ROWS = 4  # output features per inner tile: 4 rows of W in flight hide load latency
GEMM_MIN_ROWS = 32  # rows of A from which the micro-kernel wins (symbolic rows, 16: 0.8x the row schedule; 64: 1.3x)


@dataclasses.dataclass(frozen=True)
class MicroTile:
    """One micro-kernel shape: `rows` rows of A by `vectors` vectors of outputs, their sums in
    registers (rows x vectors of them, plus the panel's vectors and a broadcast), and the
    inputs per packed panel to try (the first that divides k; panels of 16-36 KB stay in L1)."""

    rows: int
    vectors: int
    kb_choices: tuple[int, ...]


# Tried in order, the first whose panel (vectors x lanes outputs) divides the outputs. 8 x 3
# needs 24 sums + 3 panel vectors + a broadcast: only AVX-512's 32 registers hold them (16 lanes);
# AVX2 has 16, so 6 x 2 (15 in use) is its only tile. On the 2-core Xeon, 8 x 3 against 6 x 2:
# 455 x 768 x 2304 266-311 against 250-262 GFLOP/s, the down projections (k = 1536) 219-240
# against 197-224, the other prompt shapes of SmolLM2 and MiniLM within -2..+11%
# (tests/bench/cpu_gemm.py; BENCHMARKS.md).
TILES_AVX512 = (MicroTile(8, 3, (128, 96, 64, 192)), MicroTile(6, 2, (128, 192, 256, 96, 64)))
TILES = (MicroTile(6, 2, (128, 192, 256, 96, 64)),)
# rows per block of A that every panel passes over before the next block: 384 rows x 768 inputs
# (1.2 MB) stay in L2; without blocks A streamed from L3 once per panel (1820 rows: 183-192
# GFLOP/s, with them 233; 455 rows 251 -> 247)
BLOCK_ROWS = 384


def micro_tiles(lanes: int) -> tuple[MicroTile, ...]:
    """The micro-kernel shapes a target of this many float32 lanes can hold in its registers."""
    return TILES_AVX512 if lanes >= 16 else TILES


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
    return _weight_read(stmt) is not None


def _static(extent) -> int | None:
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def schedule_nt_matmul(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """The scheduled function, or None when `func` is not an NT matmul this rule handles."""
    few = _schedule_rows(func, lanes)
    many = _schedule_gemm(func, lanes)
    if few is None or many is None:  # one fits (or neither: not an NT matmul)
        return few or many
    rows = _rows(func)
    if isinstance(rows, tirx.IntImm):
        return many if int(rows) >= GEMM_MIN_ROWS else few
    # symbolic rows (a prompt chunk, a batch): both bodies under one root block, chosen per call
    # by the row count. Where they share a variable (blocks neither schedule rewrote, defined in
    # both branches: TIR wants each defined once), the row schedule alone, as before.
    both = _either(func, rows >= GEMM_MIN_ROWS, many, few)
    return both if tirx.analysis.verify_ssa(both) else few


def _either(func: tirx.PrimFunc, cond: tirx.PrimExpr, then: tirx.PrimFunc, other: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` whose body runs `then`'s body where `cond` holds, else `other`'s (both scheduled
    from `func`: the same parameters), inside one root block holding both roots' buffers."""
    a, b = then.body.block, other.body.block
    buffers = list(a.alloc_buffers) + [x for x in b.alloc_buffers if not any(x.same_as(y) for y in a.alloc_buffers)]
    root = SBlock([], [], [], "root", tirx.IfThenElse(cond, a.body, b.body), alloc_buffers=buffers)
    return func.with_body(SBlockRealize([], True, root))


def _rows(func: tirx.PrimFunc) -> tirx.PrimExpr:
    """The number of rows of A: the product of the matmul's spatial extents but the last."""
    sch = s_tir.Schedule(func)
    rows = tirx.const(1, "int64")
    for iv in sch.get(_find_reduction(sch)).iter_vars[:-2]:
        rows = rows * iv.dom.extent.astype("int64")
    return sym.Analyzer().simplify(rows)


def _schedule_gemm(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """The micro-kernel schedule (module docstring), or None where its shape does not fit:
    fewer than 4 lanes, outputs not a multiple of a panel, inputs not a multiple of lanes."""
    if lanes < 4:
        return None
    try:
        sch = s_tir.Schedule(func)
        block = _find_reduction(sch)
        if block is None or not _is_nt_matmul(sch, block):
            return None
        stmt = sch.get(block)
        iters = stmt.iter_vars
        k_extent, n_extent = _static(iters[-1].dom.extent), _static(iters[-2].dom.extent)
        if k_extent is None or n_extent is None or k_extent % lanes or len(iters) < 3:
            return None
        tile = next((t for t in micro_tiles(lanes) if n_extent % (t.vectors * lanes) == 0), None)
        if tile is None:
            return None
        panel = tile.vectors * lanes
        kb = next((c for c in tile.kb_choices if k_extent % c == 0), k_extent)
        w_index = _weight_read(stmt)  # not None: _is_nt_matmul
        consumers = _epilogue(sch, block)
        before = {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}
        # the rows: the last leading dim that is not 1 ([1, seq] for a prompt, [batch, 1] for a
        # batched decode step), padded to whole tiles (a zero-filled copy of A, C cropped after)
        lead_iters = iters[:-2]
        row_dim = max((i for i, iv in enumerate(lead_iters) if _static(iv.dom.extent) != 1), default=len(lead_iters) - 1)
        sch.pad_einsum(block, [tile.rows if i == row_dim else 1 for i in range(len(lead_iters))] + [1, 1])
        copies = [b for b in sch.get_child_blocks(sch.get_sblock("root")) if sch.get(b).name_hint not in before]
        *lead, n, k = sch.get_loops(block)
        rows_loop = lead.pop(row_dim)
        mo, mi = sch.split(rows_loop, [None, tile.rows])
        mbo, mbi = sch.split(mo, [None, max(1, BLOCK_ROWS // tile.rows)])
        no, ni = sch.split(n, [None, panel])
        nio, nii = sch.split(ni, [None, lanes])
        ko, ki = sch.split(k, [None, kb])
        sch.reorder(*lead, mbo, no, ko, mbi, ki, mi, nio, nii)
        packed = sch.cache_read(block, w_index, "global")  # W's panel, k-major, per (panel, k block)
        sch.transform_layout(packed, ("write", 0), lambda r, c: (r // panel, c, r % panel))
        sch.compute_at(packed, ko)
        sch.vectorize(nii)
        sch.unroll(nio)
        sch.unroll(mi)
        sch.parallel(no)
        init = sch.decompose_reduction(block, ko)
        _vector_rows(sch, init, lanes, parallel=False)
        # the copy of A: rows over threads, vectors over columns (none when the rows are a
        # static multiple of the tile: nothing padded, nothing cropped)
        crop = next((c for c in copies if any(sch.get(c).same_as(sch.get(x)) for x in sch.get_consumers(block))),
                    None)
        for copy in copies:
            if crop is None or not sch.get(copy).same_as(sch.get(crop)):
                _vector_rows(sch, copy, lanes, parallel=True)
        # the crop's rows over threads (or the first epilogue block's), and the epilogue (bias,
        # residual add, GELU...) computed per row after it, in program order, each in vectors
        chain = ([crop] if crop is not None else []) + consumers
        if chain:
            *outer, _ = sch.get_loops(chain[0])
            row = sch.fuse(*outer) if len(outer) > 1 else outer[0]
            sch.parallel(row)
            for consumer in chain[1:]:
                sch.reverse_compute_at(consumer, row)
            for b in chain:
                _vector_rows(sch, b, lanes, parallel=False)
        return sch.mod["main"]
    except Exception:  # noqa: BLE001 - a shape or fusion this schedule does not fit: the row schedule
        return None


def _epilogue(sch: s_tir.Schedule, block: s_tir.SBlockRV) -> list[s_tir.SBlockRV]:
    """The blocks after the matmul that depend on it (a bias add, a GELU's several blocks, a
    residual add), in program order, which is an order in which each comes after its
    producers. Each schedule moves every one of them into its row loop; one left at the root
    would run serially, and, sitting in both bodies of a run-time choice, break it."""
    root = sch.get_child_blocks(sch.get_sblock("root"))
    after = False
    seen = [sch.get(block)]
    chain = []
    for b in root:
        stmt = sch.get(b)
        if stmt.same_as(seen[0]):
            after = True
            continue
        if after and any(sch.get(p).same_as(x) for p in sch.get_producers(b) for x in seen):
            chain.append(b)
            seen.append(stmt)
    return chain


def _weight_read(stmt: tirx.SBlock) -> int | None:
    """The index of W among the block's reads (the 2-D operand read as [n, k]), or None."""
    n_var, k_var = stmt.iter_vars[-2].var, stmt.iter_vars[-1].var
    for i, region in enumerate(stmt.reads):
        idx = [r.min for r in region.region]
        if len(idx) == 2 and idx[0].same_as(n_var) and idx[1].same_as(k_var):
            return i
    return None


def _vector_rows(sch: s_tir.Schedule, block: s_tir.SBlockRV, lanes: int, parallel: bool) -> None:
    """A copy-like block's loops: the outer ones fused (over threads if `parallel`), the last in vectors."""
    *outer, last = sch.get_loops(block)
    extent = sch.get(last).extent
    if isinstance(extent, tirx.IntImm) and int(extent) % lanes == 0:
        _, vec = sch.split(last, [None, lanes])
        sch.vectorize(vec)
    if parallel and outer:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])


def _schedule_rows(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """The few-rows schedule (module docstring), or None when `func` is not an NT matmul it handles."""
    try:
        return _rows_schedule(func, lanes)
    except Exception:  # noqa: BLE001 - e.g. an epilogue over two symbolic leading dims: left unscheduled
        return None


def _rows_schedule(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
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
    consumers = _epilogue(sch, block)
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
