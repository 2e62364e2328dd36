"""CUDA schedule rules: TVM's DLight GPU rules, plus a low-batch dispatch for GEMV-shaped kernels.

The order follows MLC-LLM's CUDA pipeline. First, every matmul kernel whose only symbolic
dimension is the batch (batch_decode) or the prompt length (prefill) is compiled three
ways in one PrimFunc and picks one at run time:

    n <= 2: LowBatchGEMV(bucket 2)   n <= 8: LowBatchGEMV(bucket 4)   else: Matmul

(DLight's plain Matmul rule runs a small batch at a few percent of bandwidth.) Then
ApplyDefaultSchedule tries, per kernel, Matmul, GEMV, Reduction, GeneralReduction and
Fallback, first match wins. Fallback takes any kernel, so nothing reaches codegen
unscheduled. Kernels that arrive scheduled (the KV cache's attention kernels, the
sampling/sort kernels) are left alone.

The models accumulate every matmul in float32 and cast afterwards. After FuseOps the
cast is an epilogue block of the matmul kernel, and the rules keep it there.
"""
from __future__ import annotations

from vtool.schedules.cuda.tensor_intrinsics import preload_tensor_intrinsics

preload_tensor_intrinsics()  # before anything imports tvm.s_tir.tensor_intrin the slow way

import tvm  # noqa: E402
from tvm import s_tir, tirx  # noqa: E402
from tvm.s_tir import dlight as dl  # noqa: E402

from tvm.s_tir.dlight.gpu.base import GPUScheduleRule  # noqa: E402

from vtool.schedules.cuda.bf16_tensorcore import schedule_bf16_matmul  # noqa: E402
from vtool.schedules.cuda.dequantize import schedule_dequantize  # noqa: E402
from vtool.schedules.cuda.moe import schedule_moe  # noqa: E402
from vtool.schedules.cuda.quantized import schedule_quantized  # noqa: E402

# Upper batch limit (inclusive) of each LowBatchGEMV bucket, in dispatch order.
LOW_BATCH_BUCKETS: tuple[tuple[int, int], ...] = ((2, 2), (8, 4))  # (n <= limit, bucket)
DEFAULT_RULES = ("Matmul", "GEMV", "Reduction", "GeneralReduction", "Fallback")


def describe() -> dict:
    """What the manifest records about the schedules."""
    return {"quantized": "GGUF-block matmuls: a GEMV up to 8 rows of x, else dlight Matmul (schedules/cuda/quantized.py)",
            "dequantize": "prompts' whole-weight dequantization: 16-byte stores in block order (schedules/cuda/dequantize.py)",
            "low_batch_dispatch": [{"max_n": limit, "rule": f"LowBatchGEMV({bucket})"} for limit, bucket in LOW_BATCH_BUCKETS]
            + [{"rule": "bf16 WMMA tensor cores, else Matmul"}],
            "default_rules": ["vtool.LogitEdits", "vtool.DraftChain", "vtool.BF16TensorCoreMatmul", "vtool.RowReduction"]
            + [f"dlight.gpu.{r}" if r != "GEMV" else "vtool.GuardedGEMV" for r in DEFAULT_RULES]}


def _is_scheduled(func: tirx.PrimFunc) -> bool:
    return func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled", False))


def _one_schedule(space) -> s_tir.Schedule | None:
    if space is None:
        return None
    if isinstance(space, (list, tuple)):
        return space[0] if len(space) == 1 else None
    return space


def _symbolic_vars(func: tirx.PrimFunc) -> list[tirx.Var]:
    seen: dict[str, tirx.Var] = {}
    for param in func.params:  # TVM 0.27: buffer parameters carry their shape
        for dim in getattr(param, "shape", None) or ():
            if isinstance(dim, tirx.Var):
                seen.setdefault(dim.name, dim)
    return list(seen.values())


def low_batch_dispatch(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """One PrimFunc holding the bucketed LowBatchGEMV schedules and the Matmul schedule,
    chosen by the symbolic dimension at run time; None when the kernel is not a
    low-batch GEMV over one symbolic dimension."""
    if _is_scheduled(func):
        return None
    sym = _symbolic_vars(func)
    if len(sym) != 1:
        return None
    variants = []
    for _limit, bucket in LOW_BATCH_BUCKETS:
        sch = _one_schedule(dl.gpu.LowBatchGEMV(bucket).apply(func, target, False))
        if sch is None:
            return None
        variants.append(sch.mod["main"])
    general = schedule_bf16_matmul(func, target) or _one_schedule(dl.gpu.Matmul().apply(func, target, False))
    if general is None:
        return None
    (n,) = sym
    body = general.mod["main"].body
    for (limit, _bucket), variant in reversed(list(zip(LOW_BATCH_BUCKETS, variants))):
        cond = tirx.op.tvm_thread_invariant(n <= limit)
        body = tirx.IfThenElse(cond, variant.body, body)
    root = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", body))
    return (func.with_body(root)
            .with_attr("tirx.is_scheduled", True)
            .with_attr("tirx.HoistIfThenElseExprWithBlock", 1))


class BF16TensorCoreMatmul(GPUScheduleRule):
    """bf16 matmuls on tensor cores (bf16_tensorcore.py), ahead of DLight's SIMT Matmul."""

    def apply(self, func, target, tunable):  # noqa: ANN001 - DLight's rule signature
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        return schedule_bf16_matmul(func, target)


def cuda_schedule_pass() -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name="VtoolCUDALowBatchDispatch")
    def _low_batch(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc):
                target = func.attrs.get("target") if func.attrs is not None else None
                # the MoE and GGUF-block kernels (models/moe.py, models/quantized_linear.py: the
                # matmuls and the prompts' whole-weight dequantization) by block name, then
                # GEMV-shaped kernels
                target = target or tvm.target.Target.current()
                scheduled = (schedule_moe(func) or schedule_dequantize(func) or schedule_quantized(func, target)
                             or low_batch_dispatch(func, target))
                if scheduled is not None:
                    updates[gv] = scheduled
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    from vtool.schedules.cuda.draft_chain import DraftChain
    from vtool.schedules.cuda.logit_edits import LogitEdits
    from vtool.schedules.cuda.sampling_rules import GuardedGEMV, RowReduction

    # RowReduction: the sampler's per-row reductions (one block per row instead of
    # Fallback's one thread); GuardedGEMV: DLight's GEMV minus an assert that would end the
    # build on those kernels (sampling_rules.py says which).
    rules = ([LogitEdits(), DraftChain(), BF16TensorCoreMatmul(), RowReduction()]
             + [GuardedGEMV() if name == "GEMV" else getattr(dl.gpu, name)() for name in DEFAULT_RULES])
    return tvm.transform.Sequential([_low_batch, dl.ApplyDefaultSchedule(*rules)], name="VtoolCUDASchedules")


def schedule_pass() -> tvm.transform.Pass:
    """The rule set's entry point (vtool.schedules.rules_for); cuda_schedule_pass is looked
    up when called, so a test may put its own in place."""
    return cuda_schedule_pass()
