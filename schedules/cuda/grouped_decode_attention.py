"""Split-KV paged decode attention for CUDA that reads each KV head once for its whole query group.

decode_attention.py's first kernel gives each (sequence, query head, split) a block, so with
grouped-query attention every K/V row is fetched once per query head of its group (four
times on Llama-3-8B), one 4- or 8-byte load per lane and token, and the grid always holds
every split: at 64 sequences the 8B shape launched 32,768 blocks a layer, 30,720 of them only
to write an empty state. Profiled on the H200 at 64 served users (129-256 tokens of context)
it ran at about 0.7 TB/s of KV, 2.2 ms of a 7.9 ms step.

This kernel:

* gives each (sequence, KV head, split) one block of THREADS threads and computes every
  query head of the group from the same K/V loads;
* splits the head dim into VEC-element pieces read with 16-byte loads: TL = D / VEC threads
  hold one token's row, so a block holds THREADS / TL token groups, each taking UNROLL
  consecutive tokens at once (their loads all in flight together);
* sums a score over its TL threads with xor shuffles (no shared memory), keeps an online
  softmax per (group, head) in registers and merges the groups through shared memory;
* sizes the split dimension of the grid on the host from the batch (enough blocks to fill the
  GPU, never more); a sequence uses as many of them as its length fills (at least one
  iteration of the block's token groups each), and the blocks past those return at once;
* when the grid has one split (a large batch: 64 sequences of an 8-KV-head model) writes the
  results itself and the merge kernel is not launched; else the merge reads each sequence's
  splits in unrolled runs.

Measured on the H200 (tests/bench/gpu_decode_attention.py, the 8B shape, KV rotated past L2):
against the per-head kernel 1.05x at one sequence of 190 tokens, 2.7x at one of 2048, 3.1-4.2x
at 8-128 sequences of 190 (64 sequences: 20.6 us against 83.3, 2.4 TB/s of KV), 3.3x at 64 of
1024 (3.2 TB/s).

Scores are in log2 units and `lse` is written in them, as decode_attention.py explains; the
merge of the splits is its kernel's rule. RopeMode.NORMAL caches (rope applied before K is
stored) only: `rotary_mode` is ignored, as there.
"""
from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.script import tirx as T

from vtool.schedules.softcap import capper

THREADS = 128  # threads of a partial block
MAX_THREADS_PER_TOKEN = 32  # one token's row is held within a warp (the shuffles stay in it)
TARGET_BLOCKS = 512  # as decode_attention.py: about four blocks per SM of a 132-SM H100/H200
MAX_SPLITS = 32
MERGE_RUN = 8  # splits the merge reads at once (MAX_SPLITS is a multiple)
MAX_GROUP_REGISTERS = 64  # query heads x elements a thread keeps for q and for o (each)
SMEM_LIMIT = 48 * 1024  # static shared memory of one block


