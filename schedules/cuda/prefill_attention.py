"""vtool's tensor-core prefill attention in place of TVM's TIR prefill kernels (CUDA, TIR attention).

TVM's paged KV cache attends a prompt in two parts, merged by log-sum-exp: the step's new tokens
among themselves (`batch_prefill_ragged_kv`, causal) and against the pages each sequence already
holds (`batch_prefill_paged_kv`). TVM 0.27's TIR kernels for both run on the CUDA cores
(toolchain/native/prefill_attention.cu has the figures), so a bf16/f16 build with head_dim 64 or
128 puts host code under those two symbols that calls vtool's FlashAttention-2 kernel, or TVM's
own kernel (kept under `<symbol>_tvm`) where it must: `rotary_mode` 1 (RoPE applied inside
attention, which vtool's models never ask for: RopeMode.NORMAL applies it before K is stored).
Models whose attention logits are soft-capped (Gemma-2), other head dims, page sizes and float32
keep TVM's kernels; so does the sliding-window paged kernel (its own symbol). The short-step path
in front of the paged kernel (short_prefill_attention.py) stays in front: it wraps whatever sits
under `batch_prefill_paged_kv`, this dispatcher included.

FlashInfer builds (`--attention flashinfer`) have neither TIR kernel, so nothing here applies.
The native functions are reached through `T.call_cpacked` by their plain names (the .cu file
exports a C alias beside each tvm-ffi entry); toolchain/prefill_attention.py compiles that source
and the build links it when `replace_prefill_attention` replaced something.
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from vtool.schedules.softcap import softcap_of

RAGGED_SYMBOL = "batch_prefill_ragged_kv"  # TVM's kernels, by the global symbols the KV cache calls
PAGED_SYMBOL = "batch_prefill_paged_kv"
NATIVE_RAGGED = "vtool_prefill_ragged"  # toolchain/native/prefill_attention.cu's exports
NATIVE_PAGED = "vtool_prefill_paged"
HEAD_DIMS = (64, 128)  # the kernel's instantiations
DTYPES = ("bfloat16", "float16")  # mma operand types
PAGE_SIZE = 16  # the kernel's page layout (TVM's KV cache default)


def fits(head_dim: int, dtype: str, page_size: int = PAGE_SIZE, softcap: float = 0.0) -> bool:
    """Whether vtool's kernel computes this attention (else TVM's kernel stays)."""
    return head_dim in HEAD_DIMS and dtype in DTYPES and page_size == PAGE_SIZE and not softcap


def tvm_symbol(symbol: str) -> str:
    """Where TVM's own kernel is kept beside the dispatcher."""
    return f"{symbol}_tvm"


def ragged_dispatcher(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str) -> tirx.PrimFunc:
    """Host code with batch_prefill_ragged_kv's signature: vtool's kernel unless RoPE is to be
    applied inside attention, then TVM's."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    fallback = tvm_symbol(RAGGED_SYMBOL)

    @T.prim_func(s_tir=True)
    def dispatch(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_kv_indptr: T.handle,
        var_q_rope_position: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": RAGGED_SYMBOL})
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q = T.match_buffer(var_q, (qo_len, H_qo, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", offset_factor=1)
        k = T.match_buffer(var_k, (kv_len, H_kv, D), dtype)
        v = T.match_buffer(var_v, (kv_len, H_kv, D), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", offset_factor=1)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32", offset_factor=1)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", offset_factor=1)
        output = T.match_buffer(var_output, (qo_len, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (qo_len, H_qo), "float32")
        if rotary_mode == 0:
            T.evaluate(T.call_cpacked(NATIVE_RAGGED, q, q_indptr, k, v, kv_indptr, output, lse, causal, sm_scale))
        else:
            T.evaluate(T.call_cpacked(fallback, q, q_indptr, k, v, kv_indptr, q_rope_position, k_rope_pos_offset,
                                      output, lse, causal, rotary_mode, rope_scale, rope_theta, sm_scale))

    return dispatch


def paged_dispatcher(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str) -> tirx.PrimFunc:
    """Host code with batch_prefill_paged_kv's signature (no sliding window): vtool's kernel
    unless RoPE is to be applied inside attention, then TVM's."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    fallback = tvm_symbol(PAGED_SYMBOL)

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
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": PAGED_SYMBOL})
        batch_size = T.int32()
        total_len = T.int32()
        q = T.match_buffer(var_q, (total_len, H_qo, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", offset_factor=1)
        pages = T.match_buffer(var_pages, (T.int32(), 2, H_kv, PAGE_SIZE, D), dtype, elem_offset=T.int64())
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", offset_factor=1)
        page_values = T.match_buffer(var_page_values, (T.int32(),), "int32", offset_factor=1)
        length_info = T.match_buffer(var_length_info, (batch_size,), "int32", offset_factor=1)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", offset_factor=1)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32", offset_factor=1)
        output = T.match_buffer(var_output, (total_len, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (total_len, H_qo), "float32")
        if rotary_mode == 0:
            T.evaluate(T.call_cpacked(NATIVE_PAGED, q, q_indptr, pages, page_indptr, page_values, length_info,
                                      output, lse, causal, sm_scale))
        else:
            T.evaluate(T.call_cpacked(fallback, q, q_indptr, pages, page_indptr, page_values, length_info,
                                      k_rope_pos_offset, q_rope_position, output, lse,
                                      causal, rotary_mode, rope_scale, rope_theta, sm_scale))

    return dispatch


def replace_prefill_attention(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """Put the dispatchers in place of TVM's ragged and (non-sliding) paged prefill kernels in
    `mod` (the KV cache refers to them by GlobalVar), TVM's own beside them under
    `<symbol>_tvm`, where `fits` holds. Returns the module and how many were replaced."""
    replaced = 0
    for gvar, func in list(mod.functions.items()):
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None:
            continue
        symbol = func.attrs.get("global_symbol")
        if symbol not in (RAGGED_SYMBOL, PAGED_SYMBOL):
            continue
        q = func.params[0].ty  # buffer types in TVM 0.27's unified IR
        head_dim, qo_heads, dtype = int(q.shape[2]), int(q.shape[1]), str(q.dtype)
        if symbol == RAGGED_SYMBOL:
            kv_heads, page_size = int(func.params[2].ty.shape[1]), PAGE_SIZE
        else:
            pages = func.params[2].ty
            kv_heads, page_size = int(pages.shape[2]), int(pages.shape[3])
        if not fits(head_dim, dtype, page_size, softcap_of(func)):
            continue
        make = ragged_dispatcher if symbol == RAGGED_SYMBOL else paged_dispatcher
        mod[tvm_symbol(symbol)] = func.with_attr("global_symbol", tvm_symbol(symbol))
        mod[gvar] = make(kv_heads, qo_heads, head_dim, dtype)
        replaced += 1
    return mod, replaced

