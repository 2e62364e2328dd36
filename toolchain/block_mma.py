"""The tensor-core matmul over GGUF blocks for batched decode on CUDA (native/block_mma.cu).

A CUDA build whose weights stay in blocks and whose compute dtype is bf16/f16 sends the
matmuls of `batch_decode` over Q4_0, Q4_1, Q4_K, Q6_K and Q8_0 weights to `vtool_block_mma_<fmt>`
(and `decode`'s single rows, which the same functions take through a SIMT GEMV)
(models/quantized_linear.py's `use_block_mma`): each weight read once a step, dequantized in
registers and multiplied on the tensor cores, so a step of many sequences costs about what one
of a single sequence does. This module compiles that source with nvcc for the build's arch
list, once per source, arch list and nvcc version, into the user cache; the build links the
object and libcudart into the model library.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from vtool.models.weights import block_formats
from vtool.toolchain.native_objects import cuda_object

BLOCK_MMA_FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K")  # the kernels native/block_mma.cu instantiates
SOURCE = Path(__file__).with_name("native") / "block_mma.cu"
MMA_DTYPES = ("bfloat16", "float16")  # the mma's operand types; float32 builds keep the GEMV


def block_mma_formats(kept: Mapping[str, str] | None, dtype: str) -> tuple[str, ...]:
    """The kept formats whose batched-decode matmuls a CUDA build of `dtype` sends to the
    tensor-core kernel (none for float32, whose parity with transformers stays in the GEMV)."""
    if dtype not in MMA_DTYPES or not kept:
        return ()
    return tuple(sorted(block_formats(kept) & set(BLOCK_MMA_FORMATS)))


def compile_object(archs, ptx: str) -> Path:  # noqa: ANN001 - a sequence of arch names
    """native/block_mma.cu -> an object with SASS for `archs` and PTX `ptx` (the model's own
    kernels' arch list), cached."""
    return cuda_object(SOURCE, "block-mma", archs, ptx)

