"""CUDA decode attention kernels on a GPU against a float32 torch reference.

The grouped kernel (schedules/cuda/grouped_decode_attention.py) and the per-query-head one it
replaces where it can (decode_attention.py), on random paged KV pools with shuffled pages:
output and lse (log2 units, which the KV cache merges by) for random sets of sequence lengths
(hypothesis: 1 to 5000 tokens, 1 to 200 sequences, so that the grid runs from 32 splits down
to one, where the partial kernel writes the result itself and no merge runs), every shape of
tests/bench/gpu_decode_attention.py's SHAPES (GQA, MQA at head_dim 256, MHA, float32 /
bfloat16 / float16, a soft-capped one).

The library comes from VTOOL_GPU_DECODE_ATTENTION_LIBRARY, built on a machine with the
compiler by `python tests/bench/gpu_decode_attention.py build OUT.so` (the GPU machine has
only the TVM runtime); every test skips, saying why, without it or without a usable GPU.
Every model's decode runs through the kernel in test_gpu_parity.py too.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.gpu

BENCH = Path(__file__).resolve().parent / "bench" / "gpu_decode_attention.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("gpu_decode_attention_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH_MODULE = _bench_module()


@pytest.fixture(scope="module")
def harness():
    path = os.environ.get("VTOOL_GPU_DECODE_ATTENTION_LIBRARY")
    if not path:
        pytest.skip("VTOOL_GPU_DECODE_ATTENTION_LIBRARY is not set (build it with "
                    "tests/bench/gpu_decode_attention.py build)")
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed (the reference)")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU usable by torch")
    return BENCH_MODULE.Harness(path, seed=7)


@pytest.mark.parametrize("kind", ["grouped", "perhead"])
@pytest.mark.parametrize("shape", BENCH_MODULE.SHAPES, ids=[s[0] for s in BENCH_MODULE.SHAPES])
def test_edge_lengths(harness, kind, shape):
    """Page edges (15, 16, 17 tokens), one token, a split's worth and past it, and a long one."""
    for lengths in ([1], [16], [1, 15, 16, 17, 31, 32, 33, 64, 65], [4111, 1, 300]):
        result = harness.check(kind, shape, lengths)
        assert result["ok"], result


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from(BENCH_MODULE.SHAPES),
       lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=12),
       copies=st.sampled_from([1, 1, 4, 17]))
def test_grouped_kernel_matches_torch(harness, shape, lengths, copies):
    """copies: the lengths repeated, up to 204 sequences: grids of 32 splits down to one."""
    result = harness.check("grouped", shape, lengths * copies)
    assert result["ok"], result
