"""Per-request logit edits on the device: logit_bias, min_tokens masking and the repetition,
frequency and presence penalties, applied to a batch's logits before the draw, as the host
sampler's SequenceSampler.process_logits applies them (runtime/sampling/host.py), so such
requests sample on the device too instead of sending every logits row of the batch to the host.

The host sends four lists of edits, one per kind, each a flat position row * V + token (unique
within its list; -1: padding, skipped) with its values, and the kernel applies them in the
host's order, each in the host's float32 arithmetic:

    bias        v + bias                                  (logit_bias)
    mask        -inf                                      (eos / stop ids under min_tokens)
    repetition  v / r if v > 0 else v * r                 (prompt and output tokens)
    penalty     (v - frequency * count) - presence        (output tokens; the product on the host)

One PrimFunc: the logits copied into the output (the drawn token's logprob is the raw row's, read
from the input afterwards), then one loop over each list. On CUDA the LogitEdits rule puts the
same function scheduled in its place (one thread an element or an edit: five kernels, in order on
the stream); on the CPU its loops run as written (tests build it there).
"""
from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.script import tirx as T

BLOCK_PREFIX = "sampler_logit_edit_"
KINDS = ("bias", "mask", "repetition", "penalty")
THREADS = 256
COPY_VECTOR = 4


