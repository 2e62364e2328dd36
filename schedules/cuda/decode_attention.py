"""Split-KV paged decode attention for CUDA (one query token per sequence).

TVM's TIR decode kernel gives each (sequence, KV head) one thread block that walks the
whole context. At batch 1 an 8B Llama runs 8 blocks on the H200's 132 SMs: 14 us per
layer at 144 tokens of context (profiled), growing linearly with the context. This kernel
splits each sequence's context into NUM_SPLITS parts over (sequence, query head, split)
blocks, four warps per block taking tokens in turn, then merges the parts in a second
kernel with the usual log-sum-exp rule. It has the same signature as TVM's
`batch_decode_paged_kv`, so the KV cache calls it in that kernel's place
(`replace_decode_attention`).

Scores are kept in log2 units (q is scaled by sm_scale * log2(e)) and `lse` is written in
the same units, as TVM's kernels do, because the KV cache merges attention states from
different kernels with that convention. The cache is created with RopeMode.NORMAL (rope is
applied before K is stored), so `rotary_mode` is always 0 here and no inline rope is done.
"""
from __future__ import annotations

import math

import tvm
from tvm.script import tirx as T

from vtool.schedules.cuda import grouped_decode_attention as grouped
from vtool.schedules.softcap import capper, softcap_of

DECODE_SYMBOL = "batch_decode_paged_kv"  # the symbol of TVM's kernel this one replaces
WARPS = 4
LANES = 32
# Blocks to aim for: about four per SM of a 132-SM H100/H200. The split count used at run
# time is the smallest that reaches this for the batch at hand (so a large batch splits
# little and writes few partial states), and no split gets fewer than MIN_CHUNK tokens.
TARGET_BLOCKS = 512
MIN_CHUNK = 8


def num_splits(num_qo_heads: int) -> int:
    """The grid's split dimension: a power of two with num_qo_heads * splits >=
    TARGET_BLOCKS, at most 32 (batch 1; larger batches use fewer of them)."""
    splits = 1
    while num_qo_heads * splits < TARGET_BLOCKS and splits < 32:
        splits *= 2
    return splits


