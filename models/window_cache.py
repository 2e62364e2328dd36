"""The KV cache that frees what a sliding window has passed, for models whose every layer is windowed.

TVM 0.27's paged KV cache has two sliding-window mechanisms, and only one of them frees pages:

* per-layer "mha_sliding" layers (`layer_sliding_window_size`; models/decoder.py
  create_tir_paged_kv_cache, what every windowed model runs by default) mask the window in the attention kernels but keep every page: the
  cache's `support_sliding_window_` is forced off whenever a layer is "mha_sliding", and
  `SlideWindowForSequence` then returns at once (paged_kv_cache.cc);
* the cache-wide window (`support_sliding_window=1`, every layer "mha", then
  `attention_kv_cache_enable_sliding_window_for_seq(kv, seq, size, sink)` per sequence)
  slides each sequence after every append: it keeps the last `size` tokens (sink 0), gives
  back every page wholly before them (a slid page is reused by any sequence at once), and
  clamps the sequence's length to `size`.

`create_tir_sliding_kv_cache` (this module) is the second. What TVM does there, and what this
cache does about it (measured on the tiny Mistral/Phi-3 shapes, tests/test_window_freeing.py):

* Positions. A slid sequence's length is clamped, so its query positions restart from the
  window: RoPE must be applied inside the attention kernels from those window-relative
  positions (TVM turns RopeMode.NORMAL into inline rope itself when the cache-wide window is
  on). RoPE depends only on the distance between query and key, which is kept, so attention
  is the same as at absolute positions. A model that rotates q/k itself (`model_rope`) or
  adds absolute positions cannot use this cache (it would see clamped positions).
* The window. The cache-wide window is a fixed number of kept tokens, not a per-query mask:
  a prompt chunk's queries would all see the whole kept window plus their chunk. The
  sliding-window paged prefill kernel already has a per-query mask (query i of a chunk sees
  the last W - i - 1 cached keys, `_causal_or_sliding_cross_mask`), but TVM calls it with
  causal=0 for "mha" layers; here the kernel is built with that mask always on
  (`_masked_prefill`), so with `size` = W - 1 kept tokens every query sees exactly W keys,
  decode (all kept keys plus itself) and chunks of at most W tokens alike (the ragged kernel
  attends each chunk to itself causally, unmasked: prompts stay chunked by the window).
* Kernels. vtool's CPU attention kernels for the per-layer cache apply no rope (rotary_mode 0),
  so this cache's ragged prefill, sliding prefill and sliding decode kernels are added under
  names of their own (`FREEING_SUFFIX`), which those rewrites do not match. schedules/cpu/
  rope_attention.py gives them parallel inline-rope kernels where the head dim is a multiple of
  16 (the query rotated by its distance to each key); otherwise they stay TVM's, serial and
  rotating each key per query (at a window of 512, 132x the per-layer cache's prompt time and
  17x its decode step), with the fixes of schedules/cpu/sliding_attention.py and
  rescale_fix.py. On CUDA this cache runs TVM's own GPU kernels (vtool's split-KV decode and
  short-prefill rewrites, schedules/cuda/, match only the per-layer cache's symbols). The
  manifest says which (`window_freeing_kernels`: parallel, serial or tvm-gpu), and the runtime
  uses this cache by default only on the parallel ones (runtime/engine/kv_cache.py
  frees_window_by_default): TVM's GPU kernels rotate every key per query, and on the H200 they
  took 1.35x the per-layer cache's prompt time and 1.3-1.7x its decode step.
* What breaks. `kv_state_popn` after a slide cannot bring back the tokens slid out for the
  popped ones (the window comes back short: logits off by 12 on the tiny Mistral) and its
  page count ignores the slid offset (PopN in paged_kv_cache.cc); `kv_state_fork_sequence` is refused past the attention sink (0 here). So the
  runtime (runtime/engine/kv_cache.py) uses this cache only where nothing pops or forks:
  speculative decoding and the draft model's own cache stay on create_tir_paged_kv_cache,
  and the prefix cache is off for windowed models anyway.
* Pages. TVM adds two pages per sequence to the count it is given (`num_total_pages +=
  reserved_num_seqs * 2`), borrows placeholder pages in a step when none is free and fills
  them from the pages that step's slide gave back, so a step needs only the pages it holds
  more afterwards; a sequence holds at most ceil((W + 14) / 16) pages of 16 tokens.

A model mixing windowed and global layers (Gemma-2/3, Qwen2 with max_window_layers > 0,
OLMo-3) never gets this cache: its global layers need every token, so no page is ever wholly
outside every layer's window, and nothing could be freed.
"""
from __future__ import annotations

