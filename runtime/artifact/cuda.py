"""The CUDA side of the runtime: the GPU's identity (compute capability, memory) read through
the CUDA runtime library that TVM's CUDA device API links (libcudart.so.13), and the rule
that says whether an artifact's compiled code can run on that GPU.

Nothing here loads a library at import; `vtool.runtime.artifact.tvm_runtime.cuda_runtime()` does.
"""
from __future__ import annotations

import ctypes
import dataclasses
import re
from typing import Any

from vtool import VtoolError

# cudaDeviceAttr values (driver_types.h; stable since CUDA 5).
_ATTR_CC_MAJOR = 75
_ATTR_CC_MINOR = 76
_EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming

# The vtool target (targets/table.py) to build for a compute capability: arch-specific
# ("a") rows where the table has them, as nvcc names them.
_TARGET_FOR_CC = {(8, 0): "sm_80", (8, 6): "sm_86", (8, 7): "sm_87", (8, 9): "sm_89", (9, 0): "sm_90a",
                  (10, 0): "sm_100a", (10, 3): "sm_103a", (11, 0): "sm_110a", (12, 0): "sm_120a", (12, 1): "sm_121a"}

_ARCH = re.compile(r"^(sm|compute)_(\d+)([af]?)$")


class CudaError(VtoolError):
    """No usable CUDA GPU, or an artifact's code cannot run on the one there is."""


def target_for_compute_capability(major: int, minor: int) -> str:
    """vtool's target name for a GPU: 9.0 -> sm_90a, 8.0 -> sm_80, 8.6 -> sm_86, 12.0 -> sm_120a."""
    return _TARGET_FOR_CC.get((major, minor), f"sm_{major}{minor}")


def parse_arch(arch: str) -> tuple[str, int, int, str]:
    """("sm" | "compute", major, minor, "" | "a" | "f") for nvcc's spellings sm_90a, compute_120, sm_100f."""
    m = _ARCH.match(arch.strip())
    if not m or len(m.group(2)) < 2:
        raise CudaError(f"{arch!r} is not a CUDA architecture (expected sm_XY, sm_XYa, sm_XYf or compute_XY)")
    digits = m.group(2)
    return m.group(1), int(digits[:-1]), int(digits[-1]), m.group(3)


def arch_runs_on(arch: str, major: int, minor: int) -> bool:
    """Whether code compiled for `arch` runs on a GPU of compute capability major.minor.

    SASS (sm_XY) runs on the same major at an equal or higher minor; arch-specific SASS
    (sm_XYa) only on exactly X.Y; family-specific (sm_XYf) on the same major from X.Y up.
    PTX (compute_XY) is JIT-compiled by the driver for any GPU from X.Y up; compute_XYa
    only on X.Y, compute_XYf within the family."""
    kind, a_major, a_minor, suffix = parse_arch(arch)
    if suffix == "a":
        return (major, minor) == (a_major, a_minor)
    if kind == "sm" or suffix == "f":
        return major == a_major and minor >= a_minor
    return (major, minor) >= (a_major, a_minor)


def artifact_archs(target: dict[str, Any]) -> list[str]:
    """Every arch an artifact holds code for: target["archs"] (SASS) plus target["ptx"]
    (the PTX that rides along), else the TVM target's single arch."""
    archs = [str(a) for a in target.get("archs") or []]
    ptx = target.get("ptx")
    for extra in ([ptx] if isinstance(ptx, str) else list(ptx or [])):
        if extra and extra not in archs:
            archs.append(str(extra))
    if not archs and isinstance(target.get("tvm"), dict) and target["tvm"].get("arch"):
        archs = [str(target["tvm"]["arch"])]
    return archs


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    major: int
    minor: int
    total_memory: int

    @property
    def compute_capability(self) -> str:
        return f"{self.major}.{self.minor}"

    def describe(self) -> str:
        return f"GPU {self.index} ({self.name}, compute capability {self.compute_capability})"


