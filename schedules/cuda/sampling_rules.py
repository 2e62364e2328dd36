"""CUDA schedule rules for the sampling kernels (schedules/cuda/sampler.py): per-row reductions.

The sampler's kernels reduce each row of a [batch, vocab] tensor, often reading per-row
scalars too (the row's maximum, threshold or target: `count(cdf <= u * total)`). Two
DLight rules do not handle them:

- dlight.gpu.GEMV takes such a kernel for a GEMV (one operand does not depend on the
  reduction axis) and then fails `assert s_loops` in its normalize step, because the batch
  axis indexes every buffer. ApplyDefaultSchedule does not catch that, so the whole build
  fails. GuardedGEMV turns the assertion into "not mine".
- dlight.gpu.Reduction takes only sum-like reductions, and GeneralReduction needs an
  injective last block, so a plain max/min/argmax over a row goes to Fallback: one thread
  runs the whole 128K-long row serially.

RowReduction takes a kernel that is one reduction block (after inlining its elementwise
producers) whose reads all lie in the output's own row, and schedules it as one thread
block per row: 256 threads stride the row (coalesced), then a cross-thread reduction. It
leaves GEMV/matmul kernels alone (their weight operand does not depend on the batch
axis), and multi-block kernels (a reduction plus an epilogue) to GeneralReduction.

Wiring (schedules/cuda/__init__.py, cuda_schedule_pass): put RowReduction() before the
DLight rules and GuardedGEMV() in place of dl.gpu.GEMV():

    rules = ([BF16TensorCoreMatmul(), RowReduction()]
             + [GuardedGEMV() if name == "GEMV" else getattr(dl.gpu, name)() for name in DEFAULT_RULES])
"""
from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

THREADS = 256
UNROLL = 256


def _vars_in(expr) -> set:  # noqa: ANN001 - a PrimExpr
    found = set()
    tvm_ffi.structural_walk(expr, (tirx.Var, found.add), order="post")
    return found


class GuardedGEMV(GPUScheduleRule):
    """dl.gpu.GEMV, answering None where it would assert (a row reduction that reads a
    per-row vector: GEMV's normalize finds no spatial loop besides the batch)."""

    def __init__(self) -> None:
        self._gemv = dl.gpu.GEMV()

    def apply(self, func, target, tunable):  # noqa: ANN001 - DLight's rule signature
        try:
            return self._gemv.apply(func, target, tunable)
        except AssertionError:
            return None


class RowReduction(GPUScheduleRule):
    """One reduction block reducing along its own row: blockIdx.x per output element,
    THREADS threads striding the reduced axis, a cross-thread reduction to finish."""

    def apply(self, func, target, _tunable):  # noqa: ANN001 - DLight's rule signature
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            sch = s_tir.Schedule(func)
            infos = normalize_prim_func(sch)
            if infos is None:
                return None
            infos = try_inline_contiguous_spatial(sch, infos)
        except (RuntimeError, ValueError, AssertionError):  # not a kernel DLight can analyse (TVM raises RuntimeError kinds)
            return None
        if infos is None or len(infos) != 1:
            return None
        info = infos[0]
        kinds = info.dom_kind()
        n_s = len(kinds) - len(kinds.lstrip("S"))
        if n_s == 0 or kinds[n_s:] != "R" * (len(kinds) - n_s) or n_s == len(kinds):
            return None
        block = sch.get(info.block_rv)
        spatial = {iv.var for iv, kind in zip(block.iter_vars, kinds) if kind == "S"
                   and not (isinstance(iv.dom.extent, tirx.IntImm) and iv.dom.extent.value == 1)}
        # Every read must stay in the output element's row: indexed by every non-unit
        # spatial iterator (a matmul's weight is not, and stays GEMV's/Matmul's), or by
        # no reduction iterator (a scalar per output element, such as a row's maximum
        # read by each of the row's chunks).
        iters = {iv.var for iv in block.iter_vars}
        reduced = {iv.var for iv, kind in zip(block.iter_vars, kinds) if kind == "R"}
        for region in block.reads:
            used = set()
            for rng in region.region:
                used |= _vars_in(rng.min)
            used &= iters
            if used and not spatial <= used and used & reduced:
                return None
        loops = sch.get_loops(info.block_rv)
        bx = sch.fuse(*loops[:n_s])
        r = sch.fuse(*loops[n_s:])
        r, tx = sch.split(r, [None, THREADS])
        sch.reorder(tx, r)
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        sch.annotate(r, ann_key="pragma_auto_unroll_max_step", ann_val=UNROLL)
        sch.annotate(r, ann_key="pragma_unroll_explicit", ann_val=1)
        return sch
