"""Objects compiled from vtool's own native sources (toolchain/native/) into the user cache, once
per key, for export_library to link into a model library."""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from vtool import VtoolError


def tvm_ffi_includes() -> list[str]:
    """The compiler flags for tvm-ffi's headers (the FFI functions the sources export)."""
    import tvm_ffi.libinfo

    return [f"-I{tvm_ffi.libinfo.find_include_path()}", f"-I{tvm_ffi.libinfo.find_dlpack_include_path()}"]


def cached_object(source: Path, folder: str, extra_key: str, command: Callable[[str], list[str]],
                  error: type[VtoolError] = VtoolError) -> Path:
    """`source` compiled by command(output path) into <cache>/<folder>/, keyed by the source, the
    tvm-ffi version and `extra_key` (arch list, compiler version...); built into a temporary and
    renamed, so a reader sees a whole object or none, and under a file lock, so parallel builds
    asking for the same object compile it once (block_mma.cu: ~90 s on 2 cores) while the others
    wait for it."""
    from filelock import FileLock

    from vtool.runtime.paths import cache_root

    key = hashlib.sha256(source.read_bytes() + importlib.metadata.version("apache-tvm-ffi").encode()
                         + extra_key.encode()).hexdigest()[:16]
    obj = cache_root() / folder / f"{source.stem}-{key}.o"
    if obj.is_file():
        return obj
    obj.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(obj.parent / f".{obj.name}.lock"):
        if obj.is_file():  # compiled by whoever held the lock before
            return obj
        return _compile_object(source, obj, command, error)


def _compile_object(source: Path, obj: Path, command: Callable[[str], list[str]], error: type[VtoolError]) -> Path:
    fd, tmp_name = tempfile.mkstemp(prefix=f".{source.stem}.", suffix=".o", dir=obj.parent)
    os.close(fd)
    cmd = command(tmp_name)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        Path(tmp_name).unlink(missing_ok=True)
        raise error(f"compiling {source.name} failed ({' '.join(cmd)}):\n{done.stderr.strip()[-2000:]}")
    Path(tmp_name).replace(obj)
    return obj


def cuda_object(source: Path, folder: str, archs, ptx: str) -> Path:  # noqa: ANN001 - a sequence of arch names
    """A CUDA source of toolchain/native/ -> an object with SASS for `archs` and PTX `ptx` (the
    model's own kernels' arch list), cached in <cache>/<folder>/ per source, arch list and nvcc."""
    from vtool.toolchain.cuda import CudaBuildError, find_nvcc, gencode_flags, nvcc_version

    nvcc = find_nvcc()
    return cached_object(source, folder, repr((sorted(archs), ptx, nvcc_version(nvcc))),
                         lambda out: [nvcc, "-c", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", *gencode_flags(archs, ptx),
                                      *tvm_ffi_includes(), str(source), "-o", out], CudaBuildError)
