"""CUDA builds on a machine without a GPU: the driver stub, the nvcc fatbin, the subprocess.

TVM's CUDA codegen embeds compiled GPU code only if libtvm_runtime_cuda.so is loaded in
the compiling process. That library links libcuda.so.1, the driver, which a GPU-less
build machine lacks. Without it, TVM silently embeds CUDA C source, to be JIT-compiled at
load with NVRTC. vtool refuses that: a library must carry SASS for every arch it names.
So a CUDA build:

1. compiles `cuda_stub.c` with the C compiler into the user cache
   (<cache>/cuda-stub/<digest>/libcuda.so.1). Every entry point returns
   CUDA_ERROR_NO_DEVICE. It is a build-time tool only and never ships;
2. runs the compile in a subprocess (`python -m vtool.toolchain.cuda_worker`) with the stub
   on LD_LIBRARY_PATH and TVM_CUDA_COMPILE_MODE=nvcc. libtvm_runtime_cuda.so is dlopen'ed
   when `tvm` is first imported, so the parent process (which may have imported tvm for a
   CPU build already) cannot pick the stub up any more. If the CUDA runtime is already
   loaded in this process (a real driver is installed), the compile runs in-process;
3. replaces TVM's `tvm_callback_cuda_compile` with `nvcc --fatbin`: one `-gencode` per
   arch (SASS) plus the PTX of the newest arch's family-portable virtual arch
   (compute_NN), so a newer GPU can JIT it. This runs inside `with target:`;
4. checks the exported library: the embedded CUDA module must be a fatbin whose SASS
   archs are exactly the requested ones, and no CUDA source may be embedded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from vtool import VtoolError
from vtool.runtime.paths import cache_root
from vtool.targets.table import sm_number

STUB_SOURCE = Path(__file__).with_name("cuda_stub.c")
# What libtvm_runtime_cuda.so needs from the driver (nm -D ... | grep " U cu").
STUB_SONAME = "libcuda.so.1"
PROGRESS_PREFIX = "vtool-progress: "

# nvcc flags besides the arch list: TVM's own nvcc path's (tvm/support/nvcc.py), which the
# GPU baseline ran with on the H200, minus ptxas -v and the local-memory warning, plus -w:
# the generated source draws ~1 MB of unused-variable warnings, which cost ~1 s.
NVCC_FLAGS = (
    "-O3",
    "-std=c++17",
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
    # No --use_fast_math: its approximate exp/div put float32 logits 1.2-1.5e-4 off
    # transformers on the H200 (7e-5 without), past the 1e-4 parity bound.
    "--expt-relaxed-constexpr", "--expt-extended-lambda",
    "--ptxas-options=--register-usage-level=10", "-w",
)


class CudaBuildError(VtoolError):
    """A CUDA build that cannot run here, or produced something other than a fatbin."""


# ---------------------------------------------------------------------------------------
# Tools


def find_nvcc() -> str:
    """nvcc from PATH, else $CUDA_HOME / $CUDA_PATH / /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    raise CudaBuildError("CUDA builds need nvcc (the CUDA 13 toolkit) and it is not on PATH, "
                         "in $CUDA_HOME/bin or in /usr/local/cuda/bin")


def nvcc_version(nvcc: str | None = None) -> str:
    """The toolkit release nvcc reports, e.g. "13.0.88" (part of the CUDA cache key)."""
    out = subprocess.run([nvcc or find_nvcc(), "--version"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"V(\d+\.\d+\.\d+)", out)
    if not match:
        raise CudaBuildError(f"cannot read the nvcc version from: {out.strip()[-200:]!r}")
    return match.group(1)


def cuda_toolkit_library(name: str) -> Path:
    """The toolkit's lib<name>.so next to nvcc (linked by soname: model.so then needs
    libcudart.so.13, which the GPU machine has), for objects nvcc compiled that call the CUDA
    runtime API (FlashInfer's kernels, native/block_mma.cu)."""
    nvcc = Path(find_nvcc()).resolve()
    roots = [nvcc.parent.parent] + [Path(r) for r in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                                                      "/usr/local/cuda") if r]
    for root in roots:
        for d in ("lib64", "lib", "targets/x86_64-linux/lib"):
            lib = root / d / f"lib{name}.so"
            if lib.exists():
                return lib
    raise CudaBuildError(f"no lib{name}.so next to {nvcc} (the CUDA toolkit's lib64) to link the library with")


