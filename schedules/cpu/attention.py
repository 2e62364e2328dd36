"""Parallel, vectorized CPU kernels for the prefill and decode attention of TVM's paged KV
cache (the decode one, `rewrite_decode_paged`, at the end, built the same way).

TVM's CPU `batch_prefill_ragged_kv` (relax/frontend/nn/llm/_prefill_kernels.py,
`_attention_prefill_ragged_cpu`: the attention over the chunk's own keys and values,
which is all of it for a fresh prompt) is one serial, scalar loop nest: every (query,
key, head) score is computed, masked ones included, on one thread. On SmolLM2 that was
about half of a 512-token prefill's wall time while the other core waited. This rule
replaces that PrimFunc, same name and signature, by:

  * a parallel loop over (query, head) pairs of each sequence;
  * causal rows visiting only their visible keys (kv_len - qo_len + row + 1);
  * online softmax over tiles of TILE keys (base-2, as TVM's kernels: scores are scaled
    by log2(e) * sm_scale, lse = m + log2(d)), so nothing of kv_len size is stored;
  * the q.k dot products and the p.v updates vectorized over the head dimension; a tile's 16
    scores come out as one vector (`_scores`) and its weights by a vector exp2 (`exp2_tile`).

Only `rotary_mode == 0` is handled: vtool's KV cache is made with RopeMode.NORMAL
(models/decoder.py), so the rotary embedding is applied before the cache and the attention
kernels are always called with rotary_mode 0. Any other value fails loudly (a TIR assert),
never silently without the rotation. The replacement is identified by its global name and
its exact parameter layout; anything else is left alone.
"""
from __future__ import annotations

import math
import re

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.script import tirx as T

from vtool.schedules.softcap import capper, softcap_of

NAME = "batch_prefill_ragged_kv"
LANES = 16  # float32 lanes of the dot products (AVX-512); the head dim must be a multiple of it
TILE = LANES  # keys per online-softmax step: one vector of scores
LOG2E = math.log2(math.e)
# The caches these kernels read: float32, or 16 bits (a bfloat16/float16 build's). Scores, the
# online softmax and the accumulator are float32 whatever the cache; a 16-bit value is widened
# exactly when loaded and the output rounded once when stored.
KV_DTYPES = ("float32", "bfloat16", "float16")


def widen(value: tirx.PrimExpr) -> tirx.PrimExpr:
    """A scalar or vector load as float32 (a 16-bit value widened exactly); float32 unchanged.
    bfloat16 is widened on its bits (the high half of a float32): a cast left to TVM's bfloat16
    legalization inside sum_tile's Let chain came out as garbage (scores of 1e10)."""
    kind = str(value.ty)
    base, _, lanes = kind.partition("x")
    suffix = f"x{lanes}" if lanes else ""
    if base == "float32":
        return value
    if base == "bfloat16":
        bits = T.Cast("uint32" + suffix, T.reinterpret("uint16" + suffix, value))
        return T.reinterpret("float32" + suffix, T.shift_left(bits, tirx.const(16, "uint32" + suffix)))
    return T.Cast("float32" + suffix, value)


def narrow(buffer: tirx.Buffer, value: tirx.PrimExpr) -> tirx.PrimExpr:
    """A float32 `value` as `buffer`'s dtype (one rounding for a 16-bit buffer)."""
    return value if str(buffer.dtype) == "float32" else T.Cast(str(buffer.dtype), value)


def vload32(buffer: tirx.Buffer, indices: list) -> tirx.PrimExpr:
    """LANES consecutive values of `buffer` from `indices`, as float32xLANES."""
    return widen(buffer.vload(indices, f"{buffer.dtype}x{LANES}"))


def _shape(func: tirx.PrimFunc, index: int) -> list | None:
    shape = getattr(func.params[index], "shape", None)  # buffer parameters carry their shape
    return None if shape is None else list(shape)


