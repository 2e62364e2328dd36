"""A grid that fills the GPU for TVM's tiled prefill attention kernels (CUDA builds with TIR
attention).

TVM 0.27's `batch_prefill_ragged_kv` (a prompt's tokens among themselves) and its tiled
`batch_prefill_paged_kv` (new tokens against cached pages) walk the step's 32-row query tiles
from a fixed grid of 16 thread blocks per KV head (`_get_prefill_kernel_config`'s NUM_BLKS),
each block taking every 16th tile in turn. On a GPU of 132 SMs that is 48 blocks for a model
of 3 KV heads, 128 for 8: most SMs idle while each block runs its tiles one after another.
Profiled on an H100 (tests/bench/wave_admission.py): admitting a wave of 64 x 128-token prompts
on the SmolLM2-135M shape spent 51 of its 84 ms of kernel time in the ragged kernel and 20 in
the tiled paged one, against 2 ms for FlashInfer's.

The tile walk does not depend on the grid's size (a block past the last tile finds none and
ends), so the fix is the grid alone: while a CUDA build's KV cache is made, TVM's prefill
kernel generator is given a config whose block count is about `BLOCKS_PER_GPU` in all, split
over the KV heads. Everything else about the kernels (tiles, warps, loads, the schedule) is
TVM's: `tests/test_prefill_grid.py` holds the wide kernel's TIR equal to TVM's but for the grid's
extent and the walk's stride, and a CUDA build's kernels to the wide grid; on a GPU the output was
bit-identical (docs/BENCHMARKS.md, session 41). toolchain/build.py applies it around the model's
export for CUDA targets.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

# Thread blocks the prefill kernels launch in all: 8 of 128 threads per SM of a 132-SM GPU
# (H100 SXM / H200), a few waves on smaller ones (A100: 108 SMs); idle blocks cost only their
# launch, as the walk ends at once for them.
BLOCKS_PER_GPU = 1056
TVM_BLOCKS_PER_KV_HEAD = 16  # TVM 0.27's NUM_BLKS, never narrowed


def blocks_per_kv_head(num_kv_heads: int) -> int:
    """The prefill grid's x extent for a model of `num_kv_heads` (the grid's y)."""
    return max(TVM_BLOCKS_PER_KV_HEAD, math.ceil(BLOCKS_PER_GPU / max(1, num_kv_heads)))


@contextlib.contextmanager
def wide_prefill_grid() -> Iterator[None]:
    """While it lasts, TVM's CUDA prefill attention kernels are generated with a grid of
    `blocks_per_kv_head` blocks per KV head; other targets' kernels are left as TVM makes them."""
    from tvm.relax.frontend.nn.llm import _prefill_kernels

    tvm_config = _prefill_kernels._get_prefill_kernel_config  # pylint: disable=protected-access

    def wider(h_kv, h_q, d, dtype, target, **kwargs):  # noqa: ANN001, ANN202 (TVM's own signature)
        config = tvm_config(h_kv, h_q, d, dtype, target, **kwargs)
        if target.kind.name != "cuda":
            return config
        return (max(config[0], blocks_per_kv_head(int(h_kv))), *config[1:])

    _prefill_kernels._get_prefill_kernel_config = wider  # pylint: disable=protected-access
    try:
        yield
    finally:
        _prefill_kernels._get_prefill_kernel_config = tvm_config  # pylint: disable=protected-access