def layout(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str) -> tuple[int, int, int, int] | None:
    """(VEC, TL, GROUPS, UNROLL) for these shapes, or None when this kernel does not take them
    (decode_attention.py's per-head kernel then does)."""
    if num_qo_heads % num_kv_heads:
        return None
    group = num_qo_heads // num_kv_heads
    elem = tvm.DataType(dtype).bits // 8
    if dtype not in ("float32", "bfloat16", "float16"):
        return None
    load = 16 // elem  # elements in one 16-byte load
    vec = max(load, head_dim // MAX_THREADS_PER_TOKEN)
    if head_dim % vec or vec % load:
        return None
    tl = head_dim // vec
    if tl & (tl - 1) or tl > MAX_THREADS_PER_TOKEN or THREADS % tl:
        return None
    if group * vec > MAX_GROUP_REGISTERS:
        return None
    groups = THREADS // tl
    if groups * group * (head_dim + 2) * 4 > SMEM_LIMIT:
        return None
    unroll = 4 if group * vec <= 32 else 2
    return vec, tl, groups, unroll


def unpacker(dtype: str):
    """unpack(word, i): element i of a 32-bit word of `dtype` elements, as float32 (the
    little-endian order the elements are stored in)."""
    if dtype == "float32":
        return lambda word, i: tirx.reinterpret("float32", word)
    if dtype == "bfloat16":  # a bfloat16 is the top half of the float32 it rounds
        return lambda word, i: tirx.reinterpret("float32", tirx.if_then_else(
            i == 0, tirx.shift_left(word, tirx.const(16, "uint32")), tirx.bitwise_and(word, tirx.const(0xFFFF0000, "uint32"))))
    if dtype == "float16":
        return lambda word, i: tirx.Cast("float32", tirx.reinterpret("float16", tirx.Cast(
            "uint16", tirx.shift_right(word, tirx.Cast("uint32", i * 16)))))
    raise ValueError(f"grouped decode attention: no {dtype} pages")


def grid_splits(batch: int, num_kv_heads: int) -> int:
    """The split dimension of the grid for `batch` sequences: the fewest splits that give
    TARGET_BLOCKS blocks, at most MAX_SPLITS (the kernel computes the same on the host)."""
    return max(1, min(MAX_SPLITS, -(-TARGET_BLOCKS // (batch * num_kv_heads))))


def grouped_decode(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str,
                   page_size: int = 16, softcap: float = 0.0, symbol: str = "batch_decode_paged_kv") -> tvm.tirx.PrimFunc:
    """The kernel with TVM's `batch_decode_paged_kv` signature; `softcap`: the attention logit
    soft-cap (schedules/softcap.py; 0: none)."""
    shape = layout(num_kv_heads, num_qo_heads, head_dim, dtype)
    if shape is None:
        raise ValueError(f"grouped decode attention does not take {num_qo_heads}/{num_kv_heads} heads of "
                         f"{head_dim} in {dtype}")
    VEC, TL, GROUPS, U = shape
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    G = H_qo // H_kv
    ELEM_BITS = tvm.DataType(dtype).bits
    PER_WORD = 32 // ELEM_BITS  # elements in a 32-bit word
    WORDS = VEC // PER_WORD  # words a thread holds of one token's row
    LOAD = 128 // ELEM_BITS  # elements in 16 bytes
    unpack = unpacker(dtype)
    PER_ITER = GROUPS * U  # tokens a block takes per iteration
    OUT_PER_THREAD = (G * D + THREADS - 1) // THREADS
    LOG2E = math.log2(math.e)
    SHUFFLES = [TL >> (i + 1) for i in range(int(math.log2(TL)))]  # TL/2, ..., 1
    capping, cap = bool(softcap), capper(softcap)

    def seq_len(page_table_indptr: tirx.Buffer, length_info: tirx.Buffer, row: tirx.PrimExpr) -> tirx.PrimExpr:
        """A sequence's tokens (the pages before its last are full)."""
        num_pages = page_table_indptr[row + 1] - page_table_indptr[row]
        return tirx.if_then_else(num_pages > 0, (num_pages - 1) * page_size + length_info[row], 0)

    def splits_of(kv_len: tirx.PrimExpr, splits_grid: tirx.PrimExpr) -> tirx.PrimExpr:
        """The splits a sequence uses: a whole iteration of the block's token groups each at
        least, at most the grid's (the partial and the merge kernel agree on it)."""
        return tirx.max(1, tirx.min(splits_grid, tirx.ceildiv(kv_len, PER_ITER)))

    # pylint: disable=too-many-locals,too-many-statements
    @T.macro
    def partial(Q, words, page_table_values, page_begin, kv_len, row, kv_head, split, splits, splits_grid,
                part_o, part_m, part_d, output, lse, sm_scale, ty, tx):
        q_local = T.sblock_alloc_buffer((G, VEC), "float32", scope="local")
        o_local = T.sblock_alloc_buffer((G, VEC), "float32", scope="local")
        m_local = T.sblock_alloc_buffer((G,), "float32", scope="local")
        d_local = T.sblock_alloc_buffer((G,), "float32", scope="local")
        k_words = T.sblock_alloc_buffer((U, WORDS), "uint32", scope="local")
        v_words = T.sblock_alloc_buffer((U, WORDS), "uint32", scope="local")
        s_local = T.sblock_alloc_buffer((G, U), "float32", scope="local")
        where = T.sblock_alloc_buffer((U, 2), "int32", scope="local")  # page, offset
        m_new = T.sblock_alloc_buffer((1,), "float32", scope="local")
        merged = T.sblock_alloc_buffer((3,), "float32", scope="local")  # m, d, o
        o_smem = T.sblock_alloc_buffer((GROUPS, G, D), "float32", scope="shared")
        md_smem = T.sblock_alloc_buffer((GROUPS, G, 2), "float32", scope="shared")

        chunk: T.let[T.int32] = T.ceildiv(kv_len, splits)
        start: T.let[T.int32] = split * chunk
        end: T.let[T.int32] = T.min(start + chunk, kv_len)

        for h in T.serial(G):
            for v in T.serial(VEC):
                q_local[h, v] = T.cast(Q[row, kv_head * G + h, tx * VEC + v], "float32") * sm_scale * LOG2E
                o_local[h, v] = T.float32(0)
            m_local[h] = T.float32(-5e4)
            d_local[h] = T.float32(0)

        for it in T.serial(T.ceildiv(T.max(end - start, 0), PER_ITER)):
            base: T.let[T.int32] = start + (it * GROUPS + ty) * U
            for u in T.unroll(U):
                # a token past the range reads the last one's row (in bounds) and is masked below
                pos: T.let[T.int32] = T.min(base + u, end - 1)
                where[u, 0] = page_table_values[page_begin + T.floordiv(pos, page_size)]
                where[u, 1] = T.floormod(pos, page_size)
            # 16-byte loads of raw 32-bit words (CUDA has no vector type of 8 bfloat16 for TVM)
            for u in T.unroll(U):
                for w in T.unroll(WORDS // 4):
                    for e in T.vectorized(4):
                        k_words[u, w * 4 + e] = words[where[u, 0], 0, kv_head, where[u, 1], tx * WORDS + w * 4 + e]
            for u in T.unroll(U):
                for w in T.unroll(WORDS // 4):
                    for e in T.vectorized(4):
                        v_words[u, w * 4 + e] = words[where[u, 0], 1, kv_head, where[u, 1], tx * WORDS + w * 4 + e]
            for h in T.unroll(G):
                for u in T.unroll(U):
                    s_local[h, u] = T.float32(0)
                    for v in T.unroll(VEC):
                        s_local[h, u] += q_local[h, v] * unpack(k_words[u, v // PER_WORD], v % PER_WORD)
            # the TL threads of a token group sum their parts (every thread of the warp takes part)
            for h in T.unroll(G):
                for u in T.unroll(U):
                    for off in T.unroll(len(SHUFFLES)):
                        s_local[h, u] += T.tvm_warp_shuffle_xor(
                            T.uint32(0xFFFFFFFF), s_local[h, u], T.shift_right(T.int32(TL), off + 1), 32, 32)
            for h in T.unroll(G):
                m_new[0] = m_local[h]
                for u in T.unroll(U):
                    if base + u < end:
                        if capping:  # a Python bool: the statement exists only in capped kernels
                            s_local[h, u] = cap(s_local[h, u])
                        m_new[0] = T.max(m_new[0], s_local[h, u])
                rescale: T.let[T.float32] = T.exp2(m_local[h] - m_new[0])
                d_local[h] = d_local[h] * rescale
                for v in T.unroll(VEC):
                    o_local[h, v] = o_local[h, v] * rescale
                for u in T.unroll(U):
                    p: T.let[T.float32] = T.if_then_else(base + u < end, T.exp2(s_local[h, u] - m_new[0]),
                                                         T.float32(0))
                    d_local[h] = d_local[h] + p
                    for v in T.unroll(VEC):
                        o_local[h, v] = o_local[h, v] + p * unpack(v_words[u, v // PER_WORD], v % PER_WORD)
                m_local[h] = m_new[0]

        # merge the token groups' states, then write this split's part for each query head
        for h in T.serial(G):
            for v in T.serial(VEC):
                o_smem[ty, h, tx * VEC + v] = o_local[h, v]
            if tx == 0:
                md_smem[ty, h, 0] = m_local[h]
                md_smem[ty, h, 1] = d_local[h]
        T.tvm_storage_sync("shared")
        for i in T.serial(OUT_PER_THREAD):
            flat: T.let[T.int32] = i * THREADS + ty * TL + tx
            if flat < G * D:
                h: T.let[T.int32] = flat // D
                e: T.let[T.int32] = flat % D
                merged[0] = md_smem[0, h, 0]
                for w in T.serial(1, GROUPS):
                    merged[0] = T.max(merged[0], md_smem[w, h, 0])
                merged[1] = T.float32(0)
                merged[2] = T.float32(0)
                for w in T.serial(GROUPS):
                    weight: T.let[T.float32] = T.exp2(md_smem[w, h, 0] - merged[0])
                    merged[1] += md_smem[w, h, 1] * weight
                    merged[2] += o_smem[w, h, e] * weight
                if splits_grid == 1:  # the whole sequence: the result itself, no merge kernel
                    output[row, kv_head * G + h, e] = T.cast(
                        T.if_then_else(merged[1] > 0, merged[2] / merged[1], T.float32(0)), dtype)
                    if e == 0:
                        lse[row, kv_head * G + h] = T.if_then_else(
                            merged[1] > 0, merged[0] + T.log2(merged[1]), T.float32(-5e4))
                else:
                    part_o[row, kv_head * G + h, split, e] = merged[2]
                    if e == 0:
                        part_m[row, kv_head * G + h, split] = merged[0]
                        part_d[row, kv_head * G + h, split] = merged[1]
        # (an empty sequence's one split writes an empty state: m = -5e4, d = 0, o = 0)

    @T.macro
    def merge(part_o, part_m, part_d, splits, row, head, output, lse, tx):
        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
        md = T.sblock_alloc_buffer((2,), "float32", scope="local")
        # The sequence's splits in unrolled runs of MERGE_RUN (static loops with guards), so
        # that a run's loads are all in flight at once and a short sequence reads one run.
        md[0] = part_m[row, head, 0]
        for r in T.serial(MAX_SPLITS // MERGE_RUN):
            if r * MERGE_RUN < splits:
                for i in T.unroll(MERGE_RUN):
                    if r * MERGE_RUN + i < splits:
                        md[0] = T.max(md[0], part_m[row, head, r * MERGE_RUN + i])
        md[1] = T.float32(0)
        acc[0] = T.float32(0)
        for r in T.serial(MAX_SPLITS // MERGE_RUN):
            if r * MERGE_RUN < splits:
                for i in T.unroll(MERGE_RUN):
                    if r * MERGE_RUN + i < splits:
                        weight: T.let[T.float32] = T.exp2(part_m[row, head, r * MERGE_RUN + i] - md[0])
                        md[1] += part_d[row, head, r * MERGE_RUN + i] * weight
                        acc[0] += part_o[row, head, r * MERGE_RUN + i, tx] * weight
        output[row, head, tx] = T.cast(T.if_then_else(md[1] > 0, acc[0] / md[1], T.float32(0)), dtype)
        if tx == 0:
            lse[row, head] = T.if_then_else(md[1] > 0, md[0] + T.log2(md[1]), T.float32(-5e4))

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
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol})
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

        # the same pages as 32-bit words, for the 16-byte loads
        # (offset in whole 16-byte pieces, so that the loads' addresses are provably aligned)
        assert pages_elem_offset % LOAD == 0, "the KV pages do not start on a 16-byte boundary"
        words = T.decl_buffer((max_num_pages, 2, H_kv, page_size, D // PER_WORD), "uint32", data=pages.data,
                              elem_offset=T.floordiv(pages_elem_offset, LOAD) * 4)

        # the grid's splits, from the batch size alone (grid_splits, on the host)
        splits_grid: T.let[T.int32] = T.max(1, T.min(MAX_SPLITS, T.ceildiv(TARGET_BLOCKS, B * H_kv)))
        part_o = T.alloc_buffer((B, H_qo, splits_grid, D), "float32")
        part_m = T.alloc_buffer((B, H_qo, splits_grid), "float32")
        part_d = T.alloc_buffer((B, H_qo, splits_grid), "float32")

        # Kernel 1: one block per (sequence, KV head, split).
        for bx in T.thread_binding(B, thread="blockIdx.x"):
            for by in T.thread_binding(H_kv, thread="blockIdx.y"):
                for bz in T.thread_binding(splits_grid, thread="blockIdx.z"):
                    for ty in T.thread_binding(GROUPS, thread="threadIdx.y"):
                        for tx in T.thread_binding(TL, thread="threadIdx.x"):
                            with T.sblock("partial"):
                                page_begin: T.let[T.int32] = page_table_indptr[bx]
                                kv_len: T.let[T.int32] = seq_len(page_table_indptr, length_info, bx)
                                splits: T.let[T.int32] = splits_of(kv_len, splits_grid)
                                if bz < splits:  # the rest of the grid has nothing of this sequence
                                    partial(Q, words, page_table_values, page_begin, kv_len, bx, by, bz, splits,
                                            splits_grid, part_o, part_m, part_d, output, lse, sm_scale, ty, tx)

        # Kernel 2 (launched only when the grid splits: a large batch has its results already):
        # merge the splits of each (sequence, query head), one thread per element.
        if splits_grid > 1:
            for bx in T.thread_binding(B, thread="blockIdx.x"):
                for by in T.thread_binding(H_qo, thread="blockIdx.y"):
                    for tx in T.thread_binding(D, thread="threadIdx.x"):
                        with T.sblock("merge"):
                            kv_len: T.let[T.int32] = seq_len(page_table_indptr, length_info, bx)
                            merge(part_o, part_m, part_d, splits_of(kv_len, splits_grid), bx, by, output, lse, tx)

    return decode
