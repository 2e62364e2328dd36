"""The split-KV decode kernel's place in CUDA builds (its numbers are checked on a GPU by
test_gpu_parity.py: every tiny model's decode steps and SmolLM2 run through it).

Here: it takes the place of TVM's kernel in the exported module, with the same signature,
and it is split enough to fill a GPU at batch 1.
"""
from __future__ import annotations

import pytest

from vtool.models.config import parse_hf_config

# Imported inside the tests, not at collection: importing vtool.schedules.cuda parses TVM's
# tensor intrinsics (about a minute on 2 cores), which every pytest run would pay.
pytestmark = pytest.mark.slow

RAW = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 128,
       "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
       "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def _export(head_dim: int):
    import tvm

    from vtool.models.decoder import DecoderForCausalLM
    from vtool.targets import lookup

    raw = {**RAW, "head_dim": head_dim}
    model = DecoderForCausalLM(parse_hf_config(raw), "bfloat16", tvm.target.Target(lookup("sm_90a").tvm))
    mod, _ = model.export_tvm(spec=model.get_default_spec())
    return mod


def _decode_kernels(mod):
    import tvm

    from vtool.schedules.cuda.decode_attention import DECODE_SYMBOL

    return {g.name_hint: f for g, f in mod.functions.items()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
            and f.attrs.get("global_symbol") == DECODE_SYMBOL}


@pytest.mark.parametrize("heads", [1, 4, 9, 32, 64, 128])
def test_splits_fill_a_gpu_at_batch_one(heads):
    from vtool.schedules.cuda.decode_attention import TARGET_BLOCKS, num_splits

    splits = num_splits(heads)
    assert splits & (splits - 1) == 0 and 1 <= splits <= 32
    assert heads * splits >= TARGET_BLOCKS or splits == 32
    assert splits == 1 or heads * splits // 2 < TARGET_BLOCKS  # the smallest such power of two


def test_the_kv_cache_gets_the_split_kernel_with_the_same_signature():
    from vtool.schedules.cuda.decode_attention import num_splits, replace_decode_attention

    mod = _export(64)
    (name, before), = _decode_kernels(mod).items()
    mod, replaced = replace_decode_attention(mod)
    assert replaced == 1
    after = _decode_kernels(mod)[name]
    assert not after.same_as(before)
    assert [str(p.ty) if not hasattr(p.ty, "shape") else str(p.ty.dtype) for p in after.params] == \
           [str(p.ty) if not hasattr(p.ty, "shape") else str(p.ty.dtype) for p in before.params]
    assert [str(p.ty.shape[1:]) for p in after.params[:2]] == [str(p.ty.shape[1:]) for p in before.params[:2]]
    script = after.script()
    assert script.count("T.thread_binding") >= 8  # two kernels: the splits, then their merge
    assert f"T.alloc_buffer((B, 4, {num_splits(4)}, 64)" in script.replace('"float32"', "").replace(", )", ")")


def test_a_head_dim_the_lanes_cannot_split_keeps_tvms_kernel():
    from vtool.schedules.cuda.decode_attention import replace_decode_attention

    mod = _export(80)
    (name, before), = _decode_kernels(mod).items()
    mod, replaced = replace_decode_attention(mod)
    assert replaced == 0 and _decode_kernels(mod)[name].same_as(before)


def _symbols(mod) -> dict:
    import tvm

    return {f.attrs.get("global_symbol"): (g, f) for g, f in mod.functions.items()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None}


def test_short_steps_get_the_split_kernel_behind_a_dispatcher_that_compiles():
    """batch_prefill_paged_kv becomes host code choosing between the split-KV short kernel and
    TVM's own (renamed); the KV cache's GlobalVar now names the dispatcher; all three compile
    for sm_90a. Their numbers are checked on a GPU (test_cuda_graph_buckets.py)."""
    import tvm

    from vtool.schedules.cuda.short_prefill_attention import (PAGED_PREFILL_SYMBOL, SHORT_STEP_TOKENS, SHORT_SYMBOL,
                                                              TILED_SYMBOL, replace_prefill_paged_attention)
    from vtool.targets import lookup

    mod = _export(64)
    gvar, stock = _symbols(mod)[PAGED_PREFILL_SYMBOL]
    mod, replaced = replace_prefill_paged_attention(mod)
    symbols = _symbols(mod)
    assert replaced == 1 and symbols[PAGED_PREFILL_SYMBOL][0].same_as(gvar)
    assert symbols[TILED_SYMBOL][1].body.same_as(stock.body)  # TVM's kernel, only renamed
    dispatch = symbols[PAGED_PREFILL_SYMBOL][1].script()
    assert "T.thread_binding" not in dispatch and f"total_len <= {SHORT_STEP_TOKENS}" in dispatch
    assert dispatch.count(SHORT_SYMBOL) == 1 and dispatch.count(TILED_SYMBOL) == 1
    assert [str(p.ty.dtype) if hasattr(p.ty, "shape") else str(p.ty) for p in symbols[SHORT_SYMBOL][1].params] == \
           [str(p.ty.dtype) if hasattr(p.ty, "shape") else str(p.ty) for p in stock.params]
    kernels = tvm.IRModule({name: f for name, (_g, f) in symbols.items()
                            if name in (PAGED_PREFILL_SYMBOL, SHORT_SYMBOL, TILED_SYMBOL)})
    target = tvm.target.Target(lookup("sm_90a").tvm)
    with target:
        tvm.compile(kernels, target=target)


def test_a_head_dim_the_lanes_cannot_split_keeps_tvms_prefill_kernel():
    from vtool.schedules.cuda.short_prefill_attention import PAGED_PREFILL_SYMBOL, replace_prefill_paged_attention

    mod = _export(80)
    _gvar, before = _symbols(mod)[PAGED_PREFILL_SYMBOL]
    mod, replaced = replace_prefill_paged_attention(mod)
    assert replaced == 0 and _symbols(mod)[PAGED_PREFILL_SYMBOL][1].same_as(before)
