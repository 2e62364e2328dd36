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
    """A head dim the grouped kernel cannot lay out (96: 12 threads a row) gets the
    per-query-head split-KV kernel."""
    from vtool.schedules.cuda.decode_attention import num_splits, replace_decode_attention

    mod = _export(96)
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
    assert f"T.alloc_buffer((B, 4, {num_splits(4)}, 96)" in script.replace('"float32"', "").replace(", )", ")")


def test_a_grouped_query_model_gets_the_grouped_kernel_with_the_same_signature():
    """4 query heads over 2 KV heads of 64: one block per (sequence, KV head, split), the
    grid's splits sized from the batch on the host, partial states per query head."""
    from vtool.schedules.cuda.decode_attention import replace_decode_attention

    mod = _export(64)
    (name, before), = _decode_kernels(mod).items()
    mod, replaced = replace_decode_attention(mod)
    after = _decode_kernels(mod)[name]
    assert replaced == 1 and not after.same_as(before)
    assert [str(getattr(p.ty, "dtype", p.ty)) for p in after.params] == \
           [str(getattr(p.ty, "dtype", p.ty)) for p in before.params]
    script = after.script().replace('"float32"', "").replace(", )", ")")
    assert "T.alloc_buffer((B, 4, splits_grid, 64)" in script
    assert "T.thread_binding(2, thread=\"blockIdx.y\")" in script  # KV heads, not query heads
    assert "tvm_warp_shuffle_xor" in script


@pytest.mark.parametrize("kv, qo, d, dtype, expected", [
    (8, 32, 128, "bfloat16", (8, 16, 8, 4)),  # Llama-3-8B: 16-byte loads, 16 threads a row
    (3, 9, 64, "bfloat16", (8, 8, 16, 4)),  # SmolLM2-135M
    (1, 4, 256, "bfloat16", (8, 32, 4, 4)),  # Gemma's MQA at head_dim 256
    (2, 4, 64, "float32", (4, 16, 8, 4)),
    (2, 4, 256, "float32", (8, 32, 4, 4)),  # two 16-byte loads a row piece
    (2, 12, 128, "bfloat16", (8, 16, 8, 2)),  # a group of 6: fewer tokens at once
    (1, 16, 128, "bfloat16", None),  # a group of 16 keeps more registers than allowed
    (2, 4, 96, "bfloat16", None),  # 12 threads a row: not a power of two
    (2, 5, 64, "bfloat16", None),  # query heads not a multiple of KV heads
])
def test_the_grouped_layout_takes_the_shapes_it_can(kv, qo, d, dtype, expected):
    from vtool.schedules.cuda.grouped_decode_attention import layout

    assert layout(kv, qo, d, dtype) == expected


@pytest.mark.parametrize("batch, kv_heads, expected", [(1, 8, 32), (1, 32, 16), (8, 8, 8), (64, 8, 1), (3, 3, 32)])
def test_the_grid_splits_fill_the_gpu_and_no_more(batch, kv_heads, expected):
    from vtool.schedules.cuda.grouped_decode_attention import TARGET_BLOCKS, grid_splits

    splits = grid_splits(batch, kv_heads)
    assert splits == expected
    assert batch * kv_heads * splits >= TARGET_BLOCKS or splits == 32
    assert splits == 1 or batch * kv_heads * (splits - 1) < TARGET_BLOCKS


def test_the_grouped_kernel_compiles_to_16_byte_loads_and_shuffles():
    """sm_90a: K and V rows come in 128-bit loads (the words view's offset is provably
    aligned; with a gather TVM would emit four 32-bit loads), scores are summed by xor
    shuffles. Its numbers are checked on a GPU (tests/bench/gpu_decode_attention.py, and
    every model's decode in test_gpu_parity.py)."""
    import tvm

    from vtool.schedules.cuda.grouped_decode_attention import grouped_decode
    from vtool.targets import lookup

    target = tvm.target.Target(lookup("sm_90a").tvm)
    kernel = grouped_decode(8, 32, 128, "bfloat16", symbol="grouped")
    with target:
        lib = tvm.tirx.build(tvm.IRModule({"grouped": kernel}), target=target)
    source = lib.imports[0].inspect_source()
    assert source.count("*(uint4*)(words_ptr") == 8  # 4 tokens x (K, V) a thread per iteration
    assert "make_uint4(words_ptr" not in source
    assert source.count("__shfl_xor_sync") == 4 * 4 * 4  # heads x tokens x log2(16 threads)


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
    assert "T.thread_binding" not in dispatch and f"total_len - batch_size < {SHORT_STEP_TOKENS}" in dispatch
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
