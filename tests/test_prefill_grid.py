"""TVM's tiled prefill attention kernels on a grid that fills the GPU (schedules/cuda/prefill_grid.py).

Nothing here runs a kernel (no GPU in CI): the build's kernels are read back from the module
a CUDA build compiles, and the wide kernel is held to TVM's own, text for text, but for the grid.
On a GPU, tests/bench/wave_admission.py and gpu_decode_8b.py --prefill-only showed the two
builds' greedy tokens and prefill logits bit-identical (docs/BENCHMARKS.md), and
test_gpu_parity.py's tiny models run through these kernels.
"""
from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vtool.schedules.cuda.prefill_grid import (BLOCKS_PER_GPU, TVM_BLOCKS_PER_KV_HEAD, blocks_per_kv_head,
                                               wide_prefill_grid)

PREFILL_KERNELS = ("batch_prefill_ragged_kv", "batch_prefill_paged_kv")
GRID = re.compile(r'T\.thread_binding\((\d+), thread="blockIdx\.x"\)')


@given(st.integers(min_value=1, max_value=256))
def test_the_grid_is_the_smallest_that_fills_the_gpu_and_never_narrower_than_tvms(kv_heads):
    blocks = blocks_per_kv_head(kv_heads)
    assert blocks >= TVM_BLOCKS_PER_KV_HEAD
    assert blocks * kv_heads >= min(BLOCKS_PER_GPU, TVM_BLOCKS_PER_KV_HEAD * kv_heads)
    if blocks > TVM_BLOCKS_PER_KV_HEAD:  # no smaller count reaches BLOCKS_PER_GPU
        assert (blocks - 1) * kv_heads < BLOCKS_PER_GPU <= blocks * kv_heads


def _tvm_target(name: str):  # noqa: ANN202
    import tvm

    from vtool.targets import lookup

    return tvm.target.Target(lookup(name).tvm)


def test_the_wide_kernel_is_tvms_but_for_the_grid():
    pytest.importorskip("tvm")
    from tvm.relax.frontend.nn.llm import _prefill_kernels

    target = _tvm_target("sm_90a")
    narrow = _prefill_kernels._attention_prefill_ragged(2, 6, 64, 64, "float16", {}, target).script()
    with wide_prefill_grid():
        wide = _prefill_kernels._attention_prefill_ragged(2, 6, 64, 64, "float16", {}, target).script()
    blocks = blocks_per_kv_head(2)
    assert GRID.findall(narrow) == [str(TVM_BLOCKS_PER_KV_HEAD)] and GRID.findall(wide) == [str(blocks)]
    # the grid's extent and the walk's stride are the only places the block count appears
    expected = narrow.replace(f'T.thread_binding({TVM_BLOCKS_PER_KV_HEAD}, thread="blockIdx.x")',
                              f'T.thread_binding({blocks}, thread="blockIdx.x")')
    expected = expected.replace(f"tile_id[0] = tile_id[0] + {TVM_BLOCKS_PER_KV_HEAD}", f"tile_id[0] = tile_id[0] + {blocks}")
    assert expected != narrow and wide == expected
    # TVM's generator is back once the build is done
    again = _prefill_kernels._attention_prefill_ragged(2, 6, 64, 64, "float16", {}, target).script()
    assert again == narrow


def test_tvms_generator_is_restored_when_the_build_fails_and_other_gpus_are_untouched():
    pytest.importorskip("tvm")
    import tvm
    from tvm.relax.frontend.nn.llm import _prefill_kernels

    tvm_config = _prefill_kernels._get_prefill_kernel_config
    other = tvm.target.Target("vulkan")  # not measured there: TVM's grid stays
    with pytest.raises(RuntimeError, match="boom"):
        with wide_prefill_grid():
            assert _prefill_kernels._get_prefill_kernel_config is not tvm_config
            # another target's config is TVM's, number for number
            assert (_prefill_kernels._get_prefill_kernel_config(4, 8, 64, "float16", other)
                    == tvm_config(4, 8, 64, "float16", other))
            raise RuntimeError("boom")
    assert _prefill_kernels._get_prefill_kernel_config is tvm_config


@pytest.fixture(scope="module")
def gqa_config(tiny_shape_dir):
    import json

    from vtool.models.config import parse_hf_config

    return parse_hf_config(json.loads((tiny_shape_dir("llama-gqa") / "config.json").read_text()))


def test_a_cuda_build_compiles_the_prefill_kernels_on_the_wide_grid(gqa_config):
    pytest.importorskip("tvm")
    from tvm import tirx

    from vtool.targets import lookup
    from vtool.toolchain.build import model_module

    _target, mod, _params, _entries = model_module(gqa_config, lookup("sm_90a"), "bfloat16", lambda _msg: None)
    grids = {gv.name_hint: GRID.findall(f.script()) for gv, f in mod.functions.items()
             if isinstance(f, tirx.PrimFunc) and gv.name_hint.startswith(PREFILL_KERNELS)}
    assert set(PREFILL_KERNELS) <= set(grids)
    wide = str(blocks_per_kv_head(gqa_config.num_key_value_heads))
    assert all(found == [wide] for found in grids.values()), grids
