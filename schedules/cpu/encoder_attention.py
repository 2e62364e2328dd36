"""A parallel, vectorized CPU kernel for an encoder's attention: every query of a right-padded
batch attends to every token key of its row (bidirectional), or to those within a window.

Encoders (models/bert.py, models/gemma_encoder.py) otherwise spell attention as Relax ops: a
batched q.k^T matmul into a [b, heads, n, n] score tensor, a mask bias, a softmax and a p.v
matmul. No CPU rule schedules a batched matmul, so those ran as serial scalar loops: on the
2-core Xeon EmbeddingGemma-300M took 32.8 s for four 455-token texts, transformers 2.0 s.

Here one PrimFunc does the whole of it, the way schedules/cpu/attention.py's prefill kernel
does for a KV cache's prompt (and with its pieces: `dot_tile`, `exp2_tile`):

  * a parallel loop over (row, query, KV head) triples; the query heads of one KV head
    (grouped-query attention) share each tile of keys while it is in L1;
  * online softmax over tiles of 16 keys in base 2, so nothing of the row's length is stored;
  * a tile's 16 scores come out as one vector, its weights by a vector exp2;
  * the visible keys of query i: those with mask != 0 and, with a window w, |i - j| < w
    (the loop runs over [i - w + 1, i + w) only).

A query that sees no key (never one of a right-padded row's tokens) gets zeros, where the
mask-bias form gives the mean of every value; pooling reads token rows only.

Layout: qkv [b, n, q_heads + 2 * kv_heads, d] float32 (q heads, then k, then v: the fused
projection's output, after any q/k norm and rotary embedding), mask [b, n] int32 (nonzero: a
token), out [b, n, q_heads, d] float32. sm_scale and the window are compiled in.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from vtool.schedules.cpu.attention import LANES, LOG2E, dot_tile, exp2_tile

NO_WINDOW = 1 << 30  # a window no row reaches: every token key visible
NEG = -5e4  # the scores' "minus infinity" (finite: exp2 of a difference stays defined), as attention.py


class DenseAttentionKernels:
    """What models/dense_attention.py asks for (its DenseAttentionKernels protocol): the toolchain
    hands an instance to CPU float32 encoder builds (models/ never imports schedules/)."""

    def takes(self, q_heads: int, kv_heads: int, head_dim: int) -> bool:
        """Whether the kernel applies (a head size that is a multiple of 16, query heads a
        multiple of the KV heads); where not, the caller keeps its ops."""
        return head_dim % LANES == 0 and q_heads % kv_heads == 0

    def func(self, q_heads: int, kv_heads: int, head_dim: int, sm_scale: float, window: int) -> tirx.PrimFunc | None:
        """The kernel for these shapes, or None where it does not apply (`takes`)."""
        if not self.takes(q_heads, kv_heads, head_dim) or window < 0:
            return None
        return dense_attention_kernel(q_heads, kv_heads, head_dim, float(sm_scale), int(window) or NO_WINDOW)


def dense_attention_kernel(q_heads: int, kv_heads: int, d: int, sm_scale: float, window: int) -> tirx.PrimFunc:
    group = q_heads // kv_heads
    heads = q_heads + 2 * kv_heads
    n_c = d // LANES
    scale = sm_scale * LOG2E

    @T.prim_func(s_tir=True)
    def dense_attention(var_qkv: T.handle, var_mask: T.handle, var_out: T.handle):
        batch = T.int32()
        n = T.int32()
        qkv = T.match_buffer(var_qkv, (batch, n, heads, d), "float32")
        mask = T.match_buffer(var_mask, (batch, n), "int32")
        out = T.match_buffer(var_out, (batch, n, q_heads, d), "float32")

        for task in T.parallel(batch * n * kv_heads):
            row: T.let[T.int32] = task // (n * kv_heads)
            qi: T.let[T.int32] = task // kv_heads % n
            hk: T.let[T.int32] = task % kv_heads
            lo: T.let[T.int32] = T.max(qi - (window - 1), 0)
            hi: T.let[T.int32] = T.min(qi + window, n)
            with T.sblock("attn"):
                acc = T.sblock_alloc_buffer((group, d), "float32")
                s = T.sblock_alloc_buffer((LANES,), "float32")
                seen = T.sblock_alloc_buffer((LANES,), "int32")
                st = T.sblock_alloc_buffer((group, 4), "float32")  # m, d, tile max, scratch
                for g in T.serial(group):
                    for i in T.vectorized(d):
                        acc[g, i] = T.float32(0)
                    st[g, 0] = T.float32(NEG)
                    st[g, 1] = T.float32(0)
                for kt in T.serial((hi - lo + LANES - 1) // LANES):
                    for t in T.serial(LANES):  # which keys of the tile this query sees
                        seen[t] = T.if_then_else(lo + kt * LANES + t < hi, mask[row, T.min(lo + kt * LANES + t, n - 1)], 0)
                    for g in T.serial(group):
                        st[g, 2] = T.float32(NEG)
                        # the tile's 16 scores (rows past the end clamped to the last key, then masked)
                        s[T.Ramp(0, 1, LANES)] = T.Select(
                            seen[T.Ramp(0, 1, LANES)] != T.Broadcast(T.int32(0), LANES),
                            _tile_scores(qkv, row, qi, hk * group + g, q_heads + hk, lo + kt * LANES, n - 1, d)
                            * T.Broadcast(T.float32(scale), LANES),
                            T.Broadcast(T.float32(NEG), LANES))
                        for t in T.serial(LANES):
                            st[g, 2] = T.max(st[g, 2], s[t])
                        if st[g, 2] > st[g, 0]:  # the running max rises: rescale what is summed
                            st[g, 3] = T.exp2(st[g, 0] - st[g, 2])
                            st[g, 1] = st[g, 1] * st[g, 3]
                            for i in T.vectorized(d):
                                acc[g, i] = acc[g, i] * st[g, 3]
                            st[g, 0] = st[g, 2]
                        s[T.Ramp(0, 1, LANES)] = exp2_tile(s[T.Ramp(0, 1, LANES)] - T.Broadcast(st[g, 0], LANES))
                        for t in T.serial(LANES):
                            if seen[t] != 0:
                                st[g, 1] = st[g, 1] + s[t]
                                for c in T.unroll(n_c):
                                    for j in T.vectorized(LANES):
                                        acc[g, c * LANES + j] = acc[g, c * LANES + j] + s[t] * qkv[
                                            row, lo + kt * LANES + t, q_heads + kv_heads + hk, c * LANES + j]
                for g in T.serial(group):
                    for i in T.vectorized(d):
                        out[row, qi, hk * group + g, i] = T.if_then_else(st[g, 1] > T.float32(0),
                                                                        acc[g, i] / st[g, 1], T.float32(0))

    # opaque (relax OpPatternKind 8): FuseOps leaves it whole, and no schedule rule takes it; no
    # symbol of its own (a model has one kernel per window: the module names each)
    return dense_attention.with_attr("op_pattern", 8).without_attr("global_symbol")


def _tile_scores(qkv: tirx.Buffer, row: tirx.PrimExpr, qi: tirx.PrimExpr, h: tirx.PrimExpr, k_head: tirx.PrimExpr,
                 first: tirx.PrimExpr, last: tirx.PrimExpr, d: int) -> tirx.PrimExpr:
    """float32x16, lane t = query (row, qi, head h) . key min(first + t, last) of head k_head."""
    vt = f"float32x{LANES}"
    return dot_tile(lambda c: qkv.vload([row, qi, h, c * LANES], vt),
                    lambda t, c: qkv.vload([row, T.min(first + t, last), k_head, c * LANES], vt), d)
