"""The GPU sampler's row sort (native/row_sort.cu): CUB's radix sorts behind top-p / top-k.

schedules/cuda/sampler.py sorts each row of scaled logits in descending order for top-p and
top-k; on CUDA it calls `vtool_sort_rows_desc` (SORT_SYMBOL) instead of relax.op.sort, whose
CUDA lowering (topi.gpu.sort) took about 2 ms for 64 rows of 128,256 tokens on an H100. This
module compiles the source with nvcc for the build's arch list, once per source, arch list and
nvcc version, into the user cache. CUDA builds of vocabularies of 64K tokens or more link the
object and libcudart; smaller vocabularies keep relax.op.sort and a library without objects
of its own.
"""
from __future__ import annotations

from pathlib import Path

from vtool.toolchain.native_objects import cuda_object

SOURCE = Path(__file__).with_name("native") / "row_sort.cu"
SORT_SYMBOL = "vtool_sort_rows_desc"


def uses_row_sort(vocab_size: int) -> bool:
    """Whether a CUDA build of this vocabulary sorts with the linked CUB sort: the chunked
    vocabularies (64K+ tokens). At 49,152 tokens the CUB sort's kernels were faster from 16
    rows, but the SmolLM2 shape served 4% slower with it (host-bound: its extra launches and
    allocation cost more host time than the device time they save; docs/BENCHMARKS.md)."""
    from vtool.schedules.cuda.sampler import CHUNKED_VOCAB

    return vocab_size >= CHUNKED_VOCAB


def compile_object(archs, ptx: str) -> Path:  # noqa: ANN001 - a sequence of arch names
    """native/row_sort.cu -> an object with SASS for `archs` and PTX `ptx`, cached."""
    return cuda_object(SOURCE, "row-sort", archs, ptx)
