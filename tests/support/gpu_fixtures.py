"""Fixtures shared by the GPU test modules whose artifacts are built for sm_90a.

Import them into a test module (`from gpu_fixtures import cuda_buildable, exact_float32, sm90_gpu`)."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

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


def native_library_path(env: str, test_file: str) -> str:
    """The prebuilt native kernel library `env` names (made on the GPU-less machine by
    `python tests/<test_file> prebuild OUT.so`); skips without a usable GPU or without it."""
    from test_gpu_parity import probe_gpu

    info, reason = probe_gpu()
    if info is None:
        pytest.skip(reason)
    path = os.environ.get(env)
    if not path:
        pytest.skip(f"{env} is unset (build it with `python tests/{test_file} prebuild OUT.so`)")
    return path


class NativeLibrary:
    """One of vtool's native kernel libraries (a toolchain/native source linked alone) loaded
    through the TVM runtime; torch tensors go to its functions as TVM views of a given dtype."""

    def __init__(self, path: str):
        from vtool.runtime.artifact.tvm_runtime import cuda_runtime, ffi, global_func

        cuda_runtime()
        self.ffi = ffi()
        self.module = self.ffi.load_module(path)
        self.view = global_func("runtime.TVMTensorCreateView")

    def tensor(self, t, dtype: str):  # noqa: ANN001, ANN201 - a torch tensor
        return self.view(self.ffi.from_dlpack(t), self.ffi.Shape(list(t.shape)), dtype, 0)


def prepared_case(env: str, test_file: str, name: str, make: Callable[[Path], tuple[Path, Path]],
                  tmp_path_factory) -> tuple[Path, Path]:  # noqa: ANN001
    """(checkpoint, artifact) of one case a GPU test module prepares: from the folder `env` names
    (written where the compiler is by `python tests/<test_file> --prepare DIR`: a <name>/ folder a
    case, holding `model/` (a checkpoint folder, or `m.gguf` in it) and `artifact/`), else built
    here by `make(root)` when the compiler is installed, else skipped."""
    root = os.environ.get(env)
    if root:
        case = Path(root) / name
        if not (case / "artifact").is_dir():
            pytest.fail(f"{env}={root} has no {name}/artifact: run `python tests/{test_file} --prepare DIR` "
                        "where the compiler is installed")
        model = case / "model"
        return (model / "m.gguf" if (model / "m.gguf").exists() else model), case / "artifact"
    try:
        import tvm  # noqa: F401
    except ImportError:
        pytest.skip(f"no compiler here and {env} unset: nothing to run")
    return make(tmp_path_factory.mktemp(Path(test_file).stem))
