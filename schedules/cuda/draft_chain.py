"""CUDA forms of the draft cache's kernels (models/draft_chain.py): the key/value write, the
attention over the contiguous cache, the step's token select and the greedy argmax.

The model emits them as plain TIR (what CPU builds run); the DraftChain rule finds each by its
block name and puts the scheduled function of the same shapes in its place, as LogitEdits does
for the sampler's edits. They are written scheduled because their loops depend on values read
from the device (the positions in the cache), which DLight's rules do not take.

Attention: one block of THREADS threads per (query, query head). Each thread scores its share
of the positions (a whole head's dot product a position, the scores kept in shared memory: at
most MAX_CACHE_LEN of them), the block reduces the max and the sum, then the threads split the
head's elements and the positions to sum p x v. At the draft's contexts (hundreds to a few
thousand positions) this is a few microseconds a layer, against ~10 for the layer's GEMVs.
"""
from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.script import tirx as T

from vtool.runtime.artifact.draft_state import (FORCED, MAX_CACHE_LEN_CUDA, MAX_FORCED, MAX_STEPS, NUM_FORCED, OUT,
                                                POSITION, STATE_LEN, STEP)

THREADS = 256
# independent loads in flight a thread in the p x v sum and the argmax scan: a loop that waits for
# each load before the next ran the step at a fraction of the bandwidth (1.5 ms for the 0.5B draft)
UNROLL = 8
ARGMAX_THREADS = 1024
WRITE_THREADS = 256


def write_kv_gpu(layers: int, cache_len: int, kv_heads: int, head_dim: int, dtype: str) -> tirx.PrimFunc:
    L, C, H, D = layers, cache_len, kv_heads, head_dim

    @T.prim_func(s_tir=True)
    def write(kc_h: T.handle, vc_h: T.handle, k_h: T.handle, v_h: T.handle, base_h: T.handle, layer: T.int64):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        s = T.int64()
        kc = T.match_buffer(kc_h, (L, C, H, D), dtype)
        vc = T.match_buffer(vc_h, (L, C, H, D), dtype)
        k = T.match_buffer(k_h, (s, H, D), dtype)
        v = T.match_buffer(v_h, (s, H, D), dtype)
        base = T.match_buffer(base_h, (1,), "int32")
        for bx in T.thread_binding(T.ceildiv(s * H * D, WRITE_THREADS), thread="blockIdx.x"):
            for tx in T.thread_binding(WRITE_THREADS, thread="threadIdx.x"):
                with T.sblock("draft_chain_write"):
                    e: T.let[T.int64] = bx * WRITE_THREADS + tx
                    if e < s * H * D:
                        i: T.let[T.int64] = e // (H * D)
                        h: T.let[T.int64] = e // D % H
                        d: T.let[T.int64] = e % D
                        kc[layer, T.cast(base[0], "int64") + i, h, d] = k[i, h, d]
                        vc[layer, T.cast(base[0], "int64") + i, h, d] = v[i, h, d]

    return write


def _log2(n: int) -> int:
    return n.bit_length() - 1


