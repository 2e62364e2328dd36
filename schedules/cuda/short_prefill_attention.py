"""Paged attention for short multi-token steps on CUDA (speculative verification, a draft
model's catch-up): split-KV, one query token per block row, in front of TVM's kernel.

A step of a few tokens per sequence (1 + k drafts) attends in two parts inside TVM's KV
cache: the new tokens among themselves (`batch_prefill_ragged_kv`, causal) and the new
tokens against the pages already cached (`batch_prefill_paged_kv`), merged by log-sum-exp.
TVM's paged kernel tiles the query rows of one sequence into blocks of 32 and walks the
whole cached context in one block per (tile, KV head): a 5-token verify of an 8-KV-head
model runs 8 blocks on 132 SMs. Profiled on the H200 (tests/bench/verify_profile.py), it
took 80 us a layer at 128 tokens of context on the SmolLM2-135M shape, two thirds of a
verify step, growing with the context.

For a short step every query row is, for the cached part, a decode query: it attends
every cached token (or, with `causal`, those its position allows). So the short path runs
the split-KV decode kernel's scheme (schedules/cuda/decode_attention.py) with one query
token per row of the grid: (token, query head, split) blocks, then the merge. Each token
reads the cached K/V again, which costs nothing at a few tokens and a lot at thousands,
so the kernel keeps TVM's own for longer steps: the function put in place of
`batch_prefill_paged_kv` branches on the step's token count beyond one per sequence on the
host (`replace_prefill_paged_attention`).

The same holds for a served step that admits a new prompt beside running decodes (63
decodes and one 128-token prompt: 191 tokens). TVM's tiled kernel gave each decode row a
32-row tile of its own walking the context: in such steps it took two thirds of the GPU
time on the H200 (8B shape, 64 sequences; `tests/bench/mixed_steps.py --profile`), where
FlashInfer's prefill kernel made the mixed step cost a fifth more than a decode step. Rope is applied before K is stored (RopeMode.NORMAL),
so only `rotary_mode == 0` takes the short path.
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from vtool.schedules.cuda.decode_attention import LANES, WARPS, split_kv_macros
from vtool.schedules.softcap import softcap_of

PAGED_PREFILL_SYMBOL = "batch_prefill_paged_kv"  # TVM's kernel this one goes in front of
# Steps with fewer than this many tokens beyond one per sequence take the split-KV path:
# verification steps (sequences times 1 + k; the captured batch_verify's bound is 128 too),
# and a served step that mixes a new prompt into running decodes. Every decode row of such a
# step is a decode query; a fresh prompt has no cached pages, so its rows cost the split-KV
# kernel nothing; only many rows of one sequence over a long cached context (a later chunk of
# a long prompt) re-read it row by row, and those steps have more rows than this.
SHORT_STEP_TOKENS = 128


def short_paged_prefill(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str,
                        page_size: int = 16, softcap: float = 0.0) -> tvm.tirx.PrimFunc:
    """The split-KV kernel with batch_prefill_paged_kv's signature (no sliding window);
    `softcap`: the attention logit soft-cap (schedules/softcap.py; 0: none)."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    partial, merge, S = split_kv_macros(H_kv, H_qo, D, dtype, page_size, softcap)

    # pylint: disable=too-many-locals,too-many-statements
    @T.prim_func(s_tir=True)
    def short_prefill(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_pages: T.handle,
        var_page_indptr: T.handle,
        var_page_values: T.handle,
        var_length_info: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": SHORT_SYMBOL})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        pages_elem_offset = T.int64()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()

        q = T.match_buffer(var_q, (total_len, H_qo, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, H_kv, page_size, D), dtype,
                               elem_offset=pages_elem_offset)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(var_output, (total_len, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (total_len, H_qo), "float32")
        length_info = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=length_info_elem_offset)

        part_o = T.alloc_buffer((total_len, H_qo, S, D), "float32")
        part_m = T.alloc_buffer((total_len, H_qo, S), "float32")
        part_d = T.alloc_buffer((total_len, H_qo, S), "float32")

        for bx in T.thread_binding(total_len, thread="blockIdx.x"):
            for by in T.thread_binding(H_qo, thread="blockIdx.y"):
                for bz in T.thread_binding(S, thread="blockIdx.z"):
                    for ty in T.thread_binding(WARPS, thread="threadIdx.y"):
                        for tx in T.thread_binding(LANES, thread="threadIdx.x"):
                            with T.sblock("short_partial"):
                                seq = T.sblock_alloc_buffer((1,), "int32", scope="local")
                                # the sequence of token bx: the last one starting at or before it
                                seq[0] = 0
                                for i in T.serial(batch_size):
                                    if q_indptr[i] <= bx:
                                        seq[0] = i
                                page_begin: T.let[T.int32] = page_indptr[seq[0]]
                                num_pages: T.let[T.int32] = page_indptr[seq[0] + 1] - page_begin
                                kv_len: T.let[T.int32] = T.if_then_else(
                                    num_pages > 0, (num_pages - 1) * page_size + length_info[seq[0]], 0)
                                # causal: token j of n sees the cached tokens up to kv_len - n + j
                                q_len: T.let[T.int32] = q_indptr[seq[0] + 1] - q_indptr[seq[0]]
                                visible: T.let[T.int32] = T.if_then_else(
                                    causal > 0, T.max(kv_len - q_len + (bx - q_indptr[seq[0]]) + 1, 0), kv_len)
                                partial(q, bx, by, bz, pages, page_values, page_begin, T.min(visible, kv_len),
                                        total_len * H_qo, part_o, part_m, part_d, sm_scale, ty, tx)

        for bx in T.thread_binding(total_len, thread="blockIdx.x"):
            for by in T.thread_binding(H_qo, thread="blockIdx.y"):
                for tx in T.thread_binding(LANES, thread="threadIdx.x"):
                    with T.sblock("short_merge"):
                        merge(part_o, part_m, part_d, bx, by, output, lse, tx)

    return short_prefill


SHORT_SYMBOL = "vtool_prefill_paged_kv_short"  # the split-KV kernel
TILED_SYMBOL = "vtool_prefill_paged_kv_tiled"  # TVM's kernel, renamed


def dispatcher(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str,
               page_size: int = 16) -> tvm.tirx.PrimFunc:
    """Host code with batch_prefill_paged_kv's signature that calls the short kernel for a
    step of at most SHORT_STEP_TOKENS tokens (and rotary_mode 0), TVM's kernel otherwise. Both
    are functions of the same library: a packed call finds them in the module it is in."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim

    @T.prim_func(s_tir=True)
    def dispatch(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_pages: T.handle,
        var_page_indptr: T.handle,
        var_page_values: T.handle,
        var_length_info: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": PAGED_PREFILL_SYMBOL})
        batch_size = T.int32()
        indptr_len = T.int32()
        total_len = T.int32()
        q = T.match_buffer(var_q, (total_len, H_qo, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (indptr_len,), "int32", offset_factor=1)
        pages = T.match_buffer(var_pages, (T.int32(), 2, H_kv, page_size, D), dtype, elem_offset=T.int64())
        page_indptr = T.match_buffer(var_page_indptr, (indptr_len,), "int32", offset_factor=1)
        page_values = T.match_buffer(var_page_values, (T.int32(),), "int32", offset_factor=1)
        length_info = T.match_buffer(var_length_info, (batch_size,), "int32", offset_factor=1)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", offset_factor=1)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32", offset_factor=1)
        output = T.match_buffer(var_output, (total_len, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (total_len, H_qo), "float32")
        if total_len - batch_size < SHORT_STEP_TOKENS and rotary_mode == 0:
            T.evaluate(T.call_cpacked(SHORT_SYMBOL, q, q_indptr, pages, page_indptr, page_values, length_info,
                                     k_rope_pos_offset, q_rope_position, output, lse,
                                     causal, rotary_mode, rope_scale, rope_theta, sm_scale))
        else:
            T.evaluate(T.call_cpacked(TILED_SYMBOL, q, q_indptr, pages, page_indptr, page_values, length_info,
                                     k_rope_pos_offset, q_rope_position, output, lse,
                                     causal, rotary_mode, rope_scale, rope_theta, sm_scale))

    return dispatch


def replace_prefill_paged_attention(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """Put the dispatcher in place of `batch_prefill_paged_kv` in `mod` (the KV cache refers
    to it by GlobalVar), with the short kernel and TVM's own beside it under their own
    symbols. The sliding-window variant has another symbol and stays; so does a kernel whose
    head_dim the lanes cannot split (not a multiple of 32, or past 256). The short kernel takes
    TVM's kernel's attention logit soft-cap (models/softcap.py's attribute; TVM's own, kept for
    long steps, is capped already). Returns the module and how many kernels were replaced."""
    replaced = 0
    for gvar, func in list(mod.functions.items()):
        if not (isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None
                and func.attrs.get("global_symbol") == PAGED_PREFILL_SYMBOL):
            continue
        q, pages = func.params[0].ty, func.params[2].ty  # buffer types in TVM 0.27's unified IR
        head_dim, qo_heads, kv_heads = int(q.shape[2]), int(q.shape[1]), int(pages.shape[2])
        if head_dim % LANES or head_dim > 256:
            continue
        mod[SHORT_SYMBOL] = short_paged_prefill(kv_heads, qo_heads, head_dim, str(q.dtype), int(pages.shape[3]),
                                                softcap_of(func)).with_attr("global_symbol", SHORT_SYMBOL)
        mod[TILED_SYMBOL] = func.with_attr("global_symbol", TILED_SYMBOL)
        mod[gvar] = dispatcher(kv_heads, qo_heads, head_dim, str(q.dtype), int(pages.shape[3]))
        replaced += 1
    return mod, replaced


def short_prefill_attention_pass() -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name="VtoolShortPrefillAttention")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return replace_prefill_paged_attention(mod)[0]

    return _pass