from typing import Any

import tvm
import tvm_ffi
from tvm import relax as rx
from tvm import tirx
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from vtool.models.config import ModelConfig

ENTRY = "create_tir_sliding_kv_cache"  # the build's entry point; runtime/engine/kv_cache.py calls it by name
# appended to the names of the kernels this cache has of its own (schedules/cpu/__init__.py reads it)
FREEING_SUFFIX = "_window_freeing"
# the call's arguments (call_pure_packed: the builtin vm.builtin.paged_attention_kv_cache_create, then
# its arguments as TIRPagedKVCache lays them out for both targets: 15 fixed ones, then ragged prefill,
# paged prefill and decode, and the sliding-window paged prefill and decode, each a ("tirx", kernel) tuple)
_RAGGED, _SLIDING_PREFILL, _SLIDING_DECODE = 16, 19, 20


def frees_window(c: ModelConfig, target: Any) -> bool:
    """Whether a build of `c` for `target` gets create_tir_sliding_kv_cache: every layer
    windowed (a window of at least 2), RoPE applied by the cache with no scaling, no attention
    soft-cap, on the CPU or CUDA."""
    return bool(c.sliding_window >= 2 and len(set(c.sliding_layers)) == c.num_hidden_layers
                and not c.model_rope and not c.rope_scaling and not c.attn_logit_softcap
                and getattr(getattr(target, "kind", None), "name", "") in ("llvm", "cuda"))


def sliding_kv_cache(c: ModelConfig, dtype: str, target: Any, max_batch_size: tirx.Var,
                     max_total_seq_len: tirx.Var, prefill_chunk_size: tirx.Var, page_size: tirx.Var) -> PagedKVCache:
    """The cache-wide sliding-window paged KV cache of an all-window model (the module's
    docstring): every layer "mha", support_sliding_window 1, RoPE inline."""
    return _FreeingKVCache(
        attn_kind="mha", max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
        prefill_chunk_size=prefill_chunk_size, page_size=page_size, support_sliding_window=1,
        layer_partition=rx.ShapeExpr([0, c.num_hidden_layers]), num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        qk_head_dim=c.head_dim, v_head_dim=c.head_dim, mla_original_qk_head_dim=0, mla_original_v_head_dim=0,
        rope_mode=RopeMode.NORMAL, rope_scale=1, rope_theta=c.rope_theta, rope_scaling={},
        rope_ext_factors=rx.prim_value(0), rotary_dim=c.head_dim, enable_disaggregation=False, dtype=dtype,
        target=target, layer_sliding_window_size=c.sliding_window)


class _OwnKernels(PagedKVCache):
    """Between TIRPagedKVCache and PagedKVCache in _FreeingKVCache's MRO: TIRPagedKVCache's
    `super().__init__(_expr=...)` lands here with the builtin call before it is emitted, and
    the call is emitted with this cache's own kernels in place of the shared ones."""

    def __init__(self, *, _expr: rx.Expr, _name: str) -> None:
        super().__init__(_expr=_own_kernels(_expr, self._shared), _name=_name)


class _FreeingKVCache(TIRPagedKVCache, _OwnKernels):
    def __init__(self, **kwargs: Any) -> None:
        # the kernels already in the module: TIRPagedKVCache gets these back for equal ones (shared)
        self._shared = {gv.name_hint for gv in rx.BlockBuilder.current().get().get_global_vars()}
        super().__init__(**kwargs)