def check_archs_cover(target: dict[str, Any], gpu: GpuInfo) -> None:
    """Refuse, by name, an artifact with no code this GPU can run."""
    archs = artifact_archs(target)
    if not archs:
        raise CudaError(f"artifact targets {target.get('name')} but its manifest names no CUDA architecture; rebuild it")
    if any(arch_runs_on(a, gpu.major, gpu.minor) for a in archs):
        return
    raise CudaError(
        f"artifact targets {target.get('name')} (code for {', '.join(archs)}), which cannot run on "
        f"{gpu.describe()}; build for --target {target_for_compute_capability(gpu.major, gpu.minor)}")


class CudaRuntime:
    """A few CUDA runtime calls through ctypes on the libcudart TVM's CUDA device API uses."""

    def __init__(self, cudart: ctypes.CDLL, device_name: Any = None):
        self._lib = cudart
        self._lib.cudaGetErrorString.restype = ctypes.c_char_p
        self._device_name = device_name  # callable(index) -> str, TVM's device attribute; optional

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            text = self._lib.cudaGetErrorString(rc)
            reason = text.decode(errors="replace") if text else f"error {rc}"
            raise CudaError(f"CUDA {what} failed: {reason} (cudaError {rc})")

    def device_count(self) -> int:
        n = ctypes.c_int(0)
        self._check(self._lib.cudaGetDeviceCount(ctypes.byref(n)), "cudaGetDeviceCount")
        return n.value

    def compute_capability(self, index: int = 0) -> tuple[int, int]:
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        self._check(self._lib.cudaDeviceGetAttribute(ctypes.byref(major), _ATTR_CC_MAJOR, index),
                    "cudaDeviceGetAttribute(major)")
        self._check(self._lib.cudaDeviceGetAttribute(ctypes.byref(minor), _ATTR_CC_MINOR, index),
                    "cudaDeviceGetAttribute(minor)")
        return major.value, minor.value

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        """(free, total) bytes of device memory, as the driver counts them (all processes)."""
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._check(self._lib.cudaSetDevice(index), "cudaSetDevice")
        self._check(self._lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)), "cudaMemGetInfo")
        return free.value, total.value

    def set_device(self, index: int) -> None:
        """Make the GPU's primary context current on the calling thread (a thread that launches
        TVM's kernels, which use the driver API, needs one)."""
        self._check(self._lib.cudaSetDevice(index), "cudaSetDevice")

    def event_create(self) -> ctypes.c_void_p:
        """A CUDA event without timing (the cheap kind), for ordering host work after the device's."""
        event = ctypes.c_void_p()
        self._check(self._lib.cudaEventCreateWithFlags(ctypes.byref(event), _EVENT_DISABLE_TIMING),
                    "cudaEventCreateWithFlags")
        return event

    def event_record(self, event: ctypes.c_void_p) -> None:
        """Record the event on the legacy default stream, where TVM queues its kernels and copies."""
        self._check(self._lib.cudaEventRecord(event, None), "cudaEventRecord")

    def event_synchronize(self, event: ctypes.c_void_p) -> None:
        """Wait until the work queued before the event's last record is done."""
        self._check(self._lib.cudaEventSynchronize(event), "cudaEventSynchronize")

    def gpu(self, index: int = 0) -> GpuInfo:
        """The GPU at `index`, or a CudaError that says why there is none."""
        count = self.device_count()
        if index >= count:
            raise CudaError(f"no CUDA GPU {index}: the driver reports {count} device(s)"
                            + (" (check CUDA_VISIBLE_DEVICES)" if count == 0 else ""))
        major, minor = self.compute_capability(index)
        _, total = self.mem_get_info(index)
        name = "unknown"
        if self._device_name is not None:
            try:
                name = str(self._device_name(index))
            except Exception:  # the name is decoration only
                pass
        return GpuInfo(index, name, major, minor, total)