def attention_gpu(layers: int, cache_len: int, q_heads: int, kv_heads: int, head_dim: int,
                  dtype: str) -> tirx.PrimFunc:
    L, C, HQ, HKV, D = layers, cache_len, q_heads, kv_heads, head_dim
    if C > MAX_CACHE_LEN_CUDA or THREADS % D:
        raise ValueError(f"the draft cache's CUDA attention takes up to {MAX_CACHE_LEN_CUDA} positions and a head "
                         f"dim dividing {THREADS}; got {C} positions, head dim {D}")
    group = HQ // HKV
    parts = THREADS // D  # position groups in the p x v sum
    steps = _log2(THREADS)
    # Scores for whole rounds of THREADS positions (and the p x v pass's overrun): every thread
    # writes its slot unconditionally (TVM's sync planner cannot put a barrier inside a condition),
    # positions past the query's masked to a zero weight.
    padded = (C + THREADS - 1) // THREADS * THREADS + max(THREADS, parts * UNROLL)

    @T.prim_func(s_tir=True)
    def attend(q_h: T.handle, kc_h: T.handle, vc_h: T.handle, base_h: T.handle, layer: T.int64, scale: T.float32,
               o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        s = T.int64()
        q = T.match_buffer(q_h, (s, HQ, D), dtype)
        kc = T.match_buffer(kc_h, (L, C, HKV, D), dtype)
        vc = T.match_buffer(vc_h, (L, C, HKV, D), dtype)
        base = T.match_buffer(base_h, (1,), "int32")
        o = T.match_buffer(o_h, (s, HQ, D), dtype)
        for bi in T.thread_binding(s, thread="blockIdx.x"):
            for bh in T.thread_binding(HQ, thread="blockIdx.y"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("draft_chain_attention"):
                        T.reads(q[bi, bh, 0:D], kc[layer, 0:C, bh // group, 0:D], vc[layer, 0:C, bh // group, 0:D],
                                base[0])
                        T.writes(o[bi, bh, 0:D])
                        scores = T.sblock_alloc_buffer((padded,), "float32", scope="shared")
                        red = T.sblock_alloc_buffer((THREADS,), "float32", scope="shared")
                        qs = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                        st = T.sblock_alloc_buffer((5,), "float32", scope="local")  # max, dot, sum, acc, other
                        acc = T.sblock_alloc_buffer((UNROLL,), "float32", scope="local")
                        n: T.let[T.int32] = base[0] + T.cast(bi, "int32") + 1
                        g: T.let[T.int32] = bh // group
                        if tx < D:
                            qs[tx] = T.cast(q[bi, bh, tx], "float32") * scale
                        T.tvm_storage_sync("shared")
                        st[0] = T.float32(-3.0e38)
                        for it in T.serial(T.ceildiv(n, THREADS)):
                            t: T.let[T.int32] = it * THREADS + T.cast(tx, "int32")
                            st[1] = T.float32(0)
                            for d in T.unroll(D):
                                st[1] = st[1] + qs[d] * T.cast(kc[layer, T.min(t, C - 1), g, d], "float32")
                            st[1] = T.if_then_else(t < n, st[1], T.float32(-3.0e38))
                            scores[t] = st[1]
                            st[0] = T.max(st[0], st[1])
                        red[tx] = st[0]
                        T.tvm_storage_sync("shared")
                        for r in T.unroll(steps):
                            st[4] = red[T.min(tx + (THREADS >> (r + 1)), THREADS - 1)]
                            T.tvm_storage_sync("shared")
                            if tx < (THREADS >> (r + 1)):
                                red[tx] = T.max(st[0], st[4])
                            st[0] = T.max(st[0], st[4])
                            T.tvm_storage_sync("shared")
                        st[0] = red[0]
                        T.tvm_storage_sync("shared")
                        st[2] = T.float32(0)
                        for it in T.serial(T.ceildiv(n, THREADS)):
                            t: T.let[T.int32] = it * THREADS + T.cast(tx, "int32")
                            st[1] = T.exp(scores[t] - st[0])
                            scores[t] = st[1]
                            st[2] = st[2] + st[1]
                        red[tx] = st[2]
                        T.tvm_storage_sync("shared")
                        for r in T.unroll(steps):
                            st[4] = red[T.min(tx + (THREADS >> (r + 1)), THREADS - 1)]
                            T.tvm_storage_sync("shared")
                            if tx < (THREADS >> (r + 1)):
                                red[tx] = st[2] + st[4]
                            st[2] = st[2] + st[4]
                            T.tvm_storage_sync("shared")
                        st[2] = red[0]
                        T.tvm_storage_sync("shared")
                        for u in T.unroll(UNROLL):
                            acc[u] = T.float32(0)
                        for it in T.serial(T.ceildiv(n, parts * UNROLL)):
                            for u in T.unroll(UNROLL):
                                t: T.let[T.int32] = (it * UNROLL + u) * parts + T.cast(tx // D, "int32")
                                acc[u] = acc[u] + T.if_then_else(
                                    t < n, scores[t] * T.cast(vc[layer, T.min(t, C - 1), g, tx % D], "float32"),
                                    T.float32(0))
                        st[3] = T.float32(0)
                        for u in T.unroll(UNROLL):
                            st[3] = st[3] + acc[u]
                        red[tx] = st[3]
                        T.tvm_storage_sync("shared")
                        if tx < D:
                            st[3] = T.float32(0)
                            for p in T.unroll(parts):
                                st[3] = st[3] + red[p * D + tx]
                            o[bi, bh, tx] = T.cast(st[3] / st[2], dtype)

    return attend


def select_gpu() -> tirx.PrimFunc:
    @T.prim_func(s_tir=True)
    def select(state_h: T.handle, token_h: T.handle, pos_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        state = T.match_buffer(state_h, (STATE_LEN,), "int32")
        token = T.match_buffer(token_h, (1,), "int32")
        pos = T.match_buffer(pos_h, (1,), "int32")
        for bx in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(1, thread="threadIdx.x"):
                with T.sblock("draft_chain_select"):
                    j: T.let[T.int32] = state[STEP]
                    token[0] = T.if_then_else(j < state[NUM_FORCED], state[FORCED + T.min(j, MAX_FORCED - 1)],
                                              state[OUT + T.max(j - 1, 0)])
                    pos[0] = state[POSITION] + j

    return select


def last_token_gpu() -> tirx.PrimFunc:
    @T.prim_func(s_tir=True)
    def last(state_h: T.handle, token_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        state = T.match_buffer(state_h, (STATE_LEN,), "int32")
        token = T.match_buffer(token_h, (1,), "int32")
        for bx in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(1, thread="threadIdx.x"):
                with T.sblock("draft_chain_last"):
                    token[0] = state[OUT + T.min(T.max(state[STEP] - 1, 0), MAX_STEPS - 1)]

    return last


def record_argmax_gpu(vocab: int) -> tirx.PrimFunc:
    V, NT = vocab, ARGMAX_THREADS
    steps = _log2(NT)

    @T.prim_func(s_tir=True)
    def record(state_h: T.handle, x_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        state = T.match_buffer(state_h, (STATE_LEN,), "int32")
        x = T.match_buffer(x_h, (1, 1, V), "float32")
        for bx in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("draft_chain_argmax"):
                    vals = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                    idxs = T.sblock_alloc_buffer((NT,), "int32", scope="shared")
                    best = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    at = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    mine = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    seen = T.sblock_alloc_buffer((UNROLL,), "float32", scope="local")
                    mine_at = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    best[0] = T.min_value("float32")
                    at[0] = T.int32(V)
                    for it in T.serial((V + NT * UNROLL - 1) // (NT * UNROLL)):
                        for u in T.unroll(UNROLL):  # the loads first, all in flight
                            seen[u] = x[0, 0, T.min((it * UNROLL + u) * NT + T.cast(tx, "int32"), V - 1)]
                        for u in T.unroll(UNROLL):  # then in index order: the first maximum stays
                            t: T.let[T.int32] = (it * UNROLL + u) * NT + T.cast(tx, "int32")
                            if t < V:
                                if seen[u] > best[0] or at[0] == V:
                                    best[0] = seen[u]
                                    at[0] = t
                    vals[tx] = best[0]
                    idxs[tx] = at[0]
                    T.tvm_storage_sync("shared")
                    for r in T.unroll(steps):
                        # read, wait, then write: TVM's sync planner puts no barrier inside a condition
                        best[0] = vals[T.min(tx + (NT >> (r + 1)), NT - 1)]
                        at[0] = idxs[T.min(tx + (NT >> (r + 1)), NT - 1)]
                        mine[0] = vals[tx]
                        mine_at[0] = idxs[tx]
                        T.tvm_storage_sync("shared")
                        if tx < (NT >> (r + 1)):
                            if best[0] > mine[0] or (best[0] == mine[0] and at[0] < mine_at[0]):
                                vals[tx] = best[0]
                                idxs[tx] = at[0]
                        T.tvm_storage_sync("shared")
                    if tx == 0:
                        state[OUT + T.min(state[STEP], MAX_STEPS - 1)] = idxs[0]
                        state[STEP] = state[STEP] + 1

    return record


KERNELS = ("draft_chain_write", "draft_chain_attention", "draft_chain_select", "draft_chain_argmax",
           "draft_chain_last")


def _block_names(func: tirx.PrimFunc) -> set[str]:
    """Which of KERNELS' blocks `func` has."""
    sch = s_tir.Schedule(func)
    names = set()
    for name in KERNELS:
        try:
            sch.get_sblock(name)
        except Exception:  # noqa: BLE001 - no such block
            continue
        names.add(name)
    return names


def scheduled_form(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The CUDA form of one of models/draft_chain.py's plain kernels; None for any other function."""
    names = _block_names(func)
    shape = lambda i: [int(x) if isinstance(x, tirx.IntImm) else x for x in func.params[i].shape]  # noqa: E731
    if "draft_chain_write" in names:
        L, C, H, D = shape(0)
        return write_kv_gpu(L, C, H, D, str(func.params[0].dtype))
    if "draft_chain_attention" in names:
        _, HQ, D = shape(0)
        L, C, HKV, _ = shape(1)
        return attention_gpu(L, C, HQ, HKV, D, str(func.params[0].dtype))
    if "draft_chain_select" in names:
        return select_gpu()
    if "draft_chain_last" in names:
        return last_token_gpu()
    if "draft_chain_argmax" in names:
        return record_argmax_gpu(shape(1)[2])
    return None


class DraftChain(GPUScheduleRule):
    """models/draft_chain.py's kernels on CUDA: replaced by their scheduled forms."""

    def apply(self, func, target, _tunable):  # noqa: ANN001 - DLight's rule signature
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        scheduled = scheduled_form(func)
        if scheduled is None:
            return None
        if func.attrs is not None and "global_symbol" in func.attrs:  # keep the name the module gave it
            scheduled = scheduled.with_attr("global_symbol", func.attrs["global_symbol"])
        return s_tir.Schedule(scheduled)