def _c_compiler() -> str:
    for name in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)  # type: ignore[return-value]
    raise CudaBuildError("building the CUDA driver stub needs a C compiler (gcc, cc or clang; or set CC)")


def ensure_stub() -> Path:
    """The folder holding the build-time libcuda.so.1 stub, compiling it on first use."""
    source = STUB_SOURCE.read_bytes()
    folder = cache_root() / "cuda-stub" / hashlib.sha256(source).hexdigest()[:16]
    lib = folder / STUB_SONAME
    if lib.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{STUB_SONAME}.", dir=folder)
    os.close(fd)
    tmp = Path(tmp_name)
    cmd = [_c_compiler(), "-shared", "-fPIC", "-O1", f"-Wl,-soname,{STUB_SONAME}", "-o", str(tmp), str(STUB_SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise CudaBuildError(f"compiling the CUDA driver stub failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    tmp.replace(lib)
    return folder


def _cudart_dirs(nvcc: str) -> list[str]:
    """The toolkit's library folders that hold libcudart.so.13 (libtvm_runtime_cuda.so
    links it); added to the subprocess's LD_LIBRARY_PATH in case the loader's default
    paths lack them."""
    roots = [Path(nvcc).resolve().parent.parent]
    roots += [Path(r) for r in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if r]
    found: list[str] = []
    for root in roots:
        for d in (root / "lib64", root / "lib", root / "targets" / "x86_64-linux" / "lib"):
            if d.is_dir() and any(d.glob("libcudart.so*")) and str(d) not in found:
                found.append(str(d))
    return found


# ---------------------------------------------------------------------------------------
# nvcc


def gencode_flags(archs, ptx: str) -> list[str]:
    """One -gencode per compute capability: SASS for every requested arch, compiled from
    that capability's portable virtual arch (sm_90a from compute_90), and the PTX `ptx`
    joined to its own group. The kernels TVM generates use no arch-specific ("a"/"f")
    instructions, and one virtual arch means one front-end (cicc) run, the slow part
    of nvcc: ~4 s for the tiny model, where ptxas takes ~1 s per SASS arch.

        ("sm_80", "sm_90a"), "compute_90" ->
        -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=[sm_90a,compute_90]
    """
    groups: dict[str, list[str]] = {}
    for arch in archs:
        groups.setdefault(f"compute_{sm_number(arch)}", []).append(arch)
    groups.setdefault(ptx, []).append(ptx)
    flags = []
    for virtual, codes in groups.items():
        code = codes[0] if len(codes) == 1 else "[" + ",".join(codes) + "]"
        flags += ["-gencode", f"arch={virtual},code={code}"]
    return flags


def nvcc_command(nvcc: str, archs, ptx: str, source: str, output: str) -> list[str]:
    gencode = gencode_flags(archs, ptx)
    threads = ["--threads", "0"] if len(gencode) > 2 else []  # the -gencode groups in parallel
    return [nvcc, "--fatbin", *NVCC_FLAGS, *threads, *gencode, "-o", output, source]


@contextlib.contextmanager
def fatbin_callback(archs, ptx: str, record: dict[str, Any]) -> Iterator[None]:
    """Route TVM's CUDA compile through our nvcc fatbin command while the block runs;
    `record` receives the command line (with placeholder file names), nvcc seconds and
    the fatbin size, and on an nvcc failure the CudaBuildError under "_error"."""
    import tvm_ffi

    nvcc = find_nvcc()
    previous = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    record.setdefault("nvcc_calls", 0)
    record.setdefault("nvcc_seconds", 0.0)
    record["nvcc"] = nvcc_command("nvcc", archs, ptx, "kernels.cu", "kernels.fatbin")
    record["nvcc_version"] = nvcc_version(nvcc)

    def _compile(code: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="vtool-nvcc-") as tmp:
            src, out = os.path.join(tmp, "kernels.cu"), os.path.join(tmp, "kernels.fatbin")
            with open(src, "w") as f:
                f.write(code)
            dump = os.environ.get("VTOOL_CUDA_DUMP_DIR")  # debugging: keep every kernel source
            if dump:
                Path(dump).mkdir(parents=True, exist_ok=True)
                (Path(dump) / f"kernels-{record['nvcc_calls']}.cu").write_text(code)
            cmd = nvcc_command(nvcc, archs, ptx, src, out)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            record["nvcc_seconds"] = round(record["nvcc_seconds"] + time.perf_counter() - t0, 2)
            record["nvcc_calls"] += 1
            if proc.returncode != 0:
                keep = Path(tempfile.mkdtemp(prefix="vtool-nvcc-failed-")) / "kernels.cu"
                keep.write_text(code)
                error = CudaBuildError(f"nvcc failed (exit {proc.returncode}); the source is kept at {keep}\n"
                                       f"{' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-4000:]}")
                record["_error"] = error  # TVM's FFI turns it into a RuntimeError; the caller re-raises this
                raise error
            data = Path(out).read_bytes()
            record["fatbin_bytes"] = record.get("fatbin_bytes", 0) + len(data)
            return data

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", _compile, override=True)
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func("tvm_callback_cuda_compile", previous, override=True)


# ---------------------------------------------------------------------------------------
# Where the compile runs


def cuda_runtime_loaded() -> bool:
    """True if this process's TVM has its CUDA runtime (so codegen can embed a fatbin);
    False if tvm is not imported yet or libtvm_runtime_cuda.so failed to load."""
    if "tvm" not in sys.modules:
        return False
    import tvm_ffi

    return tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is not None


def real_driver_present() -> bool:
    """A CUDA driver the dynamic loader finds (not our stub): importing tvm here will load
    its CUDA runtime."""
    import ctypes

    try:
        lib = ctypes.CDLL(STUB_SONAME)
    except OSError:
        return False
    return not hasattr(lib, "vtool_stub_marker") and hasattr(lib, "cuDevicePrimaryCtxRelease")


def compile_in_process() -> bool:
    """Whether a CUDA compile can run in this process (else it runs in the subprocess)."""
    if os.environ.get("VTOOL_CUDA_SUBPROCESS") == "1":
        return False
    if "tvm" in sys.modules:
        return cuda_runtime_loaded()
    return real_driver_present()


def worker_env() -> dict[str, str]:
    """This process's environment for a CUDA compile subprocess: the driver stub and CUDA 13's
    libcudart on the loader path, nvcc on PATH, TVM told to compile with nvcc (fatbin)."""
    nvcc = find_nvcc()
    stub = ensure_stub()
    env = dict(os.environ)
    paths = [str(stub), *_cudart_dirs(nvcc)]
    if env.get("LD_LIBRARY_PATH"):
        paths.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(paths)
    env["TVM_CUDA_COMPILE_MODE"] = "nvcc"
    env["PATH"] = os.pathsep.join([str(Path(nvcc).parent), env.get("PATH", "")])
    return env


def run_worker(request: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """Run `python -m vtool.toolchain.cuda_worker` with the stub and return its result."""
    env = worker_env()
    with tempfile.TemporaryDirectory(prefix="vtool-cuda-") as tmp:
        req_path, res_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req_path.write_text(json.dumps(request))
        cmd = [sys.executable, "-m", "vtool.toolchain.cuda_worker", str(req_path), str(res_path)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail: list[str] = []
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                if line.startswith(PROGRESS_PREFIX):
                    progress(line[len(PROGRESS_PREFIX):].rstrip("\n"))
                else:
                    tail.append(line)
                    del tail[:-200]
            rc = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: do not leave the compile running
                proc.kill()
                proc.wait()
        if rc != 0 or not res_path.exists():
            text = "".join(tail).strip()
            # The worker reports a VtoolError as its last line; show that alone when present.
            last = text.splitlines()[-1] if text else ""
            if last.startswith("vtool-error: "):
                raise CudaBuildError(last[len("vtool-error: "):].replace("\\n", "\n"))
            raise CudaBuildError(f"the CUDA compile subprocess failed (exit {rc}):\n{text[-6000:]}")
        result = json.loads(res_path.read_text())
    result.setdefault("cuda", {})["codegen_process"] = "subprocess (build-time libcuda stub)"
    return result


# ---------------------------------------------------------------------------------------
# Inspecting a built library

FATBIN_MAGIC = 0xBA55ED50
_ENTRY_PTX, _ENTRY_ELF = 1, 2
_FLAG_ARCH_SPECIFIC = 0x100000  # sm_90a: "a" (checked against cuobjdump 13)
_FLAG_FAMILY_SPECIFIC = 0x200000  # sm_100f: "f"


@dataclasses.dataclass(frozen=True)
class FatbinEntry:
    kind: str  # "sass" | "ptx"
    arch: str  # sm_90a / compute_90
    size: int


def parse_fatbin(data: bytes, offset: int = 0) -> tuple[list[FatbinEntry], int]:
    """The entries of the fatbin at `offset` (header: magic u32, version u16, header size
    u16, payload size u64; each entry: kind u16, version u16, header size u32, payload
    size u64, ..., arch u32 at +28, flags u32 at +40) and the fatbin's end offset."""
    magic, _version, header_size, payload = struct.unpack_from("<IHHQ", data, offset)
    if magic != FATBIN_MAGIC:
        raise ValueError(f"no fatbin at offset {offset}")
    end = offset + header_size + payload
    if end > len(data):
        raise ValueError(f"truncated fatbin at offset {offset}")
    entries, pos = [], offset + header_size
    while pos < end:
        kind, _ev, entry_header, size = struct.unpack_from("<HHIQ", data, pos)
        sm, = struct.unpack_from("<I", data, pos + 28)
        flags, = struct.unpack_from("<I", data, pos + 40)
        suffix = "a" if flags & _FLAG_ARCH_SPECIFIC else "f" if flags & _FLAG_FAMILY_SPECIFIC else ""
        if kind == _ENTRY_ELF:
            entries.append(FatbinEntry("sass", f"sm_{sm}{suffix}", size))
        elif kind == _ENTRY_PTX:
            entries.append(FatbinEntry("ptx", f"compute_{sm}{suffix}", size))
        else:
            raise ValueError(f"unknown fatbin entry kind {kind} at offset {pos}")
        if entry_header < 16 or size <= 0:
            raise ValueError(f"malformed fatbin entry at offset {pos}")
        pos += entry_header + size
    return entries, end


def _embedded_cuda_formats(data: bytes) -> list[str]:
    """The `fmt` of every serialized TVM CUDA module in a library: key "cuda" (u64 length
    4), then u64 blob length, then fmt as a u64-length-prefixed string ("cubin", "fatbin",
    "ptx": compiled; "cuda": CUDA C source, JIT-compiled at load)."""
    formats = []
    for m in re.finditer(rb"\x04\x00\x00\x00\x00\x00\x00\x00cuda", data):
        p = m.end()
        if p + 16 > len(data):
            continue
        blob_len, n = struct.unpack_from("<QQ", data, p)
        if 0 < n < 16 and blob_len < len(data):
            formats.append(data[p + 16:p + 16 + n].decode(errors="replace"))
    return formats


_CUDA_SOURCE_MARKERS = (b'extern "C" __global__', b"__global__ void", b"#include <cuda_fp16.h>")


def inspect_library(path: str | Path) -> dict[str, Any]:
    """What GPU code a built library embeds: module formats, SASS archs, PTX archs, and
    whether any CUDA C source is in it."""
    data = Path(path).read_bytes()
    sass, ptx, fatbins = [], [], 0
    pos = data.find(struct.pack("<I", FATBIN_MAGIC))
    while pos != -1:
        try:
            entries, end = parse_fatbin(data, pos)
        except (ValueError, struct.error):
            end = pos + 4
        else:
            fatbins += 1
            sass += [e.arch for e in entries if e.kind == "sass"]
            ptx += [e.arch for e in entries if e.kind == "ptx"]
        pos = data.find(struct.pack("<I", FATBIN_MAGIC), end)
    return {"module_formats": _embedded_cuda_formats(data), "fatbins": fatbins, "sass": sass, "ptx": ptx,
            "cuda_source": any(marker in data for marker in _CUDA_SOURCE_MARKERS)}


def without_linked(path: str | Path, info: dict[str, Any], linked) -> tuple[list[str], list[str]]:
    """The SASS and PTX of `path` (its inspect_library `info`) that are TVM's module's own: the
    fatbins of the objects `linked` into it taken off, each of which must be there."""
    sass, ptx = list(info["sass"]), list(info["ptx"])
    for obj in linked:
        theirs = inspect_library(obj)
        for kind, have in (("SASS", sass), ("PTX", ptx)):
            for arch in theirs["sass" if kind == "SASS" else "ptx"]:
                if arch not in have:
                    raise CudaBuildError(f"{path} lacks the {kind} {arch} of the linked object {obj}")
                have.remove(arch)
    return sass, ptx


def check_library(path: str | Path, archs, ptx: str, linked=()) -> dict[str, Any]:
    """inspect_library, refusing a library that is not exactly what was asked for (`linked`:
    objects with kernels of their own linked into it, whose fatbins are taken off first)."""
    info = inspect_library(path)
    if "cuda" in info["module_formats"] or info["cuda_source"]:
        raise CudaBuildError(f"{path} embeds CUDA source instead of a fatbin (TVM's CUDA runtime was not loaded "
                             f"at codegen; module formats {info['module_formats']})")
    if not info["module_formats"] or info["fatbins"] == 0:
        raise CudaBuildError(f"{path} embeds no CUDA module (module formats {info['module_formats']})")
    sass, own_ptx = without_linked(path, info, linked)
    if sorted(sass) != sorted(archs) or own_ptx != [ptx]:
        raise CudaBuildError(f"{path} holds SASS {sass} and PTX {own_ptx} of its own; asked for SASS {list(archs)} "
                             f"and PTX [{ptx!r}]")
    return info


def check_attention_shape(cfg: Any) -> None:
    """Refuse shapes for which TVM 0.27's paged decode-attention kernel picks an illegal
    CUDA block. Its launch config (relax/frontend/nn/llm/_decode_kernels.py) is
    bdx = head_dim / 4 lanes, bdy = q heads per kv head, bdz = 512 / (bdx * bdy), and CUDA
    caps threadIdx.z at 64: head_dim * group < 32 fails at launch (CUDA_ERROR_INVALID_VALUE).
    Real models (head_dim >= 64) are far from it; tiny test shapes are not."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    bdx, bdy = max(1, cfg.head_dim // 4), group
    while bdx * bdy > 512 and bdy > 1:
        bdy //= 2
    bdz = max(512, bdx * bdy) // (bdx * bdy)
    if bdz > 64:
        raise VtoolError(
            f"head_dim={cfg.head_dim} with {group} query head(s) per KV head is not supported on CUDA: TVM's "
            f"decode-attention kernel would launch {bdz} threads in z (CUDA allows 64); head_dim x group "
            "must be at least 32")


def check_prefill_tiling(cfg: Any, dtype: str) -> None:
    """Refuse shapes for which TVM 0.27's paged prefill-attention kernels (prefill, ragged
    prefill, sliding window) have no legal tiling: their generator raises while the Relax
    module is built, after minutes of work, with a message that names no model field. TVM's
    own configuration function is the oracle, so the rule is exactly TVM's. It fails for a few
    float32 head dims that are not multiples of 16 (12 and 20 among the tiny test shapes);
    real models (head_dim 64, 128, 256) and 16-bit dtypes are far from it."""
    from tvm.relax.frontend.nn.llm._kernel_common import _get_prefill_kernel_config
    from tvm.target import Target

    try:
        _get_prefill_kernel_config(cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim, dtype,
                                   Target({"kind": "cuda", "arch": "sm_90a"}))
    except ValueError as err:
        raise VtoolError(
            f"head_dim={cfg.head_dim} in {dtype} is not supported on CUDA: TVM's prefill-attention kernel has no "
            f"legal tiling for it ({err}); build in bfloat16 or float16") from None
