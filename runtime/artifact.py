"""Load a compiled artifact (model.so + manifest.json) and bind a checkpoint's weights.

Every check that can refuse runs before the library is loaded: the manifest format,
the versions it was built with, the CPU features its code needs, the checkpoint's
config against the one it was built for, and each source tensor's shape.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

import vtool
from vtool.runtime.checkpoint import Checkpoint
from vtool.runtime.manifest import LIBRARY_NAME, ManifestError, read_manifest, source_config_mismatches
from vtool.runtime.transforms import apply_transform
from vtool.runtime.tvm_runtime import ffi, global_func

_DL_CPU = 1
_POOLED_ALLOCATOR = 2


def installed_versions() -> dict[str, str | None]:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"vtool": vtool.__version__, "tvm": version("apache-tvm"), "tvm_ffi": version("apache-tvm-ffi")}


def host_cpu_flags() -> set[str]:
    """CPU feature flags as Linux reports them (the kernel hides what the OS does not enable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def check_compatible(manifest: dict[str, Any], checkpoint: Checkpoint | None) -> None:
    """Refuse, with the reason, an artifact that must not be loaded here or with this checkpoint."""
    built, have = manifest["versions"], installed_versions()
    for key in ("vtool", "tvm_ffi"):
        if built.get(key) != have.get(key):
            raise ManifestError(f"artifact built with {key} {built.get(key)}, this runtime has {have.get(key)}; rebuild it")
    if have.get("tvm") is not None and built.get("tvm") != have["tvm"]:
        raise ManifestError(f"artifact built with TVM {built.get('tvm')}, this runtime has TVM {have['tvm']}; rebuild it")
    target = manifest["target"]
    if target.get("family") == "x86":
        missing = sorted(set(target.get("requires_cpu", [])) - host_cpu_flags())
        if missing:
            raise ManifestError(
                f"artifact targets {target['name']}, which this CPU cannot execute (missing {', '.join(missing)}); "
                "build for --target host"
            )
    elif target.get("family") != "x86":
        raise ManifestError(f"artifact targets {target.get('name')}; this runtime runs x86 CPU artifacts only")
    if checkpoint is not None:
        diffs = source_config_mismatches(manifest["source_config"], checkpoint.config())
        if diffs:
            raise ManifestError(f"artifact was built for another config ({checkpoint.path}): " + "; ".join(diffs))


class CompiledModel:
    """The Relax VM over one artifact, with its weights bound in manifest order."""

    def __init__(self, folder: Path, checkpoint: Checkpoint, progress: Callable[[int, int], None] | None = None):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        check_compatible(self.manifest, checkpoint)
        self.ffi = ffi()
        self.device = self.ffi.device("cpu", 0)
        library = self.ffi.load_module(str(self.folder / LIBRARY_NAME))
        self.vm = library["vm_load_executable"]()
        self.vm["vm_initialization"](_DL_CPU, 0, _POOLED_ALLOCATOR)
        t = time.perf_counter()
        self.params = self.ffi.convert(self._bind(checkpoint, progress))
        self.load_seconds = time.perf_counter() - t
        self.dtype: str = self.manifest["dtype"]
        self.hidden_size: int = self.manifest["config"]["hidden_size"]
        self.vocab_size: int = self.manifest["config"]["vocab_size"]
        self._fns = {name: self.vm[name] for name in self.manifest["entry_points"]}

    def function(self, name: str) -> Any:
        return self._fns[name]

    def upload(self, array: np.ndarray, dtype: str | None = None) -> Any:
        """Copy into a TVM-allocated tensor: TVM kernels assume 64-byte alignment, which
        zero-copy numpy buffers do not give (AVX-512 code crashed on them)."""
        array = np.ascontiguousarray(array)
        tensor = global_func("runtime.TVMTensorAllocWithScope")(
            self.ffi.Shape(array.shape), dtype or str(array.dtype), self.device, None)
        global_func("runtime.TVMTensorCopyFromBytes")(tensor, ctypes.c_void_p(array.ctypes.data), array.nbytes)
        return tensor

    def _bind(self, checkpoint: Checkpoint, progress: Callable[[int, int], None] | None) -> list[Any]:
        plan = self.manifest["params"]
        available = checkpoint.tensors()
        for entry in plan:
            for src in entry["sources"]:
                if src not in available:
                    raise ManifestError(f"{checkpoint.path}: missing tensor {src!r} needed by {entry['name']!r}")
        bound = []
        for i, entry in enumerate(plan):
            arrays = [checkpoint.load(src, dtype=entry["dtype"]) for src in entry["sources"]]
            value = apply_transform(entry["transform"], arrays)
            if list(value.shape) != entry["shape"]:
                raise ManifestError(
                    f"{checkpoint.path}: {entry['name']!r} made from {entry['sources']} has shape "
                    f"{list(value.shape)}, the library expects {entry['shape']}")
            bound.append(self.upload(value, entry["dtype"]))
            if progress:
                progress(i + 1, len(plan))
        return bound
