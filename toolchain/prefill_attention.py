"""Compiles vtool's tensor-core prefill attention (native/prefill_attention.cu) for a CUDA build.

schedules/cuda/prefill_attention.py puts host dispatchers calling it in place of TVM's TIR prefill
kernels (bf16/f16, head_dim 64 or 128); this module compiles the source with nvcc for the build's
arch list, once per source, arch list and nvcc version, into the user cache (as block_mma.py
does), and the build links the object and libcudart into model.so when the dispatchers went in.
"""
from __future__ import annotations

from pathlib import Path

from vtool.toolchain.native_objects import cuda_object

SOURCE = Path(__file__).with_name("native") / "prefill_attention.cu"


def compile_object(archs, ptx: str) -> Path:  # noqa: ANN001 - a sequence of arch names
    """native/prefill_attention.cu -> an object with SASS for `archs` and PTX `ptx`, cached."""
    return cuda_object(SOURCE, "prefill-attention", archs, ptx)
