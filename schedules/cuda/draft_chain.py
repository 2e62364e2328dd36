"""CUDA forms of the draft cache's kernels (models/draft_chain.py): the key/value write, the
attention over the contiguous cache, the step's token select and the greedy argmax.

The model emits them as plain TIR (what CPU builds run); the DraftChain rule finds each by its
block name and puts the scheduled function of the same shapes in its place, as LogitEdits does
for the sampler's edits. They are written scheduled because their loops depend on values read
from the device (the positions in the cache), which DLight's rules do not take.

Attention: split over the positions as the paged decode attention is
(schedules/cuda/grouped_decode_attention.py, whose layout it takes): a block per (query, KV head,
piece) for the whole query group, then a merge kernel. The first form here, one block of 256
threads per query head with the scores in shared memory, took 29 us a layer at a 350-token
context on an H100: 14 blocks for the 0.5B draft, each thread's dot product one scalar load after
another (docs/BENCHMARKS.md, session 36).
"""
from __future__ import annotations

import math

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.script import tirx as T

from vtool.runtime.artifact.draft_state import (FORCED, MAX_FORCED, MAX_STEPS, NUM_FORCED, OUT, PART_ACC, PART_MAX,
                                                PART_SUM, POSITION, STATE_LEN, STEP, V_OUT, VERIFY_STATE_LEN)
from vtool.schedules.cuda.grouped_decode_attention import unpacker as grouped_unpacker
from vtool.schedules.cuda.grouped_decode_attention import layout as grouped_layout

# independent loads in flight a thread in the argmax scan
UNROLL = 8
ARGMAX_THREADS = 1024
WRITE_THREADS = 256


def write_kv_gpu(layers: int, cache_len: int, kv_heads: int, head_dim: int, q_heads: int, dtype: str) -> tirx.PrimFunc:
    """models/draft_chain.py write_kv_func on CUDA: a thread per (token, KV head, element)."""
    L, C, H, D, HQ = layers, cache_len, kv_heads, head_dim, q_heads
    HALF = D // 2

    @T.prim_func(s_tir=True)
    def write(kc_h: T.handle, vc_h: T.handle, qkv_h: T.handle, freq_h: T.handle, base_h: T.handle, layer: T.int64):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        s = T.int64()
        kc = T.match_buffer(kc_h, (L, C, H, D), dtype)
        vc = T.match_buffer(vc_h, (L, C, H, D), dtype)
        qkv = T.match_buffer(qkv_h, (s, HQ + 2 * H, D), dtype)
        freq = T.match_buffer(freq_h, (HALF,), "float32")
        base = T.match_buffer(base_h, (1,), "int32")
        for bx in T.thread_binding(T.ceildiv(s * H * D, WRITE_THREADS), thread="blockIdx.x"):
            for tx in T.thread_binding(WRITE_THREADS, thread="threadIdx.x"):
                with T.sblock("draft_chain_write"):
                    e: T.let[T.int64] = bx * WRITE_THREADS + tx
                    if e < s * H * D:
                        i: T.let[T.int64] = e // (H * D)
                        h: T.let[T.int64] = e // D % H
                        d: T.let[T.int64] = e % D
                        angle: T.let[T.float32] = T.cast(base[0] + T.cast(i, "int32"), "float32") * freq[d % HALF]
                        other: T.let[T.float32] = T.if_then_else(
                            d < HALF, -T.cast(qkv[i, HQ + h, T.min(d + HALF, D - 1)], "float32"),
                            T.cast(qkv[i, HQ + h, T.max(d - HALF, 0)], "float32"))
                        kc[layer, T.cast(base[0], "int64") + i, h, d] = T.cast(
                            T.cast(qkv[i, HQ + h, d], "float32") * T.cos(angle) + other * T.sin(angle), dtype)
                        vc[layer, T.cast(base[0], "int64") + i, h, d] = qkv[i, HQ + H + h, d]

    return write


def _log2(n: int) -> int:
    return n.bit_length() - 1


def attention_layout(q_heads: int, kv_heads: int, head_dim: int, dtype: str) -> tuple[int, int, int, int]:
    """(VEC, TL, GROUPS, UNROLL) of the part kernel: grouped_decode_attention's layout (TL threads
    hold one position's row in VEC-element pieces, GROUPS rows at once, UNROLL positions a group
    per pass); shapes it cannot lay out are refused by name."""
    shape = grouped_layout(kv_heads, q_heads, head_dim, dtype)
    if shape is None:
        raise ValueError(f"the draft cache's CUDA attention cannot lay out {q_heads} query heads over {kv_heads} "
                         f"KV heads of {head_dim} in {dtype}")
    return shape


