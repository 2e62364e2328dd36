"""Compiles vtool's tensor-core prefill attention (native/prefill_attention.cu) for a CUDA build.

schedules/cuda/prefill_attention.py puts host dispatchers calling it in place of TVM's TIR prefill
kernels (bf16/f16, head_dim 64 or 128); this module compiles the source with nvcc for the build's
arch list, once per source, arch list and nvcc version, into the user cache (as block_mma.py
does), and the build links the object and libcudart into model.so when the dispatchers went in.
"""
from __future__ import annotations

from pathlib import Path

from vtool.toolchain.cuda import CudaBuildError, find_nvcc, gencode_flags, nvcc_version
from vtool.toolchain.native_objects import cached_object, tvm_ffi_includes

SOURCE = Path(__file__).with_name("native") / "prefill_attention.cu"


def compile_object(archs, ptx: str) -> Path:
    """native/prefill_attention.cu -> an object with SASS for `archs` and PTX `ptx`, cached."""
    nvcc = find_nvcc()
    return cached_object(SOURCE, "prefill-attention", repr((sorted(archs), ptx, nvcc_version(nvcc))),
                         lambda out: [nvcc, "-c", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", *gencode_flags(archs, ptx),
                                      *tvm_ffi_includes(), str(SOURCE), "-o", out], CudaBuildError)
