"""Attention logit soft-capping (Gemma-2's attn_logit_softcapping) in TVM's paged KV-cache kernels.

Gemma-2 scores s = cap * tanh(q.k * scaling / cap), before the causal/window mask and the
softmax (transformers' Gemma2 eager_attention_forward). TVM 0.27's kernel generators
(relax/frontend/nn/llm/_prefill_kernels.py, _decode_kernels.py, tree_attn.py) have no hook for
it, so `softcap_kv_cache` rewrites the kernels the cache was made with, in the BlockBuilder.

Units. TVM's kernels keep scores in log2 units, x = q.k * sm_scale * log2(e), and use exp2.
The cap acts on the natural-scale score, and log2(e) * cap * tanh(s / cap) = c * tanh(x / c)
with c = cap * log2(e): so each kernel's final score x becomes c * tanh(x / c) (`capped`).

Where. Each PrimFunc the cache passes to its builtin that takes `sm_scale` (the attention
kernels: paged prefill and decode, ragged prefill, their sliding-window variants, the tree
attention ones; CPU and CUDA alike; merge, rope, copy and append take none) is rewritten at
the one store where a score is complete, which comes before the mask and the running max:

    S_val[0] = S_val[0] * (sm_scale * log2e)            CPU paged prefill / decode (serial)
    attention_score[0] = result[0] * log2e * sm_scale   CPU ragged prefill, CPU tree attention
    S_smem[i, j] = S_local[i, j]                        CUDA tiled prefill: after the q.k GEMM
    S_local[j] = t0[0]                                  CUDA decode: after the cross-thread sum

(the masked stores, -5e4, are left alone: they are the mask). A kernel in which these find
not exactly one store stops the build, naming it: a TVM whose kernels changed must not build
a model without its cap. The rewritten kernel carries the function attribute ATTR = cap,
which vtool's own kernels that replace TVM's read (schedules/softcap.py: the CPU ones in
schedules/cpu/attention.py, CUDA's split-KV decode and short prefill), so they cap too.

A model without a cap never comes here: its kernels are TVM's, unchanged.
"""
from __future__ import annotations

import math
from typing import Any

import tvm
import tvm_ffi
from tvm import relax as rx
from tvm import tirx

from vtool import VtoolError

# The PrimFunc attribute holding the cap; schedules/softcap.py reads the same name (a test holds them equal).
ATTR = "vtool.attn_logit_softcap"
LOG2E = math.log2(math.e)


class SoftcapError(VtoolError):
    """A kernel whose score this module cannot find: the cap cannot be applied."""


def capped(x: tirx.PrimExpr, cap: float) -> tirx.PrimExpr:
    """c * tanh(x / c), c = cap * log2(e): the soft-cap of a log2-unit score x."""
    c, dtype = cap * LOG2E, str(x.ty.dtype)
    return tirx.const(c, dtype) * tirx.tanh(x * tirx.const(1.0 / c, dtype))


def _loads(value: tirx.PrimExpr, name: str) -> bool:
    """`value` is a load of the buffer `name` (TVM 0.27's unified IR: a TensorLoad of its source)."""
    return isinstance(value, tvm.ir.TensorLoad) and getattr(value.source, "name", None) == name


def _uses(value: tirx.PrimExpr, var: tirx.Var) -> bool:
    found: list[bool] = []
    tvm_ffi.structural_walk(value, [(tirx.Var, lambda v: found.append(v.same_as(var)))])
    return any(found)


def _is_score(store: tirx.BufferStore, sm_scale: tirx.Var) -> bool:
    name, value = store.buffer.name, store.value
    if name == "S_val":
        return _uses(value, sm_scale)
    if name == "attention_score":
        return _uses(value, sm_scale) and _uses_load(value, "result")
    if name == "S_smem":
        return _loads(value, "S_local")
    if name == "S_local":
        return _loads(value, "t0")
    return False


def _uses_load(value: tirx.PrimExpr, name: str) -> bool:
    found: list[bool] = []
    tvm_ffi.structural_walk(value, [(tvm.ir.TensorLoad, lambda load: found.append(_loads(load, name)))])
    return any(found)


def sm_scale_param(func: tirx.PrimFunc) -> tirx.Var | None:
    """The kernel's `sm_scale` parameter: it is an attention kernel. None: it is not."""
    return next((p for p in func.params if isinstance(p, tirx.Var) and p.name == "sm_scale"), None)


def softcap_kernel(func: tirx.PrimFunc, cap: float, name: str = "") -> tirx.PrimFunc:
    """`func` (one of TVM's attention kernels) with its score soft-capped and ATTR set."""
    sm_scale = sm_scale_param(func)
    if sm_scale is None:
        raise SoftcapError(f"{name or 'the kernel'} has no sm_scale parameter: not an attention kernel")
    hits: list[tirx.BufferStore] = []

    def cap_store(store: tirx.BufferStore) -> tirx.BufferStore:
        if not _is_score(store, sm_scale):
            return store
        hits.append(store)
        return tirx.BufferStore(store.buffer, capped(store.value, cap), store.indices)

    out = tvm_ffi.structural_map(func, [(tirx.BufferStore, cap_store)])
    if len(hits) != 1:
        raise SoftcapError(
            f"attention logit soft-capping: TVM's attention kernel {name or func.attrs.get('global_symbol')} has "
            f"{len(hits)} score stores of the forms models/softcap.py knows (one expected); this TVM's kernels "
            "changed, and the cap cannot be applied")
    return out.with_attr(ATTR, float(cap))


def _global_vars(expr: Any) -> list[tvm.ir.GlobalVar]:
    if isinstance(expr, tvm.ir.GlobalVar):
        return [expr]
    if isinstance(expr, rx.Tuple):
        return [gv for field in expr.fields for gv in _global_vars(field)]
    if isinstance(expr, rx.Call):
        return [gv for arg in expr.args for gv in _global_vars(arg)]
    return []


def softcap_kv_cache(cache: Any, cap: float) -> list[str]:
    """Soft-cap every attention kernel `cache` (a TIRPagedKVCache just made, in the current
    BlockBuilder) was made with; returns their names. FlashInfer's kernels are not TIR:
    a FlashInferPagedKVCache is refused."""
    from tvm.relax.frontend.nn.llm.kv_cache import TIRPagedKVCache

    if not isinstance(cache, TIRPagedKVCache):
        raise SoftcapError(f"attention logit soft-capping needs TVM's TIR attention kernels, not a "
                           f"{type(cache).__name__}")
    bb = rx.BlockBuilder.current()
    call = bb.lookup_binding(cache._expr)  # noqa: SLF001 - the cache's builtin call, bound by nn.Object
    done: list[str] = []
    for gv in _global_vars(call):
        func = bb.get()[gv]
        if not isinstance(func, tirx.PrimFunc) or sm_scale_param(func) is None or gv.name_hint in done:
            continue
        bb.update_func(gv, softcap_kernel(func, cap, gv.name_hint))
        done.append(gv.name_hint)
    if not done:
        raise SoftcapError("attention logit soft-capping: the KV cache passes no attention kernel to cap")
    return done