def attention_part_gpu(layers: int, cache_len: int, q_heads: int, kv_heads: int, head_dim: int, dtype: str,
                       splits: int) -> tirx.PrimFunc:
    """models/draft_chain.py attention_part_func's result on CUDA: one block per (query, KV head,
    piece) computes every query head of the group from the same K/V loads (16-byte loads, the
    TL threads of a row summing their parts by shuffles, an online softmax per head in registers,
    the block's row groups joined in shared memory). A query's positions are cut into as many
    pieces as one pass of the block's row groups each fills (at most `splits`); the blocks past
    those write an empty piece. The plain function cuts them evenly into `splits`: the merged
    result is the same."""
    L, C, HQ, HKV, D, P = layers, cache_len, q_heads, kv_heads, head_dim, splits
    VEC, TL, GROUPS, U = attention_layout(HQ, HKV, D, dtype)
    G = HQ // HKV
    PER_WORD = 32 // tvm.DataType(dtype).bits
    WORDS = VEC // PER_WORD
    unpack = grouped_unpacker(dtype)
    PER_PASS = GROUPS * U
    SHUFFLES = _log2(TL)
    OUT_PER_THREAD = (G * D + GROUPS * TL - 1) // (GROUPS * TL)
    LOG2E = math.log2(math.e)

    @T.prim_func(s_tir=True)
    def attend_part(q_h: T.handle, kc_h: T.handle, vc_h: T.handle, base_h: T.handle, layer: T.int64,
                    scale: T.float32, part_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        s = T.int64()
        q = T.match_buffer(q_h, (s, HQ, D), dtype)
        kc = T.match_buffer(kc_h, (L, C, HKV, D), dtype)
        vc = T.match_buffer(vc_h, (L, C, HKV, D), dtype)
        base = T.match_buffer(base_h, (1,), "int32")
        part = T.match_buffer(part_h, (s, HQ, P, PART_ACC + D), "float32")
        kw = T.decl_buffer((L, C, HKV, D // PER_WORD), "uint32", data=kc.data)
        vw = T.decl_buffer((L, C, HKV, D // PER_WORD), "uint32", data=vc.data)
        for bi in T.thread_binding(s, thread="blockIdx.x"):
            for bh in T.thread_binding(HKV, thread="blockIdx.y"):
                for bp in T.thread_binding(P, thread="blockIdx.z"):
                    for ty in T.thread_binding(GROUPS, thread="threadIdx.y"):
                        for tx in T.thread_binding(TL, thread="threadIdx.x"):
                            with T.sblock("draft_chain_attention_part"):
                                T.reads(q[bi, bh * G:bh * G + G, 0:D], kw[layer, 0:C, bh, 0:D // PER_WORD],
                                        vw[layer, 0:C, bh, 0:D // PER_WORD], base[0])
                                T.writes(part[bi, bh * G:bh * G + G, bp, 0:PART_ACC + D])
                                q_local = T.sblock_alloc_buffer((G, VEC), "float32", scope="local")
                                o_local = T.sblock_alloc_buffer((G, VEC), "float32", scope="local")
                                m_local = T.sblock_alloc_buffer((G,), "float32", scope="local")
                                d_local = T.sblock_alloc_buffer((G,), "float32", scope="local")
                                k_words = T.sblock_alloc_buffer((U, WORDS), "uint32", scope="local")
                                v_words = T.sblock_alloc_buffer((U, WORDS), "uint32", scope="local")
                                s_local = T.sblock_alloc_buffer((G, U), "float32", scope="local")
                                m_new = T.sblock_alloc_buffer((1,), "float32", scope="local")
                                merged = T.sblock_alloc_buffer((3,), "float32", scope="local")  # m, d, o
                                o_smem = T.sblock_alloc_buffer((GROUPS, G, D), "float32", scope="shared")
                                md_smem = T.sblock_alloc_buffer((GROUPS, G, 2), "float32", scope="shared")
                                n: T.let[T.int32] = base[0] + T.cast(bi, "int32") + 1
                                pieces: T.let[T.int32] = T.max(1, T.min(P, T.ceildiv(n, PER_PASS)))
                                chunk: T.let[T.int32] = T.ceildiv(n, pieces)
                                start: T.let[T.int32] = T.cast(bp, "int32") * chunk
                                end: T.let[T.int32] = T.min(start + chunk, n)
                                for h in T.serial(G):
                                    for v in T.serial(VEC):
                                        q_local[h, v] = T.cast(q[bi, bh * G + h, tx * VEC + v], "float32") * scale * LOG2E
                                        o_local[h, v] = T.float32(0)
                                    m_local[h] = T.float32(-3.0e38)
                                    d_local[h] = T.float32(0)
                                # a piece past `pieces` (or an empty tail) runs no pass: an empty state
                                for it in T.serial(T.ceildiv(T.max(end - start, 0), PER_PASS)):
                                    first: T.let[T.int32] = start + (it * GROUPS + T.cast(ty, "int32")) * U
                                    for u in T.unroll(U):
                                        for w in T.unroll(WORDS // 4):
                                            for e in T.vectorized(4):
                                                # past the piece: the last row (in bounds), masked below
                                                k_words[u, w * 4 + e] = kw[layer, T.min(first + u, end - 1), bh,
                                                                           tx * WORDS + w * 4 + e]
                                    for u in T.unroll(U):
                                        for w in T.unroll(WORDS // 4):
                                            for e in T.vectorized(4):
                                                v_words[u, w * 4 + e] = vw[layer, T.min(first + u, end - 1), bh,
                                                                           tx * WORDS + w * 4 + e]
                                    for h in T.unroll(G):
                                        for u in T.unroll(U):
                                            s_local[h, u] = T.float32(0)
                                            for v in T.unroll(VEC):
                                                s_local[h, u] += q_local[h, v] * unpack(k_words[u, v // PER_WORD],
                                                                                        v % PER_WORD)
                                    for h in T.unroll(G):
                                        for u in T.unroll(U):
                                            for off in T.unroll(SHUFFLES):
                                                s_local[h, u] += T.tvm_warp_shuffle_xor(
                                                    T.uint32(0xFFFFFFFF), s_local[h, u],
                                                    T.shift_right(T.int32(TL), off + 1), 32, 32)
                                    for h in T.unroll(G):
                                        m_new[0] = m_local[h]
                                        for u in T.unroll(U):
                                            if first + u < end:
                                                m_new[0] = T.max(m_new[0], s_local[h, u])
                                        rescale: T.let[T.float32] = T.exp2(m_local[h] - m_new[0])
                                        d_local[h] = d_local[h] * rescale
                                        for v in T.unroll(VEC):
                                            o_local[h, v] = o_local[h, v] * rescale
                                        for u in T.unroll(U):
                                            w: T.let[T.float32] = T.if_then_else(
                                                first + u < end, T.exp2(s_local[h, u] - m_new[0]), T.float32(0))
                                            d_local[h] = d_local[h] + w
                                            for v in T.unroll(VEC):
                                                o_local[h, v] = o_local[h, v] + w * unpack(v_words[u, v // PER_WORD],
                                                                                           v % PER_WORD)
                                        m_local[h] = m_new[0]
                                # join the row groups, then write this piece of each query head
                                for h in T.serial(G):
                                    for v in T.serial(VEC):
                                        o_smem[ty, h, tx * VEC + v] = o_local[h, v]
                                    if tx == 0:
                                        md_smem[ty, h, 0] = m_local[h]
                                        md_smem[ty, h, 1] = d_local[h]
                                T.tvm_storage_sync("shared")
                                for r in T.serial(OUT_PER_THREAD):
                                    flat: T.let[T.int32] = r * (GROUPS * TL) + T.cast(ty, "int32") * TL + T.cast(tx, "int32")
                                    if flat < G * D:
                                        h: T.let[T.int32] = flat // D
                                        e: T.let[T.int32] = flat % D
                                        merged[0] = md_smem[0, h, 0]
                                        for g in T.serial(1, GROUPS):
                                            merged[0] = T.max(merged[0], md_smem[g, h, 0])
                                        merged[1] = T.float32(0)
                                        merged[2] = T.float32(0)
                                        for g in T.serial(GROUPS):
                                            weight: T.let[T.float32] = T.exp2(md_smem[g, h, 0] - merged[0])
                                            merged[1] += md_smem[g, h, 1] * weight
                                            merged[2] += o_smem[g, h, e] * weight
                                        part[bi, bh * G + h, bp, PART_ACC + e] = merged[2]
                                        if e == 0:
                                            part[bi, bh * G + h, bp, PART_MAX] = merged[0] / LOG2E
                                            part[bi, bh * G + h, bp, PART_SUM] = merged[1]

    return attend_part


def attention_merge_gpu(q_heads: int, head_dim: int, dtype: str, splits: int) -> tirx.PrimFunc:
    """attention_merge_func on CUDA: a block per (query, query head), a thread per element, every
    piece's loads unrolled (in flight together)."""
    HQ, D, P = q_heads, head_dim, splits

    @T.prim_func(s_tir=True)
    def attend_merge(part_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        s = T.int64()
        part = T.match_buffer(part_h, (s, HQ, P, PART_ACC + D), "float32")
        o = T.match_buffer(o_h, (s, HQ, D), dtype)
        for bi in T.thread_binding(s, thread="blockIdx.x"):
            for bh in T.thread_binding(HQ, thread="blockIdx.y"):
                for tx in T.thread_binding(D, thread="threadIdx.x"):
                    with T.sblock("draft_chain_attention_merge"):
                        T.reads(part[bi, bh, 0:P, 0:PART_ACC + D])
                        T.writes(o[bi, bh, tx])
                        st = T.sblock_alloc_buffer((3,), "float32", scope="local")  # max, sum, acc
                        st[0] = T.float32(-3.0e38)
                        for p in T.unroll(P):
                            st[0] = T.max(st[0], part[bi, bh, p, PART_MAX])
                        st[1] = T.float32(0)
                        st[2] = T.float32(0)
                        for p in T.unroll(P):
                            w: T.let[T.float32] = T.exp(part[bi, bh, p, PART_MAX] - st[0])
                            st[1] = st[1] + part[bi, bh, p, PART_SUM] * w
                            st[2] = st[2] + part[bi, bh, p, PART_ACC + tx] * w
                        o[bi, bh, tx] = T.cast(st[2] / st[1], dtype)

    return attend_merge


def _argmax_scan(vocab: int):
    """A macro: block argmax of logits row `row` with ARGMAX_THREADS threads; the index lands in
    idxs[0] (the lowest index among equal maxima, as numpy's)."""
    V, NT = vocab, ARGMAX_THREADS
    steps = _log2(NT)

    @T.macro
    def scan(x, row, tx, vals, idxs):
        best = T.sblock_alloc_buffer((1,), "float32", scope="local")
        at = T.sblock_alloc_buffer((1,), "int32", scope="local")
        mine = T.sblock_alloc_buffer((1,), "float32", scope="local")
        seen = T.sblock_alloc_buffer((UNROLL,), "float32", scope="local")
        mine_at = T.sblock_alloc_buffer((1,), "int32", scope="local")
        best[0] = T.min_value("float32")
        at[0] = T.int32(V)
        for it in T.serial((V + NT * UNROLL - 1) // (NT * UNROLL)):
            for u in T.unroll(UNROLL):  # the loads first, all in flight
                seen[u] = x[0, row, T.min((it * UNROLL + u) * NT + T.cast(tx, "int32"), V - 1)]
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

    return scan


def record_argmax_gpu(vocab: int) -> tirx.PrimFunc:
    V, NT = vocab, ARGMAX_THREADS
    scan = _argmax_scan(V)

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
                    scan(x, 0, tx, vals, idxs)
                    if tx == 0:
                        state[OUT + T.min(state[STEP], MAX_STEPS - 1)] = idxs[0]
                        state[STEP] = state[STEP] + 1

    return record


def rows_argmax_gpu(rows: int, vocab: int) -> tirx.PrimFunc:
    """models/draft_chain.py rows_argmax_func on CUDA: a block of ARGMAX_THREADS per row."""
    R, V, NT = rows, vocab, ARGMAX_THREADS
    scan = _argmax_scan(V)

    @T.prim_func(s_tir=True)
    def argmax(state_h: T.handle, x_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        state = T.match_buffer(state_h, (VERIFY_STATE_LEN,), "int32")
        x = T.match_buffer(x_h, (1, R, V), "float32")
        for bx in T.thread_binding(R, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("chain_verify_argmax"):
                    vals = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                    idxs = T.sblock_alloc_buffer((NT,), "int32", scope="shared")
                    scan(x, bx, tx, vals, idxs)
                    if tx == 0:
                        state[V_OUT + bx] = idxs[0]

    return argmax


def thread_per_row(func: tirx.PrimFunc, block: str) -> tirx.PrimFunc:
    """A plain kernel of one small loop over its block (the draft step's token select and last
    token: one; chain_verify's inputs and output: its rows) as one CUDA block, a thread a row."""
    sch = s_tir.Schedule(func)
    sb = sch.get_sblock(block)
    (loop,) = sch.get_loops(sb)
    sch.bind(loop, "threadIdx.x")
    sch.bind(sch.add_unit_loop(loop), "blockIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


KERNELS = ("chain_verify_inputs", "chain_verify_argmax", "chain_verify_out",
           "draft_chain_write", "draft_chain_attention_part", "draft_chain_attention_merge", "draft_chain_select", "draft_chain_argmax",
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
        return write_kv_gpu(L, C, H, D, shape(2)[1] - 2 * H, str(func.params[0].dtype))
    if "draft_chain_attention_part" in names:
        _, HQ, D = shape(0)
        L, C, HKV, _ = shape(1)
        return attention_part_gpu(L, C, HQ, HKV, D, str(func.params[0].dtype), shape(6)[2])
    if "draft_chain_attention_merge" in names:
        _, HQ, P, _ = shape(0)
        return attention_merge_gpu(HQ, shape(1)[2], str(func.params[1].dtype), P)
    for block in ("draft_chain_select", "draft_chain_last", "chain_verify_inputs", "chain_verify_out"):
        if block in names:
            return thread_per_row(func, block)
    if "chain_verify_argmax" in names:
        return rows_argmax_gpu(shape(1)[1], shape(1)[2])
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
