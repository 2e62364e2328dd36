"""Fixtures shared by the GPU test modules whose artifacts are built for sm_90a.

Import them into a test module (`from gpu_fixtures import cuda_buildable, exact_float32, sm90_gpu`)."""
from __future__ import annotations

import pytest
import torch

TARGET = "sm_90a"


def cuda_buildable() -> None:
    """Skip unless this machine can build for TARGET (the compiler and nvcc are here)."""
    pytest.importorskip("tvm", reason="the build needs the compiler (apache-tvm)")
    from vtool import VtoolError
    from vtool.targets import buildable

    try:
        buildable(TARGET)
    except VtoolError as e:
        pytest.skip(f"no CUDA build here: {e}")


@pytest.fixture(scope="module")
def sm90_gpu():
    """The GPU (skip without one, or below sm_90: the artifacts are built for TARGET)."""
    from test_gpu_parity import probe_gpu

    info, reason = probe_gpu()
    if info is None:
        pytest.skip(reason)
    if (info.major, info.minor) < (9, 0):
        pytest.skip(f"these artifacts are built for {TARGET}; the GPU is {info.describe()}")
    return info


@pytest.fixture(scope="module")
def exact_float32():
    """transformers' float32 matmuls without TF32, for the module's tests."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