def rewrite_prefill_ragged(name: str, func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The replacement for TVM's CPU ragged prefill attention, or None when `func` is not it."""
    if name != NAME or len(func.params) != 14:
        return None
    shapes = [_shape(func, i) for i in range(14)]
    if any(s is None for s in shapes[:9]) or any(s is not None for s in shapes[9:]):
        return None
    q, k, v = shapes[0], shapes[2], shapes[3]
    if len(q) != 3 or len(k) != 3 or len(v) != 3:
        return None
    try:
        h_q, d_qk, h_kv, d_v = int(q[1]), int(q[2]), int(k[1]), int(v[2])
    except TypeError:
        return None
    dtype = str(func.params[0].dtype)
    if dtype not in KV_DTYPES or h_q % h_kv or d_qk % LANES or d_v % LANES or int(k[2]) != d_qk:
        return None
    new = _kernel(h_kv, h_q, d_qk, d_v, softcap_of(func), dtype)
    return new.with_attrs(func.attrs) if func.attrs is not None else new


def _balanced(j: tirx.PrimExpr, n: tirx.PrimExpr) -> tirx.PrimExpr:
    """The query of the j-th (query, head) group of a parallel prefill loop: 0, n-1, 1, n-2, ...
    A causal query's work grows with its index, and TVM's parallel loop hands each thread one
    contiguous run of the range: in query order the thread with the last queries had about 3/4
    of a fresh prompt's attention while the other waited. Alternating short and long queries
    gives every run about the same work."""
    return T.if_then_else(j % 2 == 0, j // 2, n - 1 - j // 2)


def _kernel(h_kv: int, h_q: int, d_qk: int, d_v: int, softcap: float = 0.0, dtype: str = "float32") -> tirx.PrimFunc:
    """`softcap`: the attention logit soft-cap of the kernel replaced (schedules/softcap.py; 0: none).
    `dtype`: q, k, v and output's (KV_DTYPES)."""
    group = h_q // h_kv
    n_vc = d_v // LANES
    neg = -5e4  # TVM's kernels' "minus infinity" (finite: exp2 of a difference stays defined)
    cap = capper(softcap)

    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv(
        var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle, var_kv_indptr: T.handle,
        var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q = T.match_buffer(var_q, (qo_len, h_q, d_qk), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_len, h_kv, d_qk), dtype)
        v = T.match_buffer(var_v, (kv_len, h_kv, d_v), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32",  # noqa: F841
                                         elem_offset=q_rope_position_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",  # noqa: F841
                                           elem_offset=k_rope_pos_offset_elem_offset)
        output = T.match_buffer(var_output, (qo_len, h_q, d_v), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")

        T.Assert(rotary_mode == 0, "vtool's CPU prefill attention takes rotary_mode 0 (rope applied before the cache)")
        for b in T.serial(batch_size):
            for qh in T.parallel((q_indptr[b + 1] - q_indptr[b]) * h_q):
                n_q: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                q_idx: T.let[T.int32] = _balanced(qh // h_q, n_q)
                h: T.let[T.int32] = qh % h_q
                hk: T.let[T.int32] = h // group
                q_row: T.let[T.int32] = q_indptr[b] + q_idx
                kv0: T.let[T.int32] = kv_indptr[b]
                n_kv: T.let[T.int32] = kv_indptr[b + 1] - kv_indptr[b]
                n_keys: T.let[T.int32] = T.if_then_else(causal > 0, T.min(n_kv - n_q + q_idx + 1, n_kv), n_kv)
                scale: T.let[T.float32] = sm_scale * T.float32(LOG2E)
                with T.sblock("attn"):
                    acc = T.sblock_alloc_buffer((d_v,), "float32")
                    s = T.sblock_alloc_buffer((TILE,), "float32")
                    st = T.sblock_alloc_buffer((4,), "float32")  # m, d, tile max, scratch
                    for i in T.vectorized(d_v):
                        acc[i] = T.float32(0)
                    st[0] = T.float32(neg)
                    st[1] = T.float32(0)
                    for kt in T.serial((n_keys + TILE - 1) // TILE):
                        st[2] = T.float32(neg)
                        # the tile's 16 scores at once (keys past n_keys masked; their rows
                        # clamped to the sequence's last key, so no load leaves k), then their max
                        s[T.Ramp(0, 1, LANES)] = T.Select(
                            T.Ramp(0, 1, LANES) < T.Broadcast(n_keys - kt * TILE, LANES),
                            cap(_ragged_scores(q, k, q_row, h, hk, kv0 + kt * TILE, kv0 + n_kv - 1, d_qk)
                                * T.Broadcast(scale, LANES)),
                            T.Broadcast(T.float32(neg), LANES))
                        for t in T.serial(TILE):
                            st[2] = T.max(st[2], s[t])
                        # st[2] = the tile's max; rescale what is accumulated when it rises
                        if st[2] > st[0]:
                            st[3] = T.exp2(st[0] - st[2])
                            st[1] = st[1] * st[3]
                            for i in T.vectorized(d_v):
                                acc[i] = acc[i] * st[3]
                            st[0] = st[2]
                        # the tile's weights in vector registers (a libm exp2f call per key spilled
                        # every register around it: 15% of a 512-token prompt of the default model)
                        s[T.Ramp(0, 1, LANES)] = exp2_tile(s[T.Ramp(0, 1, LANES)] - T.Broadcast(st[0], LANES))
                        for t in T.serial(TILE):
                            if kt * TILE + t < n_keys:
                                st[1] = st[1] + s[t]
                                for c in T.unroll(n_vc):
                                    for j in T.vectorized(LANES):
                                        acc[c * LANES + j] = acc[c * LANES + j] + s[t] * widen(v[kv0 + kt * TILE + t, hk, c * LANES + j])
                    for i in T.vectorized(d_v):
                        output[q_row, h, i] = narrow(output, T.if_then_else(st[1] > T.float32(0), acc[i] / st[1],
                                                                            T.float32(0)))
                    lse[q_row, h] = T.if_then_else(st[1] > T.float32(0), st[0] + T.log2(st[1]), T.float32(neg))

    return batch_prefill_ragged_kv


DECODE_NAME = "batch_decode_paged_kv_cpu"


def rewrite_decode_paged(name: str, func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The replacement for TVM's CPU paged decode attention (`_attention_decode_cpu`, one
    serial scalar loop over every sequence, head and key: about a fifth of a Qwen3-0.6B
    decode step at 300 tokens of context), or None when `func` is not it. The sliding-window
    variant has another name and its own rule (`rewrite_decode_paged_sliding`, below)."""
    if name != DECODE_NAME or len(func.params) != 13:
        return None
    shapes = [_shape(func, i) for i in range(13)]
    if any(s is None for s in shapes[:9]) or any(s is not None for s in shapes[9:]):
        return None
    q, pages, length = shapes[0], shapes[1], shapes[4]
    if len(q) != 3 or len(pages) != 5 or len(length) != 1:  # [B] lengths: no sliding window
        return None
    try:
        h_q, d, h_kv, page_size = int(q[1]), int(q[2]), int(pages[2]), int(pages[3])
    except TypeError:
        return None
    if str(func.params[0].dtype) not in KV_DTYPES or h_q % h_kv or d % LANES or int(pages[4]) != d:
        return None
    new = _decode_kernel(h_kv, h_q, d, page_size, softcap_of(func), str(func.params[0].dtype))
    return new.with_attrs(func.attrs) if func.attrs is not None else new


def _page_attention(d: int, page_size: int, softcap: float = 0.0):  # noqa: ANN202 - a TVMScript macro
    """The attention of one query row (`row` of q, query head `h`, KV head `hk`) over the first
    n_keys keys of a sequence whose pages start at page_values[first]: one page of keys per
    online-softmax step (scores scaled by `scale` = sm_scale * log2(e)), the q.k dot products
    and p.v updates vectorized over the head dimension; with pages of LANES keys the page's
    scores and weights come out LANES at once (`_page_scores`, `exp2_tile`). Writes output[row, h]
    and lse[row, h] (log2 units; -5e4 with no key). The decode and the paged prefill kernels
    expand it inside their parallel loops. `softcap`: each score capped before the mask and the
    max (schedules/softcap.py; 0: none)."""
    n_c = d // LANES
    neg = -5e4
    cap = capper(softcap)

    @T.macro
    def attend(q, pages, page_values, output, lse, row, h, hk, first, n_keys, scale):
        with T.sblock("attn"):
            acc = T.sblock_alloc_buffer((d,), "float32")
            part = T.sblock_alloc_buffer((LANES,), "float32")
            s = T.sblock_alloc_buffer((page_size,), "float32")
            st = T.sblock_alloc_buffer((4,), "float32")  # m, d, page max, scratch
            for i in T.vectorized(d):
                acc[i] = T.float32(0)
            st[0] = T.float32(neg)
            st[1] = T.float32(0)
            for p in T.serial((n_keys + page_size - 1) // page_size):
                page: T.let[T.int32] = page_values[first + p]
                st[2] = T.float32(neg)
                if page_size == LANES:
                    # the page's 16 scores at once (keys past n_keys masked, never summed
                    # into another key's lane), then their max
                    s[T.Ramp(0, 1, LANES)] = T.Select(
                        T.Ramp(0, 1, LANES) < T.Broadcast(n_keys - T.Cast("int32", p) * page_size, LANES),
                        cap(_page_scores(q, pages, row, h, page, hk, d) * T.Broadcast(scale, LANES)),
                        T.Broadcast(T.float32(neg), LANES))
                    for t in T.serial(page_size):
                        st[2] = T.max(st[2], s[t])
                else:
                    for t in T.serial(page_size):
                        if p * page_size + t < n_keys:
                            for j in T.vectorized(LANES):
                                part[j] = widen(q[row, h, j]) * widen(pages[page, 0, hk, t, j])
                            for c in T.unroll(1, n_c):
                                for j in T.vectorized(LANES):
                                    part[j] = part[j] + widen(q[row, h, c * LANES + j]) * widen(pages[page, 0, hk, t, c * LANES + j])
                            for j in T.vectorized(8):  # a tree, not a 16-add chain
                                part[j] = part[j] + part[j + 8]
                            for j in T.vectorized(4):
                                part[j] = part[j] + part[j + 4]
                            s[t] = cap(((part[0] + part[2]) + (part[1] + part[3])) * scale)
                            st[2] = T.max(st[2], s[t])
                if st[2] > st[0]:  # the page raised the max: rescale what is accumulated
                    st[3] = T.exp2(st[0] - st[2])
                    st[1] = st[1] * st[3]
                    for i in T.vectorized(d):
                        acc[i] = acc[i] * st[3]
                    st[0] = st[2]
                if page_size == LANES:  # the page's weights in vector registers
                    s[T.Ramp(0, 1, LANES)] = exp2_tile(s[T.Ramp(0, 1, LANES)] - T.Broadcast(st[0], LANES))
                else:
                    for t in T.serial(page_size):
                        if p * page_size + t < n_keys:
                            s[t] = T.exp2(s[t] - st[0])
                for t in T.serial(page_size):
                    if p * page_size + t < n_keys:
                        st[1] = st[1] + s[t]
                        for c in T.unroll(n_c):
                            for j in T.vectorized(LANES):
                                acc[c * LANES + j] = acc[c * LANES + j] + s[t] * widen(pages[page, 1, hk, t, c * LANES + j])
            for i in T.vectorized(d):
                output[row, h, i] = narrow(output, T.if_then_else(st[1] > T.float32(0), acc[i] / st[1], T.float32(0)))
            lse[row, h] = T.if_then_else(st[1] > T.float32(0), st[0] + T.log2(st[1]), T.float32(neg))

    return attend


def _decode_kernel(h_kv: int, h_q: int, d: int, page_size: int, softcap: float = 0.0,
                   dtype: str = "float32") -> tirx.PrimFunc:
    """Parallel over (sequence, query head); one page of keys per online-softmax step; the
    q.k dot products and p.v updates vectorized over the head dimension. With pages of 16
    keys, the page's scores and softmax weights come out 16 at once, as in the paged prefill
    kernel (`_page_scores`, `exp2_tile`): SmolLM2's 9/3 heads, 2-core Xeon, 512 keys 46 -> 29 us,
    128 keys 14 -> 10 us."""
    group = h_q // h_kv
    attend = _page_attention(d, page_size, softcap)

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv_cpu(
        q_handle: T.handle, pages_handle: T.handle, page_indptr_handle: T.handle, page_values_handle: T.handle,
        length_info_handle: T.handle, k_rope_pos_offset_handle: T.handle, q_rope_position_handle: T.handle,
        output_handle: T.handle, lse_handle: T.handle,
        rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        batch = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q = T.match_buffer(q_handle, (batch, h_q, d), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_indptr = T.match_buffer(page_indptr_handle, (batch + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(page_values_handle, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        last_page_len = T.match_buffer(length_info_handle, (batch,), "int32", elem_offset=length_info_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (batch,), "int32",  # noqa: F841
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (batch,), "int32",  # noqa: F841
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (batch, h_q, d), dtype)
        lse = T.match_buffer(lse_handle, (batch, h_q), "float32")

        T.Assert(rotary_mode == 0, "vtool's CPU decode attention takes rotary_mode 0 (rope applied before the cache)")
        for bh in T.parallel(batch * h_q):
            b: T.let[T.int32] = bh // h_q
            h: T.let[T.int32] = bh % h_q
            hk: T.let[T.int32] = h // group
            first: T.let[T.int32] = page_indptr[b]
            n_pages: T.let[T.int32] = page_indptr[b + 1] - page_indptr[b]
            n_keys: T.let[T.int32] = T.if_then_else(n_pages > 0, (n_pages - 1) * page_size + last_page_len[b], 0)
            scale: T.let[T.float32] = sm_scale * T.float32(LOG2E)
            attend(q, pages, page_values, output, lse, b, h, hk, first, n_keys, scale)

    return batch_decode_paged_kv_cpu


def _page_scores(q: tirx.Buffer, pages: tirx.Buffer, q_row: tirx.PrimExpr, h: tirx.PrimExpr, page: tirx.PrimExpr,
                 hk: tirx.PrimExpr, d: int) -> tirx.PrimExpr:
    """float32x16, lane t = q[q_row, h] . key t of `page` (a page of LANES keys)."""
    return _scores(q, q_row, h, d, lambda t, c: vload32(pages, [page, 0, hk, t, c * LANES]))


def _ragged_scores(q: tirx.Buffer, k: tirx.Buffer, q_row: tirx.PrimExpr, h: tirx.PrimExpr, hk: tirx.PrimExpr,
                   first: tirx.PrimExpr, last: tirx.PrimExpr, d: int) -> tirx.PrimExpr:
    """float32x16, lane t = q[q_row, h] . k[min(first + t, last), hk] (ragged keys [rows, heads, d])."""
    return _scores(q, q_row, h, d, lambda t, c: vload32(k, [T.min(first + t, last), hk, c * LANES]))


def _scores(q: tirx.Buffer, q_row: tirx.PrimExpr, h: tirx.PrimExpr, d: int, key) -> tirx.PrimExpr:  # noqa: ANN001
    """float32x16, lane t = q[q_row, h] . key t (see dot_tile)."""
    return dot_tile(lambda c: vload32(q, [q_row, h, c * LANES]), key, d)


def dot_tile(query, key, d: int) -> tirx.PrimExpr:  # noqa: ANN001 - loaders of float32x16 vectors
    """float32x16, lane t = query . key t, where query(c) and key(t, c) load lanes c*16 .. c*16 + 15
    of the query and of key t (see sum_tile)."""
    return sum_tile(lambda t, c: query(c) * key(t, c), d)


def sum_tile(term, d: int) -> tirx.PrimExpr:  # noqa: ANN001 - term(t, c): a float32x16 of key t's lanes c*16..
    """float32x16, lane t = the sum over c < d / 16 of every lane of term(t, c) (a dot product's
    products for key t): each key's terms summed into one vector, then the 16 vectors reduced
    together by a transpose-and-add tree (4 levels of two shuffles and an add), in place of a
    horizontal sum per key. A lane only ever adds values of its own key."""
    n_c = d // LANES
    vt = f"float32x{LANES}"
    bindings = []  # (var, value): each vector computed once (TIR would repeat a shared subexpression)
    vecs = []
    for t in range(LANES):
        v = None
        for c in range(n_c):
            product = term(t, c)
            v = product if v is None else v + product
        var = tirx.Var(f"dot{t}", vt)
        bindings.append((var, v))
        vecs.append(var)
    width = LANES  # partial sums per key in each vector
    level = 0
    while width > 1:
        half = width // 2
        # a pair holds keys A (lanes 0..15) and B (16..31) in groups of `width` partials per key;
        # keep the first and second halves of every group, add them
        lo = [g * width + i for g in range(2 * LANES // width) for i in range(half)]
        hi = [i + half for i in lo]
        summed = []
        for i in range(0, len(vecs), 2):
            var = tirx.Var(f"sum{level}_{i // 2}", vt)
            bindings.append((var, T.Shuffle([vecs[i], vecs[i + 1]], lo) + T.Shuffle([vecs[i], vecs[i + 1]], hi)))
            summed.append(var)
        vecs, width, level = summed, half, level + 1
    result = vecs[0]
    for var, value in reversed(bindings):
        result = tirx.Let(var, value, result)
    return result


# 2^f on [-1/2, 1/2] (Cephes exp2f): 1 + f * P(f), relative error below 2e-7
_EXP2_P = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2,
           2.402264791363012e-1, 6.931472028550421e-1)


def exp2_tile(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """2^x for a float32x16 of x <= 0 (softmax weights), in vector registers: x = n + f with
    n = round(x), |f| <= 1/2, 2^f by Cephes' polynomial, 2^n put in the exponent bits. Within
    2 ulp of exp2f; x below -126 gives 2^-126 (the weight of a key 126 binary orders below the
    max: nothing, in a float32 sum that holds 1). One libm call per key made the scalar loop
    spill every vector register around it."""
    lanes = LANES
    xv = tirx.Var("e2x", f"float32x{lanes}")
    nv = tirx.Var("e2n", f"float32x{lanes}")
    fv = tirx.Var("e2f", f"float32x{lanes}")
    poly = T.Broadcast(T.float32(_EXP2_P[0]), lanes)
    for c in _EXP2_P[1:]:
        poly = poly * fv + T.Broadcast(T.float32(c), lanes)
    two_f = poly * fv + T.Broadcast(T.float32(1.0), lanes)
    two_n = T.reinterpret(f"float32x{lanes}", T.shift_left(
        T.Cast(f"int32x{lanes}", nv) + T.Broadcast(T.int32(127), lanes), T.Broadcast(T.int32(23), lanes)))
    body = tirx.Let(fv, xv - nv, two_f * two_n)
    body = tirx.Let(nv, T.floor(xv + T.Broadcast(T.float32(0.5), lanes)), body)
    return tirx.Let(xv, T.max(x, T.Broadcast(T.float32(-126.0), lanes)), body)


PAGED_PREFILL_NAME = "batch_prefill_paged_kv_cpu"


def rewrite_prefill_paged(name: str, func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The replacement for TVM's CPU paged prefill attention (`_attention_prefill_cpu`: the
    attention of a chunk's queries over keys already in the cache, as in chunked prefill, a
    prefix-cache hit and speculative verification), or None when `func` is not it.

    TVM's kernel is serial and scalar, and it walks max_num_pages * page_size key slots for
    every (head, query), i.e. the whole page pool, skipping the ones past the sequence: on
    SmolLM2-135M with a 2048-token cache a 5-token verify step spent 22 ms of its 50 ms there
    (30 layers). This one visits only the visible keys of each query, page by page, in
    parallel over (query, head), with the decode kernel's vectorized dot products and
    online softmax. The sliding-window variant has another name and its own rule
    (`rewrite_prefill_paged_sliding`, below)."""
    if name != PAGED_PREFILL_NAME or len(func.params) != 15:
        return None
    shapes = [_shape(func, i) for i in range(15)]
    if any(s is None for s in shapes[:10]) or any(s is not None for s in shapes[10:]):
        return None
    q, pages, length = shapes[0], shapes[2], shapes[5]
    if len(q) != 3 or len(pages) != 5 or len(length) != 1:  # [B] lengths: no sliding window
        return None
    try:
        h_q, d, h_kv, page_size = int(q[1]), int(q[2]), int(pages[2]), int(pages[3])
    except TypeError:
        return None
    if str(func.params[0].dtype) not in KV_DTYPES or h_q % h_kv or d % LANES or int(pages[4]) != d:
        return None
    new = _paged_prefill_kernel(h_kv, h_q, d, page_size, softcap_of(func), str(func.params[0].dtype))
    return new.with_attrs(func.attrs) if func.attrs is not None else new


def _paged_prefill_kernel(h_kv: int, h_q: int, d: int, page_size: int, softcap: float = 0.0,
                          dtype: str = "float32") -> tirx.PrimFunc:
    """Per sequence, parallel over its (query, head) pairs; query i of n sees the first
    kv_len - n + i + 1 keys when causal (TVM's mask), all kv_len otherwise. One page of keys
    per online-softmax step, as the decode kernel."""
    group = h_q // h_kv
    attend = _page_attention(d, page_size, softcap)

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_cpu(
        var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
        var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        last_page_len = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=length_info_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",  # noqa: F841
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",  # noqa: F841
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")

        T.Assert(rotary_mode == 0, "vtool's CPU paged prefill attention takes rotary_mode 0 (rope applied before the cache)")
        for b in T.serial(batch_size):
            for qh in T.parallel((q_indptr[b + 1] - q_indptr[b]) * h_q):
                n_q: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                q_idx: T.let[T.int32] = _balanced(qh // h_q, n_q)
                h: T.let[T.int32] = qh % h_q
                hk: T.let[T.int32] = h // group
                q_row: T.let[T.int32] = q_indptr[b] + q_idx
                first: T.let[T.int32] = page_indptr[b]
                n_pages: T.let[T.int32] = page_indptr[b + 1] - page_indptr[b]
                n_kv: T.let[T.int32] = T.if_then_else(n_pages > 0, (n_pages - 1) * page_size + last_page_len[b], 0)
                n_keys: T.let[T.int32] = T.if_then_else(causal > 0, T.max(T.min(n_kv - n_q + q_idx + 1, n_kv), 0),
                                                        n_kv)
                scale: T.let[T.float32] = sm_scale * T.float32(LOG2E)
                attend(q, pages, page_values, output, lse, q_row, h, hk, first, n_keys, scale)

    return batch_prefill_paged_kv_cpu


ROPE_BLOCK = "llama_fused_rope"


def schedule_fused_rope(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """TVM's rotary embedding of the KV cache (`llama_rope_with_position_map`: q and k rotated,
    v copied, for every (position, fused head, dim)) arrives unscheduled: one serial loop that
    calls powf, cosf and sinf for every element, though they depend on (position, dim) only.
    Here the head loop goes innermost and is unrolled, so that the heads' identical pure calls
    are one call after LLVM's common-subexpression elimination; the dims go in two unrolled
    halves (d and d + head_dim / 2 rotate by the same angle). The expressions are untouched (the
    same results, bit for bit). A decode step's single position runs on one thread: waking the
    pool for its 32 angles cost more than computing them (SmolLM2-135M's 15 fused heads of 64,
    2-core Xeon at 2.0 GHz: 5.2-8.2 -> 1.9 us a layer, 30 layers a step); more positions run in
    parallel over (position, dim), as before this split (5 positions 58 -> 12 us a layer, 64
    positions 707 -> 106 us, against the serial loop). None when `func` has no such block."""
    serial, parallel = _rope_loops(func, parallel=False), _rope_loops(func, parallel=True)
    positions = getattr(func.params[0], "shape", None)
    if serial is None or parallel is None or not positions:
        return None
    one, many = serial.body, _fresh_lets(parallel).body
    block = one.block
    body = tirx.IfThenElse(positions[0] == 1, block.body, many.block.body)
    block = s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body, block.init,
                         block.alloc_buffers, block.match_buffers, block.annotations)
    return serial.with_body(s_tir.SBlockRealize(one.iter_values, one.predicate, block))


def _fresh_lets(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with a new variable for each let: a rope scaling's lets (orig_freq, ...) would
    otherwise be bound in both of schedule_fused_rope's branches, to different loop
    expressions, which TVM's simplifier refuses."""
    def fresh(let: tirx.Let) -> tirx.Let:
        new = tirx.Var(let.var.name, str(let.var.ty))
        body = tvm_ffi.structural_map(let.body, [(tvm.ir.Var, lambda v: new if v.same_as(let.var) else v)])
        return tirx.Let(new, let.value, body)

    return tvm_ffi.structural_map(func, [(tirx.Let, fresh)])


def _rope_loops(func: tirx.PrimFunc, parallel: bool) -> tirx.PrimFunc | None:
    """The rope kernel's loops as schedule_fused_rope says, (position, dim) in parallel or not."""
    try:
        sch = s_tir.Schedule(func)
        block = sch.get_sblock(ROPE_BLOCK)
    except Exception:  # noqa: BLE001 - no block of that name: not the rope kernel
        return None
    loops = sch.get_loops(block)
    if len(loops) != 3 or not isinstance(sch.get(loops[2]).extent, tirx.IntImm) or int(sch.get(loops[2]).extent) % 2:
        return None
    position, head, dim = loops
    half, inner = sch.split(dim, [2, None])
    sch.reorder(position, inner, half, head)
    sch.unroll(head)
    sch.unroll(half)
    if parallel:
        sch.parallel(sch.fuse(position, inner))
    return sch.mod["main"]


# --- sliding-window layers (per-layer "mha_sliding" KV-cache layers: models/decoder.py) ---
#
# TVM's `_attention_prefill_cpu` / `_attention_decode_cpu` with sliding_window=True
# (relax/frontend/nn/llm/_prefill_kernels.py, _decode_kernels.py, _kernel_common.py) differ
# from the full-attention ones in three places, reproduced here exactly:
#   * length_info is [3, B]: (last_page_len, sliding_window_offset, sink_size) per sequence;
#   * a sequence's keys are kv_len = (n_pages - 1) * page_size + last_page_len - offset + sink
#     logical positions, position `pos` stored at slot pos (pos < sink) or pos - sink + offset
#     (the attention sink first, then the window, which starts `offset` slots into the pages);
#   * the paged prefill's mask (`_causal_or_sliding_cross_mask`): when causal, query i of the
#     chunk sees the last max(W - i - 1, 0) of those kv_len cached keys (W: the layer's window,
#     a constant of the kernel); its own chunk's keys come from the ragged kernel, which is
#     causal only (runtime/engine/kv_cache.py: prompts are fed at most W tokens a step). Not
#     causal: all kv_len keys. The decode kernel attends over all kv_len keys (the cache's
#     offset is the window).
# A query with no visible key gets output 0 and lse -5e4, as the full-attention kernels here;
# TVM's serial kernel leaves another finite output with an lse of about -5e4 there, which the
# merge with the chunk's own attention weighs by exp2(-5e4 - lse) = 0 all the same.

SLIDING_PREFILL_NAME = "batch_prefill_paged_kv_cpu_sliding_window"
SLIDING_DECODE_NAME = "batch_decode_paged_kv_cpu_sliding_window"
_WINDOW = re.compile(r"T\.max\((\d+) - q_idx - 1, 0\)")


def _window_page_attention(d: int, page_size: int, softcap: float = 0.0):  # noqa: ANN202 - a TVMScript macro
    """`_page_attention` over two segments of a sliding-window sequence's slots, [lo0, hi0) (the
    sink's) and [lo1, hi1) (the window's), one online softmax over both, page by page, the slots
    outside a segment masked. The callers compute the bounds outside the macro's block (TIR's
    block regions take no variable bound inside the block). `softcap` as `_page_attention`'s."""
    n_c = d // LANES
    neg = -5e4
    cap = capper(softcap)

    @T.macro
    def segment(q, pages, page_values, row, h, hk, first, s_lo, s_hi, scale, acc, part, s, st):
        for p in T.serial(s_lo // page_size, T.max((s_hi + page_size - 1) // page_size, s_lo // page_size)):
            page: T.let[T.int32] = page_values[first + p]
            st[2] = T.float32(neg)
            if page_size == LANES:
                s[T.Ramp(0, 1, LANES)] = T.Select(
                    T.Ramp(0, 1, LANES) < T.Broadcast(s_hi - p * page_size, LANES),
                    T.Select(T.Ramp(0, 1, LANES) >= T.Broadcast(s_lo - p * page_size, LANES),
                             cap(_page_scores(q, pages, row, h, page, hk, d) * T.Broadcast(scale, LANES)),
                             T.Broadcast(T.float32(neg), LANES)),
                    T.Broadcast(T.float32(neg), LANES))
                for t in T.serial(page_size):
                    st[2] = T.max(st[2], s[t])
            else:
                for t in T.serial(page_size):
                    if p * page_size + t >= s_lo and p * page_size + t < s_hi:
                        for j in T.vectorized(LANES):
                            part[j] = widen(q[row, h, j]) * widen(pages[page, 0, hk, t, j])
                        for c in T.unroll(1, n_c):
                            for j in T.vectorized(LANES):
                                part[j] = part[j] + widen(q[row, h, c * LANES + j]) * widen(pages[page, 0, hk, t, c * LANES + j])
                        for j in T.vectorized(8):
                            part[j] = part[j] + part[j + 8]
                        for j in T.vectorized(4):
                            part[j] = part[j] + part[j + 4]
                        s[t] = cap(((part[0] + part[2]) + (part[1] + part[3])) * scale)
                        st[2] = T.max(st[2], s[t])
            if st[2] > st[0]:
                st[3] = T.exp2(st[0] - st[2])
                st[1] = st[1] * st[3]
                for i in T.vectorized(d):
                    acc[i] = acc[i] * st[3]
                st[0] = st[2]
            if page_size == LANES:
                s[T.Ramp(0, 1, LANES)] = exp2_tile(s[T.Ramp(0, 1, LANES)] - T.Broadcast(st[0], LANES))
            else:
                for t in T.serial(page_size):
                    if p * page_size + t >= s_lo and p * page_size + t < s_hi:
                        s[t] = T.exp2(s[t] - st[0])
            for t in T.serial(page_size):
                if p * page_size + t >= s_lo and p * page_size + t < s_hi:  # masked slots never summed
                    st[1] = st[1] + s[t]
                    for c in T.unroll(n_c):
                        for j in T.vectorized(LANES):
                            acc[c * LANES + j] = acc[c * LANES + j] + s[t] * widen(pages[page, 1, hk, t, c * LANES + j])

    @T.macro
    def attend(q, pages, page_values, output, lse, row, h, hk, first, lo0, hi0, lo1, hi1, scale):
        with T.sblock("attn"):
            acc = T.sblock_alloc_buffer((d,), "float32")
            part = T.sblock_alloc_buffer((LANES,), "float32")
            s = T.sblock_alloc_buffer((page_size,), "float32")
            st = T.sblock_alloc_buffer((4,), "float32")  # m, d, page max, scratch
            for i in T.vectorized(d):
                acc[i] = T.float32(0)
            st[0] = T.float32(neg)
            st[1] = T.float32(0)
            segment(q, pages, page_values, row, h, hk, first, lo0, hi0, scale, acc, part, s, st)
            segment(q, pages, page_values, row, h, hk, first, lo1, hi1, scale, acc, part, s, st)
            for i in T.vectorized(d):
                output[row, h, i] = narrow(output, T.if_then_else(st[1] > T.float32(0), acc[i] / st[1], T.float32(0)))
            lse[row, h] = T.if_then_else(st[1] > T.float32(0), st[0] + T.log2(st[1]), T.float32(neg))

    return attend


def _sliding_shapes(func: tirx.PrimFunc, n_params: int, n_buffers: int, q_at: int, pages_at: int,
                    length_at: int) -> tuple[int, int, int, int] | None:
    """(h_q, d, h_kv, page_size) of a TVM sliding-window kernel of the expected layout, or None."""
    if len(func.params) != n_params:
        return None
    shapes = [_shape(func, i) for i in range(n_params)]
    if any(s is None for s in shapes[:n_buffers]) or any(s is not None for s in shapes[n_buffers:]):
        return None
    q, pages, length = shapes[q_at], shapes[pages_at], shapes[length_at]
    if len(q) != 3 or len(pages) != 5 or len(length) != 2:  # [3, B] length info: sliding window
        return None
    try:
        h_q, d, h_kv, page_size, three = int(q[1]), int(q[2]), int(pages[2]), int(pages[3]), int(length[0])
    except TypeError:
        return None
    if three != 3 or str(func.params[0].dtype) not in KV_DTYPES or h_q % h_kv or d % LANES or int(pages[4]) != d:
        return None
    return h_q, d, h_kv, page_size


def rewrite_prefill_paged_sliding(name: str, func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The replacement for TVM's CPU sliding-window paged prefill attention (serial and scalar,
    and reading an uninitialized running maximum: schedules/cpu/sliding_attention.py), or None
    when `func` is not it. The window is read from the kernel's mask, where TVM writes it as a
    constant; a kernel without exactly one is left alone."""
    if name != SLIDING_PREFILL_NAME:
        return None
    dims = _sliding_shapes(func, 15, 10, 0, 2, 5)
    if dims is None:
        return None
    windows = set(_WINDOW.findall(func.script()))
    if len(windows) != 1:
        return None
    new = _sliding_prefill_kernel(dims[2], dims[0], dims[1], dims[3], int(windows.pop()), softcap_of(func),
                                  str(func.params[0].dtype))
    return new.with_attrs(func.attrs) if func.attrs is not None else new


def _sliding_prefill_kernel(h_kv: int, h_q: int, d: int, page_size: int, window: int,
                            softcap: float = 0.0, dtype: str = "float32") -> tirx.PrimFunc:
    group = h_q // h_kv
    attend = _window_page_attention(d, page_size, softcap)

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_cpu_sliding_window(
        var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
        var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        length_info = T.match_buffer(var_length_info, (3, batch_size), "int32", elem_offset=length_info_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",  # noqa: F841
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",  # noqa: F841
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")

        T.Assert(rotary_mode == 0, "vtool's CPU paged prefill attention takes rotary_mode 0 (rope applied before the cache)")
        for b in T.serial(batch_size):
            for qh in T.parallel((q_indptr[b + 1] - q_indptr[b]) * h_q):
                q_idx: T.let[T.int32] = qh // h_q
                h: T.let[T.int32] = qh % h_q
                hk: T.let[T.int32] = h // group
                q_row: T.let[T.int32] = q_indptr[b] + q_idx
                first: T.let[T.int32] = page_indptr[b]
                n_pages: T.let[T.int32] = page_indptr[b + 1] - page_indptr[b]
                sink: T.let[T.int32] = length_info[2, b]
                offset: T.let[T.int32] = length_info[1, b]
                n_kv: T.let[T.int32] = T.if_then_else(
                    n_pages > 0, (n_pages - 1) * page_size + length_info[0, b] - offset + sink, 0)
                lo: T.let[T.int32] = T.if_then_else(causal > 0, T.max(n_kv - T.max(window - q_idx - 1, 0), 0), 0)
                scale: T.let[T.float32] = sm_scale * T.float32(LOG2E)
                # logical [lo, n_kv): the sink's slots, then the window's from `offset`
                attend(q, pages, page_values, output, lse, q_row, h, hk, first, T.min(lo, sink), T.min(n_kv, sink),
                       T.max(lo, sink) - sink + offset, T.max(n_kv, sink) - sink + offset, scale)

    return batch_prefill_paged_kv_cpu_sliding_window


def rewrite_decode_paged_sliding(name: str, func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The replacement for TVM's CPU sliding-window paged decode attention, or None when `func`
    is not it."""
    if name != SLIDING_DECODE_NAME:
        return None
    dims = _sliding_shapes(func, 13, 9, 0, 1, 4)
    if dims is None:
        return None
    new = _sliding_decode_kernel(dims[2], dims[0], dims[1], dims[3], softcap_of(func), str(func.params[0].dtype))
    return new.with_attrs(func.attrs) if func.attrs is not None else new


def _sliding_decode_kernel(h_kv: int, h_q: int, d: int, page_size: int, softcap: float = 0.0,
                           dtype: str = "float32") -> tirx.PrimFunc:
    group = h_q // h_kv
    attend = _window_page_attention(d, page_size, softcap)

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv_cpu_sliding_window(
        q_handle: T.handle, pages_handle: T.handle, page_indptr_handle: T.handle, page_values_handle: T.handle,
        length_info_handle: T.handle, k_rope_pos_offset_handle: T.handle, q_rope_position_handle: T.handle,
        output_handle: T.handle, lse_handle: T.handle,
        rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        batch = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q = T.match_buffer(q_handle, (batch, h_q, d), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_indptr = T.match_buffer(page_indptr_handle, (batch + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(page_values_handle, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        length_info = T.match_buffer(length_info_handle, (3, batch), "int32", elem_offset=length_info_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (batch,), "int32",  # noqa: F841
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (batch,), "int32",  # noqa: F841
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (batch, h_q, d), dtype)
        lse = T.match_buffer(lse_handle, (batch, h_q), "float32")

        T.Assert(rotary_mode == 0, "vtool's CPU decode attention takes rotary_mode 0 (rope applied before the cache)")
        for bh in T.parallel(batch * h_q):
            b: T.let[T.int32] = bh // h_q
            h: T.let[T.int32] = bh % h_q
            hk: T.let[T.int32] = h // group
            first: T.let[T.int32] = page_indptr[b]
            n_pages: T.let[T.int32] = page_indptr[b + 1] - page_indptr[b]
            sink: T.let[T.int32] = length_info[2, b]
            offset: T.let[T.int32] = length_info[1, b]
            n_kv: T.let[T.int32] = T.if_then_else(
                n_pages > 0, (n_pages - 1) * page_size + length_info[0, b] - offset + sink, 0)
            scale: T.let[T.float32] = sm_scale * T.float32(LOG2E)
            attend(q, pages, page_values, output, lse, b, h, hk, first, 0, T.min(n_kv, sink), offset,
                   T.max(n_kv, sink) - sink + offset, scale)

    return batch_decode_paged_kv_cpu_sliding_window