def _own_kernels(call: rx.Call, shared: set[str]) -> rx.Call:
    """The builtin call with every kernel replaced by a copy under a name of its own (its symbol
    + FREEING_SUFFIX), the sliding-window prefill's masked per query. The model's
    create_tir_paged_kv_cache makes kernels under the same symbols (some equal, shared; some
    not, which one module cannot hold twice), and vtool's CPU rewrites, which apply no rope,
    must not take this cache's ragged prefill and sliding-window prefill and decode. A kernel
    this cache added is renamed in place (nothing else refers to it); a shared one is copied."""
    bb = rx.BlockBuilder.current()
    module = bb.get()
    args = list(call.args)
    for index, parts in ((_RAGGED, ("ragged",)), (_SLIDING_PREFILL, ("prefill", "sliding_window")),
                         (_SLIDING_DECODE, ("decode", "sliding_window"))):
        field = args[index]
        symbol = _symbol(module, field.fields[1]) if isinstance(field, rx.Tuple) and len(field.fields) == 2 \
            and isinstance(field.fields[1], tvm.ir.GlobalVar) else ""
        if not all(part in symbol for part in parts):
            raise ValueError(f"TVM's KV-cache builtin has {symbol or 'no kernel'} at argument {index}, not its "
                             f"{' '.join(parts)} kernel: its layout changed")
    owned: dict[str, tvm.ir.GlobalVar] = {}

    def own(expr: rx.Expr, index: int) -> rx.Expr:
        if isinstance(expr, rx.Tuple):
            return rx.Tuple([own(field, index) for field in expr.fields])
        if not isinstance(expr, tvm.ir.GlobalVar) or not isinstance(module[expr], tirx.PrimFunc):
            return expr
        name = _symbol(module, expr) + FREEING_SUFFIX
        if name not in owned:
            func = module[expr]
            if index == _SLIDING_PREFILL:
                func = _masked_prefill(func, name)
            func = func.with_attr("global_symbol", name)
            if expr.name_hint in shared:
                owned[name] = bb.add_func(func, name)
            else:
                bb.update_func(expr, func)
                owned[name] = expr
        return owned[name]

    return rx.Call(call.op, [own(arg, index) for index, arg in enumerate(args)], call.attrs, call.ty_args)


def _symbol(module: tvm.IRModule, gv: tvm.ir.GlobalVar) -> str:
    func = module[gv]
    return str(func.attrs.get("global_symbol", gv.name_hint)) if func.attrs is not None else gv.name_hint


def _masked_prefill(func: tirx.PrimFunc, name: str) -> tirx.PrimFunc:
    """The sliding-window paged prefill kernel with its per-query window mask always on: each
    `causal > 0` test becomes `causal + 1 > 0` (TVM passes 0 or 1), so the parameter and the
    builtin's call stay as they are, and the kernel's TVMScript still round-trips (schedules/cpu/
    sliding_attention.py fixes it through its text)."""
    causal = next((p for p in func.params if isinstance(p, tirx.Var) and p.name == "causal"), None)
    if causal is None:
        raise ValueError(f"{name} has no `causal` parameter: TVM's sliding-window prefill kernel changed")
    hits: list[tirx.GT] = []

    def always(node: tirx.GT) -> tirx.GT:
        if not (node.a.same_as(causal) and isinstance(node.b, tirx.IntImm) and node.b.value == 0):
            return node
        hits.append(node)
        return tirx.GT(causal + 1, node.b)

    # (TVM's out-of-bounds `scale_O[d]` read in this kernel is fixed for every CPU build by
    # schedules/cpu/rescale_fix.py; the window's masked keys come before the visible ones here,
    # so that rescale matters)
    out = tvm_ffi.structural_map(func, [(tirx.GT, always)])
    if not hits:
        raise ValueError(f"{name} tests no `causal > 0`: TVM's sliding-window prefill kernel changed")
    return out

