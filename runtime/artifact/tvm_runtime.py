"""The TVM runtime without the compiler: apache-tvm-ffi plus libtvm_runtime.so, and for
CUDA artifacts libtvm_runtime_cuda.so (TVM's CUDA device API and cubin loader).

The shared libraries come from VTOOL_TVM_LIBRARY_DIR when set (a machine that has only
apache-tvm-ffi and the runtime libraries), else from the copies bundled in this package
(BUNDLED_LIBRARY_DIR: the vtool-runtime wheel puts them there, `vtool dist runtime-wheel`),
else from the installed apache-tvm package, found without importing it (importing `tvm`
loads the 260 MB compiler). libtvm_runtime.so needs libtvm_ffi.so, which its RUNPATH
($ORIGIN) does not find: `import tvm_ffi` loads it first, and the loader then matches the
dependency by soname.
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
CUDA_RUNTIME_LIBRARY = "libtvm_runtime_cuda.so"
CUDART = "libcudart.so.13"  # what the apache-tvm 0.27 wheel's libtvm_runtime_cuda.so links
DRIVER = "libcuda.so.1"


class RuntimeLoadError(VtoolError):
    pass


# Where the vtool-runtime wheel places TVM's runtime libraries (absent in a source checkout).
BUNDLED_LIBRARY_DIR = Path(__file__).resolve().parent / "lib"
BUNDLED_TVM_VERSION_FILE = "TVM_VERSION"  # apache-tvm's version, beside the libraries it gave


def bundled_tvm_version() -> str | None:
    """The TVM version of the bundled runtime libraries (the vtool-runtime wheel), or None."""
    try:
        return (BUNDLED_LIBRARY_DIR / BUNDLED_TVM_VERSION_FILE).read_text().strip() or None
    except OSError:
        return None


def runtime_library_dir() -> Path:
    """VTOOL_TVM_LIBRARY_DIR, else the libraries bundled in this package, else apache-tvm's."""
    explicit = os.environ.get("VTOOL_TVM_LIBRARY_DIR")
    if explicit:
        folder = Path(explicit)
        if not (folder / RUNTIME_LIBRARY).exists():
            raise RuntimeLoadError(f"VTOOL_TVM_LIBRARY_DIR={explicit} has no {RUNTIME_LIBRARY}")
        return folder
    if (BUNDLED_LIBRARY_DIR / RUNTIME_LIBRARY).exists():
        return BUNDLED_LIBRARY_DIR
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeLoadError(
            f"cannot find {RUNTIME_LIBRARY}: install apache-tvm (or the vtool-runtime wheel) or set "
            "VTOOL_TVM_LIBRARY_DIR to a folder holding it"
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / "lib"
    if not (folder / RUNTIME_LIBRARY).exists():
        raise RuntimeLoadError(f"the installed apache-tvm has no {folder / RUNTIME_LIBRARY}")
    return folder


CPU_THREADS_ENV = "VTOOL_CPU_THREADS"
BIND_THREADS_ENV = "TVM_BIND_THREADS"  # TVM's thread pool: 1 (its default) pins its workers to cores


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (SMT siblings counted once)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def apply_cpu_threads(threads: int | str | None = None) -> int:
    """The CPU kernels' thread count: `threads`, else $VTOOL_CPU_THREADS, else TVM_NUM_THREADS
    or OMP_NUM_THREADS when set (TVM's own variables), else the physical cores this process
    may run on (TVM's own default halves the logical CPUs on x86, guessing at SMT: one
    thread on a 2-core machine without SMT). TVM's thread pool reads TVM_NUM_THREADS once,
    when its first parallel kernel runs, so this sets it (and VTOOL_CPU_THREADS, which child
    processes inherit) before the runtime library is loaded. Returns the count."""
    value = threads if threads is not None else os.environ.get(CPU_THREADS_ENV)
    if value is None or value == "":
        for name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
            if os.environ.get(name, "").strip().isdigit() and int(os.environ[name]) > 0:
                return int(os.environ[name])
        value = physical_cores()
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise RuntimeLoadError(f"{CPU_THREADS_ENV}/--threads must be a positive integer, got {value!r}")
    os.environ[CPU_THREADS_ENV] = os.environ["TVM_NUM_THREADS"] = str(n)
    # TVM pins each worker thread to a core but leaves the calling thread free to run anywhere:
    # on a 2-core Xeon some processes (5 of 24 in ad-hoc runs, none in a later bench) ran their
    # parallel kernels at half speed for their whole life; unpinned, none. The OS places
    # unpinned threads well; TVM_BIND_THREADS=1 set by the user still pins them.
    os.environ.setdefault(BIND_THREADS_ENV, "0")
    return n


def block_torch_import() -> bool:
    """Keep torch out of this process when it is not imported yet: tvm_ffi's __init__ does
    `import torch` whenever torch is installed (guarded by ImportError), ~200 MB of resident
    memory and seconds of start-up that a process only running compiled models never uses.
    A None entry in sys.modules makes that import raise ImportError at once. For the CLI's
    runtime commands only: a program that imports torch later would get the ImportError too.
    Returns whether torch is blocked."""
    import sys

    if "torch" in sys.modules:
        return sys.modules["torch"] is None
    sys.modules["torch"] = None  # type: ignore[assignment]
    return True


_lean_ffi_import = False  # set by lean_ffi_import()


def lean_ffi_import() -> None:
    """Have ffi() import tvm_ffi without ml_dtypes, when neither is imported yet. tvm_ffi's
    __init__ imports ml_dtypes whenever it is installed (guarded by ImportError) only to map
    its numpy dtypes (bfloat16, float8) to TVM's; the import registers those dtypes and their
    ufunc loops with numpy, ~8 MiB resident, 4% of `vtool run`'s peak on the default model
    (issue 16). vtool hands tvm_ffi dtype names and raw bytes, never numpy bfloat16 dtypes,
    and imports ml_dtypes itself where it needs it (runtime/weights/checkpoint.py
    numpy_dtype). For the CLI's runtime commands only (as block_torch_import): tvm_ffi then
    converts no ml_dtypes dtype for the life of the process, even after ml_dtypes is imported."""
    global _lean_ffi_import
    _lean_ffi_import = True


@functools.lru_cache(maxsize=1)
def ffi() -> Any:
    """tvm_ffi with the runtime's global functions (vm.builtin.*, runtime.*) registered."""
    import sys

    apply_cpu_threads()
    # tvm_ffi would otherwise build a torch DLPack extension whenever torch is installed.
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    hide = _lean_ffi_import and "ml_dtypes" not in sys.modules and "tvm_ffi" not in sys.modules
    if hide:
        sys.modules["ml_dtypes"] = None  # type: ignore[assignment]  # tvm_ffi's import raises ImportError
    try:
        import tvm_ffi
    finally:
        if hide and sys.modules.get("ml_dtypes", False) is None:
            del sys.modules["ml_dtypes"]  # a later `import ml_dtypes` works as usual

    ctypes.CDLL(str(runtime_library_dir() / RUNTIME_LIBRARY), ctypes.RTLD_GLOBAL)
    return tvm_ffi


def global_func(name: str) -> Any:
    return ffi().get_global_func(name)


def _wheel_libraries(soname: str) -> list[str]:
    """Copies of `soname` installed by NVIDIA's wheels on sys.path (nvidia/<cu13>/lib/)."""
    import sys

    found = []
    for entry in sys.path:
        base = Path(entry or ".") / "nvidia"
        if base.is_dir():
            found += [str(p) for p in sorted(base.glob(f"*/lib/{soname}"))]
    return found


def _load_cudart(folder: Path) -> ctypes.CDLL:
    """The process's libcudart.so.13 if one is loaded already (torch brings its own: two
    copies in one process would each keep their own state), else the one beside the TVM
    runtime libraries, else the nvidia-cuda-runtime wheel's (`vtool-runtime[cuda]`), else
    the system's. TVM's libtvm_runtime_cuda.so looks only beside itself ($ORIGIN), so it is
    loaded here first and then matched by soname."""
    try:
        return ctypes.CDLL(CUDART, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
    except OSError:
        pass
    local = folder / CUDART
    candidates = ([str(local)] if local.exists() else []) + _wheel_libraries(CUDART) + [CUDART]
    errors = []
    for candidate in candidates:
        try:
            return ctypes.CDLL(candidate, ctypes.RTLD_GLOBAL)
        except OSError as e:
            errors.append(f"{candidate}: {e}")
    raise RuntimeLoadError(
        f"cannot load the CUDA runtime {CUDART} ({'; '.join(errors)}); install it with "
        f"`pip install nvidia-cuda-runtime` (or vtool-runtime[cuda]), put it beside {RUNTIME_LIBRARY} "
        "(VTOOL_TVM_LIBRARY_DIR) or on LD_LIBRARY_PATH") from None


@functools.lru_cache(maxsize=1)
def cuda_runtime() -> Any:
    """Register TVM's CUDA device API with the runtime (libtvm_runtime_cuda.so, loaded once)
    and return a CudaRuntime for device queries. Refuses with the dlopen reason when the
    library or the NVIDIA driver it needs (libcuda.so.1) cannot be loaded."""
    from vtool.runtime.artifact.cuda import CudaRuntime

    ffi()
    folder = runtime_library_dir()
    library = folder / CUDA_RUNTIME_LIBRARY
    if not library.exists():
        raise RuntimeLoadError(f"{folder} has no {CUDA_RUNTIME_LIBRARY}: this TVM runtime cannot run CUDA artifacts")
    cudart = _load_cudart(folder)
    try:
        ctypes.CDLL(str(library), ctypes.RTLD_GLOBAL)
    except OSError as e:
        if DRIVER in str(e):
            raise RuntimeLoadError(
                f"cannot run a CUDA artifact: the NVIDIA driver library {DRIVER} is not loadable here "
                f"(no NVIDIA driver installed?): {e}") from None
        raise RuntimeLoadError(f"cannot load {library}: {e}") from None
    get_attr = global_func("runtime.GetDeviceAttr")
    return CudaRuntime(cudart, device_name=lambda index: get_attr(2, index, 5))  # kDLCUDA, kDeviceName


CUBLAS = "libcublas.so.13"  # CUDA 13, as the TVM runtime's libcudart


def _cublas_candidates() -> list[str]:
    """VTOOL_CUBLAS_LIBRARY, then the nvidia-cublas wheel's copy on sys.path (torch's CUDA 13
    wheels install the same one), then the loader's own search."""
    found = [os.environ.get("VTOOL_CUBLAS_LIBRARY", "")] + _wheel_libraries(CUBLAS)
    return [c for c in found if c] + [CUBLAS]


@functools.lru_cache(maxsize=1)
def load_cublas() -> str:
    """Load cuBLAS for artifacts built with `--gemm cublas` (their library opens it by
    soname on first use, and finds this copy); returns the path loaded."""
    try:  # already in the process (torch loads its own): use that one
        ctypes.CDLL(CUBLAS, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        return CUBLAS
    except OSError:
        pass
    errors = []
    for candidate in _cublas_candidates():
        try:
            ctypes.CDLL(candidate, ctypes.RTLD_GLOBAL)
            return candidate
        except OSError as e:
            errors.append(f"{candidate}: {e}")
    raise RuntimeLoadError(
        f"this artifact runs its prefill and batched matmuls on cuBLAS and {CUBLAS} is not loadable "
        f"({'; '.join(errors)}); install it with `pip install nvidia-cublas`, set VTOOL_CUBLAS_LIBRARY, "
        "or rebuild with `vtool build --gemm tir`")
