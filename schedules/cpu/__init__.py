"""CPU schedule rules (x86, and aarch64 NEON at 4 lanes).

Each rule returns a scheduled PrimFunc or None; a kernel no rule takes stays as
legalized (slow, never wrong). Kernels already scheduled elsewhere (the KV cache's
attention kernels ship their own) are left alone, except the KV cache's serial CPU prefill
and decode attention, full and sliding-window, which schedules/cpu/attention.py replaces by
parallel, vectorized kernels, and the window-freeing cache's inline-rope ones, which
schedules/cpu/rope_attention.py replaces the same way. Last, every kernel's float32 exp,
sigmoid and tanh become vector arithmetic (schedules/cpu/vector_math.py) instead of a libm
call per element.
"""
from __future__ import annotations

import tvm
from tvm import tirx

from vtool.schedules.cpu.attention import (rewrite_decode_paged, rewrite_decode_paged_sliding, rewrite_prefill_paged,
                                          rewrite_prefill_paged_sliding, rewrite_prefill_ragged, schedule_fused_rope)
from vtool.schedules.cpu.matmul import schedule_nt_matmul
from vtool.schedules.cpu.moe import schedule_moe_gemv
from vtool.schedules.cpu.quantized import schedule_quantized_matmul
from vtool.schedules.cpu.rescale_fix import fix_rescale_reads
from vtool.schedules.cpu.rope_attention import FREEING_SUFFIX, freeing_window, rewrite_inline_rope
from vtool.schedules.cpu.rowwise import schedule_rowwise
from vtool.schedules.cpu.sliding_attention import NAME as SLIDING_PREFILL, fix_sliding_prefill
from vtool.schedules.cpu.vector_math import vectorizable_math
from vtool.schedules.views import becomes_view

_OUT_ELEMWISE_FUSABLE = 4  # relax OpPatternKind: elementwise 0, broadcast 1, injective 2, reduce 3


def vector_lanes(target: tvm.target.Target) -> int:
    """float32 lanes of the widest vector unit the target may use."""
    mcpu = str(target.attrs.get("mcpu", ""))
    if mcpu in ("skylake-avx512", "cascadelake", "icelake-server", "sapphirerapids", "znver4", "znver5"):
        return 16
    if mcpu in ("haswell", "broadwell", "skylake", "znver2", "znver3"):
        return 8
    return 4


def cpu_schedule_pass() -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name="VtoolCPUSchedules")
    def _apply(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        target = tvm.target.Target.current()
        lanes = vector_lanes(target)
        updates = {}
        window = _freeing_window(mod)
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or func.attrs is None:
                continue
            fixed = fix_rescale_reads(func)  # TVM's serial attention kernels' out-of-bounds rescale
            if fixed is not None:
                func = updates[gv] = fixed
            # TVM's serial CPU prefill (ragged and paged) and decode attention
            rewritten = (rewrite_prefill_ragged(gv.name_hint, func) or rewrite_prefill_paged(gv.name_hint, func)
                         or rewrite_decode_paged(gv.name_hint, func) or schedule_fused_rope(func)
                         # the sliding-window layers' kernels (head dims of 16s; others keep TVM's,
                         # its prefill's mask fixed: it reads an unset maximum)
                         or rewrite_prefill_paged_sliding(gv.name_hint, func)
                         or rewrite_decode_paged_sliding(gv.name_hint, func)
                         or fix_sliding_prefill(gv.name_hint, func)
                         # the window-freeing cache's own kernels (inline rope): parallel ones that
                         # rotate (head dims of 16s), else TVM's with its prefill's fix
                         or (rewrite_inline_rope(gv.name_hint, func, window) if window else None)
                         or (fix_sliding_prefill(SLIDING_PREFILL, func)
                             if gv.name_hint == SLIDING_PREFILL + FREEING_SUFFIX else None))
            if rewritten is not None:
                updates[gv] = rewritten
                continue
            scheduled = (schedule_moe_gemv(func, lanes)  # the MoE gather-GEMV (models/moe.py)
                         or schedule_quantized_matmul(func, lanes))  # both found by their block names
            if scheduled is not None:
                updates[gv] = scheduled
                continue
            if "op_pattern" in func.attrs or gv.name_hint.startswith("fused_NT_matmul"):
                scheduled = schedule_nt_matmul(func, lanes)
                if scheduled is not None:
                    updates[gv] = scheduled
                    continue
            # elementwise chains and per-row reductions (op patterns up to out-elementwise
            # fusable; FuseTIR leaves some fused kernels without one), but never a reshape:
            # the lowering makes those views, which a scheduled one would not be
            if int(func.attrs.get("op_pattern", 0)) <= _OUT_ELEMWISE_FUSABLE and not becomes_view(func):
                scheduled = schedule_rowwise(func, lanes)
                if scheduled is not None:
                    updates[gv] = scheduled
        for gv, func in mod.functions_items():  # exp, sigmoid, tanh: every kernel, whoever scheduled it
            if isinstance(func, tirx.PrimFunc):
                rewritten = vectorizable_math(updates.get(gv, func))
                if rewritten is not None:
                    updates[gv] = rewritten
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return _apply


def _freeing_window(mod: tvm.IRModule) -> int | None:
    """The window of the module's window-freeing KV cache (models/window_cache.py), read from its
    sliding-window prefill kernel, or None when the module has no such cache."""
    for gv, func in mod.functions_items():
        if gv.name_hint == SLIDING_PREFILL + FREEING_SUFFIX and isinstance(func, tirx.PrimFunc):
            return freeing_window(func)
    return None


def schedule_pass() -> tvm.transform.Pass:
    """The rule set's entry point (vtool.schedules.rules_for)."""
    return cpu_schedule_pass()