def _edit_macros(V: int):  # noqa: ANN202 - TVMScript macros
    """The four edits of one list entry `ve` on the output y (a no-op for a -1 padding entry),
    shared by the plain and the scheduled function."""
    minus_inf = T.float32(float("-inf"))

    @T.macro
    def bias_edit(y, at, bias, ve):
        if at[ve] >= T.int64(0):
            y[at[ve] // V, at[ve] % V] = y[at[ve] // V, at[ve] % V] + bias[ve]

    @T.macro
    def mask_edit(y, at, ve):
        if at[ve] >= T.int64(0):
            y[at[ve] // V, at[ve] % V] = minus_inf

    @T.macro
    def repetition_edit(y, at, rep, ve):
        if at[ve] >= T.int64(0):
            y[at[ve] // V, at[ve] % V] = T.if_then_else(y[at[ve] // V, at[ve] % V] > T.float32(0),
                                                        y[at[ve] // V, at[ve] % V] / rep[ve],
                                                        y[at[ve] // V, at[ve] % V] * rep[ve])

    @T.macro
    def penalty_edit(y, at, freq, pres, ve):
        if at[ve] >= T.int64(0):
            y[at[ve] // V, at[ve] % V] = (y[at[ve] // V, at[ve] % V] - freq[ve]) - pres[ve]

    return bias_edit, mask_edit, repetition_edit, penalty_edit


def logit_edits_func(vocab: int) -> tirx.PrimFunc:
    """edits(logits f32[b, V], bias_at i64[n1], bias f32[n1], mask_at i64[n2], rep_at i64[n3],
    rep f32[n3], pen_at i64[n4], frequency f32[n4], presence f32[n4]) -> f32[b, V]."""
    V = vocab
    bias_edit, mask_edit, repetition_edit, penalty_edit = _edit_macros(V)

    @T.prim_func(s_tir=True)
    def edits(x_h: T.handle, bias_at_h: T.handle, bias_h: T.handle, mask_at_h: T.handle, rep_at_h: T.handle,
              rep_h: T.handle, pen_at_h: T.handle, freq_h: T.handle, pres_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        b = T.int64()
        n1 = T.int64()
        n2 = T.int64()
        n3 = T.int64()
        n4 = T.int64()
        x = T.match_buffer(x_h, (b, V), "float32")
        bias_at = T.match_buffer(bias_at_h, (n1,), "int64")
        bias = T.match_buffer(bias_h, (n1,), "float32")
        mask_at = T.match_buffer(mask_at_h, (n2,), "int64")
        rep_at = T.match_buffer(rep_at_h, (n3,), "int64")
        rep = T.match_buffer(rep_h, (n3,), "float32")
        pen_at = T.match_buffer(pen_at_h, (n4,), "int64")
        freq = T.match_buffer(freq_h, (n4,), "float32")
        pres = T.match_buffer(pres_h, (n4,), "float32")
        y = T.match_buffer(y_h, (b, V), "float32")
        for i, j in T.grid(b, V):
            with T.sblock("sampler_logit_edit_copy"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj]
        for e in range(n1):
            with T.sblock("sampler_logit_edit_bias"):
                ve = T.axis.spatial(n1, e)
                T.reads(bias_at[ve], bias[ve], y[0:b, 0:V])
                T.writes(y[0:b, 0:V])
                bias_edit(y, bias_at, bias, ve)
        for e in range(n2):
            with T.sblock("sampler_logit_edit_mask"):
                ve = T.axis.spatial(n2, e)
                T.reads(mask_at[ve])
                T.writes(y[0:b, 0:V])
                mask_edit(y, mask_at, ve)
        for e in range(n3):
            with T.sblock("sampler_logit_edit_repetition"):
                ve = T.axis.spatial(n3, e)
                T.reads(rep_at[ve], rep[ve], y[0:b, 0:V])
                T.writes(y[0:b, 0:V])
                repetition_edit(y, rep_at, rep, ve)
        for e in range(n4):
            with T.sblock("sampler_logit_edit_penalty"):
                ve = T.axis.spatial(n4, e)
                T.reads(pen_at[ve], freq[ve], pres[ve], y[0:b, 0:V])
                T.writes(y[0:b, 0:V])
                penalty_edit(y, pen_at, freq, pres, ve)

    return edits


def logit_edits_gpu_func(vocab: int) -> tirx.PrimFunc:
    """logit_edits_func scheduled for CUDA: the copy THREADS threads a block (COPY_VECTOR floats a
    thread where rows are whole vectors), then each list one edit a thread. Written scheduled: the
    scatter loops write the output that the copy wrote, which TIR's bind refuses to schedule."""
    V = vocab
    vec = COPY_VECTOR if V % COPY_VECTOR == 0 else 1
    bias_edit, mask_edit, repetition_edit, penalty_edit = _edit_macros(V)

    @T.prim_func(s_tir=True)
    def edits(x_h: T.handle, bias_at_h: T.handle, bias_h: T.handle, mask_at_h: T.handle, rep_at_h: T.handle,
              rep_h: T.handle, pen_at_h: T.handle, freq_h: T.handle, pres_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        b = T.int64()
        n1 = T.int64()
        n2 = T.int64()
        n3 = T.int64()
        n4 = T.int64()
        x = T.match_buffer(x_h, (b, V), "float32")
        bias_at = T.match_buffer(bias_at_h, (n1,), "int64")
        bias = T.match_buffer(bias_h, (n1,), "float32")
        mask_at = T.match_buffer(mask_at_h, (n2,), "int64")
        rep_at = T.match_buffer(rep_at_h, (n3,), "int64")
        rep = T.match_buffer(rep_h, (n3,), "float32")
        pen_at = T.match_buffer(pen_at_h, (n4,), "int64")
        freq = T.match_buffer(freq_h, (n4,), "float32")
        pres = T.match_buffer(pres_h, (n4,), "float32")
        y = T.match_buffer(y_h, (b, V), "float32")
        for bx in T.thread_binding(T.ceildiv(b * V, THREADS * vec), thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                for k in T.vectorized(vec):
                    with T.sblock("sampler_logit_edit_copy"):
                        at = T.axis.spatial(b * V, (bx * THREADS + tx) * vec + k)
                        T.where((bx * THREADS + tx) * vec + k < b * V)
                        y[at // V, at % V] = x[at // V, at % V]
        for bx in T.thread_binding(T.ceildiv(n1, THREADS), thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("sampler_logit_edit_bias"):
                    ve = T.axis.spatial(n1, bx * THREADS + tx)
                    T.where(bx * THREADS + tx < n1)
                    T.reads(bias_at[ve], bias[ve], y[0:b, 0:V])
                    T.writes(y[0:b, 0:V])
                    bias_edit(y, bias_at, bias, ve)
        for bx in T.thread_binding(T.ceildiv(n2, THREADS), thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("sampler_logit_edit_mask"):
                    ve = T.axis.spatial(n2, bx * THREADS + tx)
                    T.where(bx * THREADS + tx < n2)
                    T.reads(mask_at[ve])
                    T.writes(y[0:b, 0:V])
                    mask_edit(y, mask_at, ve)
        for bx in T.thread_binding(T.ceildiv(n3, THREADS), thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("sampler_logit_edit_repetition"):
                    ve = T.axis.spatial(n3, bx * THREADS + tx)
                    T.where(bx * THREADS + tx < n3)
                    T.reads(rep_at[ve], rep[ve], y[0:b, 0:V])
                    T.writes(y[0:b, 0:V])
                    repetition_edit(y, rep_at, rep, ve)
        for bx in T.thread_binding(T.ceildiv(n4, THREADS), thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("sampler_logit_edit_penalty"):
                    ve = T.axis.spatial(n4, bx * THREADS + tx)
                    T.where(bx * THREADS + tx < n4)
                    T.reads(pen_at[ve], freq[ve], pres[ve], y[0:b, 0:V])
                    T.writes(y[0:b, 0:V])
                    penalty_edit(y, pen_at, freq, pres, ve)

    return edits


class LogitEdits(GPUScheduleRule):
    """logit_edits_func's PrimFunc on CUDA: replaced by logit_edits_gpu_func for its vocabulary."""

    def apply(self, func, target, _tunable):  # noqa: ANN001 - DLight's rule signature
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        try:
            sch.get_sblock(BLOCK_PREFIX + "copy")
        except Exception:  # noqa: BLE001 - not the edits function
            return None
        vocab = func.params[0].shape[1]  # TVM 0.27: buffer parameters carry their shape
        scheduled = logit_edits_gpu_func(int(vocab))
        if func.attrs is not None and "global_symbol" in func.attrs:  # keep the name the module gave it
            scheduled = scheduled.with_attr("global_symbol", func.attrs["global_symbol"])
        return s_tir.Schedule(scheduled)
