"""The TVM runtime without the compiler: apache-tvm-ffi plus libtvm_runtime.so.

The shared libraries come from VTOOL_TVM_LIBRARY_DIR when set (a machine that has only
apache-tvm-ffi and the runtime libraries), else from the installed apache-tvm package,
found without importing it (importing `tvm` loads the 260 MB compiler).
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

from vtool import VtoolError

RUNTIME_LIBRARY = "libtvm_runtime.so"


class RuntimeLoadError(VtoolError):
    pass


def runtime_library_dir() -> Path:
    explicit = os.environ.get("VTOOL_TVM_LIBRARY_DIR")
    if explicit:
        folder = Path(explicit)
        if not (folder / RUNTIME_LIBRARY).exists():
            raise RuntimeLoadError(f"VTOOL_TVM_LIBRARY_DIR={explicit} has no {RUNTIME_LIBRARY}")
        return folder
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeLoadError(
            f"cannot find {RUNTIME_LIBRARY}: install apache-tvm or set VTOOL_TVM_LIBRARY_DIR to a folder holding it"
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / "lib"
    if not (folder / RUNTIME_LIBRARY).exists():
        raise RuntimeLoadError(f"the installed apache-tvm has no {folder / RUNTIME_LIBRARY}")
    return folder


@functools.lru_cache(maxsize=1)
def ffi() -> Any:
    """tvm_ffi with the runtime's global functions (vm.builtin.*, runtime.*) registered."""
    # tvm_ffi would otherwise build a torch DLPack extension whenever torch is installed.
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    import tvm_ffi

    ctypes.CDLL(str(runtime_library_dir() / RUNTIME_LIBRARY), ctypes.RTLD_GLOBAL)
    return tvm_ffi


def global_func(name: str) -> Any:
    return ffi().get_global_func(name)