def split_kv_macros(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str,
                    page_size: int = 16, softcap: float = 0.0) -> tuple[object, object, int]:
    """The two halves of split-KV paged attention for one query row, as TVMScript macros any
    kernel with this layout expands (this decode kernel; short_prefill_attention.py's), and
    the split count S:

    partial(Q, row, head, split, pages, page_values, page_begin, kv_len, grid_rows, part_o,
    part_m, part_d, sm_scale, ty, tx): inside a block of WARPS x LANES threads, row `row` of
    Q (query head `head`) against the first kv_len tokens of the sequence whose pages start
    at page_values[page_begin]: this split's share, written as a partial state. grid_rows is
    rows x query heads in the grid (the split count in use follows it).

    merge(part_o, part_m, part_d, row, head, output, lse, tx): the S partial states of one
    (row, head) into output and lse, by one warp.

    softcap: each score soft-capped once the warp has summed it, before the running max
    (schedules/softcap.py; 0: none, and no code for it)."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    GROUP = H_qo // H_kv
    V = D // LANES  # elements of a head each lane owns
    S = num_splits(H_qo)
    LOG2E = math.log2(math.e)
    capping, cap = bool(softcap), capper(softcap)

    # pylint: disable=too-many-locals,too-many-statements
    @T.macro
    def partial(Q, row, head, split, pages, page_table_values, page_begin, kv_len, grid_rows, part_o, part_m,
                part_d, sm_scale, ty, tx):
        q_local = T.sblock_alloc_buffer((V,), "float32", scope="local")
        o_local = T.sblock_alloc_buffer((V,), "float32", scope="local")
        st = T.sblock_alloc_buffer((2,), "float32", scope="local")  # m, d
        dot = T.sblock_alloc_buffer((1,), "float32", scope="local")
        score = T.sblock_alloc_buffer((1,), "float32", scope="local")
        o_smem = T.sblock_alloc_buffer((WARPS, D), "float32", scope="shared")
        md_smem = T.sblock_alloc_buffer((WARPS, 2), "float32", scope="shared")
        merged = T.sblock_alloc_buffer((2,), "float32", scope="local")
        where = T.sblock_alloc_buffer((2,), "int32", scope="local")  # page, offset

        kv_head: T.let[T.int32] = head // GROUP
        splits: T.let[T.int32] = T.max(1, T.min(
            S, T.min(T.ceildiv(TARGET_BLOCKS, grid_rows), T.ceildiv(kv_len, MIN_CHUNK))))
        chunk: T.let[T.int32] = T.ceildiv(kv_len, splits)
        start: T.let[T.int32] = split * chunk
        end: T.let[T.int32] = T.min(start + chunk, kv_len)

        for v in T.serial(V):
            q_local[v] = T.cast(Q[row, head, tx * V + v], "float32") * sm_scale * LOG2E
            o_local[v] = T.float32(0)
        st[0] = T.float32(-5e4)
        st[1] = T.float32(0)

        for it in T.serial(T.ceildiv(T.max(end - start, 0), WARPS)):
            pos: T.let[T.int32] = start + it * WARPS + ty
            dot[0] = T.float32(0)
            if pos < end:
                where[0] = page_table_values[page_begin + T.floordiv(pos, page_size)]
                where[1] = T.floormod(pos, page_size)
                for v in T.serial(V):
                    dot[0] += q_local[v] * T.cast(pages[where[0], 0, kv_head, where[1], tx * V + v], "float32")
            # every lane of the warp takes part, inside the range or not
            with T.sblock("lane_sum"):
                T.reads(dot[0])
                T.writes(score[0])
                T.attr(T.comm_reducer(lambda a, b: a + b, [T.float32(0)]), "reduce_scope", T.int32(0))
                T.tvm_thread_allreduce(T.uint32(1), dot[0], True, score[0], tx, dtype="void")
            if pos < end:
                if capping:  # a Python bool: the statement exists only in capped kernels
                    score[0] = cap(score[0])
                m_new: T.let[T.float32] = T.max(st[0], score[0])
                rescale: T.let[T.float32] = T.exp2(st[0] - m_new)
                p: T.let[T.float32] = T.exp2(score[0] - m_new)
                st[1] = st[1] * rescale + p
                for v in T.serial(V):
                    o_local[v] = o_local[v] * rescale + p * T.cast(
                        pages[where[0], 1, kv_head, where[1], tx * V + v], "float32")
                st[0] = m_new

        # merge the warps' states, then write this split's part
        for v in T.serial(V):
            o_smem[ty, tx * V + v] = o_local[v]
        if tx == 0:
            md_smem[ty, 0] = st[0]
            md_smem[ty, 1] = st[1]
        T.tvm_storage_sync("shared")
        if ty == 0:
            merged[0] = md_smem[0, 0]
            for w in T.serial(1, WARPS):
                merged[0] = T.max(merged[0], md_smem[w, 0])
            merged[1] = T.float32(0)
            for w in T.serial(WARPS):
                merged[1] += md_smem[w, 1] * T.exp2(md_smem[w, 0] - merged[0])
            for v in T.serial(V):
                o_local[v] = T.float32(0)
                for w in T.serial(WARPS):
                    o_local[v] += o_smem[w, tx * V + v] * T.exp2(md_smem[w, 0] - merged[0])
                part_o[row, head, split, tx * V + v] = o_local[v]
            if tx == 0:
                part_m[row, head, split] = merged[0]
                part_d[row, head, split] = merged[1]
        # (a block past the splits in use finds an empty range and
        # writes an empty state: m = -5e4, d = 0, o = 0)

    @T.macro
    def merge(part_o, part_m, part_d, row, head, output, lse, tx):
        acc = T.sblock_alloc_buffer((V,), "float32", scope="local")
        md = T.sblock_alloc_buffer((2,), "float32", scope="local")
        # Every block of the partial kernel wrote a state (an empty one past the splits in
        # use), so all S are read, in unrolled loops whose loads can all be in flight at once.
        md[0] = part_m[row, head, 0]
        for s in T.unroll(1, S):
            md[0] = T.max(md[0], part_m[row, head, s])
        md[1] = T.float32(0)
        for v in T.serial(V):
            acc[v] = T.float32(0)
        for s in T.unroll(S):
            weight: T.let[T.float32] = T.exp2(part_m[row, head, s] - md[0])
            md[1] += part_d[row, head, s] * weight
            for v in T.serial(V):
                acc[v] += part_o[row, head, s, tx * V + v] * weight
        for v in T.serial(V):
            output[row, head, tx * V + v] = T.cast(T.if_then_else(md[1] > 0, acc[v] / md[1], T.float32(0)), dtype)
        if tx == 0:
            lse[row, head] = T.if_then_else(md[1] > 0, md[0] + T.log2(md[1]), T.float32(-5e4))

    return partial, merge, S


def split_kv_decode(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str,
                    page_size: int = 16, softcap: float = 0.0) -> tvm.tirx.PrimFunc:
    if head_dim % LANES or head_dim > 256:
        raise ValueError(f"split-KV decode needs head_dim a multiple of {LANES} up to 256, got {head_dim}")
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    partial, merge, S = split_kv_macros(H_kv, H_qo, D, dtype, page_size, softcap)

    # pylint: disable=too-many-locals
    @T.prim_func(s_tir=True)
    def decode(
        Q_handle: T.handle,
        pages_handle: T.handle,
        page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle,
        var_length_info: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": DECODE_SYMBOL})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        pages_elem_offset = T.int64()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()

        Q = T.match_buffer(Q_handle, (B, H_qo, D), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, H_kv, page_size, D), dtype,
                               elem_offset=pages_elem_offset)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32",
                                           elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32",
                                           elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (B, H_qo, D), dtype)
        lse = T.match_buffer(lse_handle, (B, H_qo), "float32")
        # last page's length per sequence (no sliding window: the cache is built without it)
        length_info = T.match_buffer(var_length_info, (B,), "int32", elem_offset=length_info_elem_offset)

        part_o = T.alloc_buffer((B, H_qo, S, D), "float32")
        part_m = T.alloc_buffer((B, H_qo, S), "float32")
        part_d = T.alloc_buffer((B, H_qo, S), "float32")

        # Kernel 1: one block per (sequence, query head, split); warp w takes the split's
        # tokens w, w + WARPS, ...; each lane owns V elements of the head.
        for bx in T.thread_binding(B, thread="blockIdx.x"):
            for by in T.thread_binding(H_qo, thread="blockIdx.y"):
                for bz in T.thread_binding(S, thread="blockIdx.z"):
                    for ty in T.thread_binding(WARPS, thread="threadIdx.y"):
                        for tx in T.thread_binding(LANES, thread="threadIdx.x"):
                            with T.sblock("partial"):
                                page_begin: T.let[T.int32] = page_table_indptr[bx]
                                num_pages: T.let[T.int32] = page_table_indptr[bx + 1] - page_begin
                                kv_len: T.let[T.int32] = T.if_then_else(
                                    num_pages > 0, (num_pages - 1) * page_size + length_info[bx], 0)
                                partial(Q, bx, by, bz, pages, page_table_values, page_begin, kv_len, B * H_qo,
                                        part_o, part_m, part_d, sm_scale, ty, tx)

        # Kernel 2: merge the splits of each (sequence, query head).
        for bx in T.thread_binding(B, thread="blockIdx.x"):
            for by in T.thread_binding(H_qo, thread="blockIdx.y"):
                for tx in T.thread_binding(LANES, thread="threadIdx.x"):
                    with T.sblock("merge"):
                        merge(part_o, part_m, part_d, bx, by, output, lse, tx)

    return decode


def _shapes_of(func: tvm.tirx.PrimFunc) -> tuple[int, int, int, str]:
    """(num_kv_heads, num_qo_heads, head_dim, dtype) of a TVM decode kernel, read from its
    Q[B, H_qo, D] and pages[P, 2, H_kv, page, D] buffers."""
    q, pages = func.params[0].ty, func.params[1].ty  # buffer types in TVM 0.27's unified IR
    return int(pages.shape[2]), int(q.shape[1]), int(q.shape[2]), str(q.dtype)


def replace_decode_attention(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """Put a split-KV kernel in place of TVM's `batch_decode_paged_kv` PrimFunc in `mod` (the
    KV cache refers to it by GlobalVar, so the cache then calls the new kernel): the grouped
    one (grouped_decode_attention.py) where its layout takes the shapes, else split_kv_decode. The
    sliding-window variant has another symbol and stays. TVM's kernel's attention logit
    soft-cap (models/softcap.py's attribute) goes to the new one. Returns the module and how
    many kernels were replaced."""
    replaced = 0
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None and \
                func.attrs.get("global_symbol") == DECODE_SYMBOL:
            kv_heads, qo_heads, head_dim, dtype = _shapes_of(func)
            page_size = int(func.params[1].ty.shape[3])
            if grouped.layout(kv_heads, qo_heads, head_dim, dtype) is not None:
                # one block per KV head for its whole query group (grouped_decode_attention.py)
                mod[gvar] = grouped.grouped_decode(kv_heads, qo_heads, head_dim, dtype, page_size, softcap_of(func),
                                                   DECODE_SYMBOL)
            elif head_dim % LANES or head_dim > 256:
                continue  # lanes own head_dim / 32 elements each: keep TVM's kernel
            else:
                mod[gvar] = split_kv_decode(kv_heads, qo_heads, head_dim, dtype, page_size, softcap_of(func))
            replaced += 1
    return mod, replaced


def decode_attention_pass() -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name="VtoolSplitKVDecodeAttention")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return replace_decode_attention(mod)[0]

    return _pass
