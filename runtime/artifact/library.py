"""Load a compiled artifact (model.so + manifest.json) and bind a checkpoint's weights.

Every check that can refuse runs before the library is loaded: the manifest format,
the versions it was built with, the instruction set of its code (runtime/artifact/library_arch.py:
an aarch64 library is never dlopen'ed on x86-64), the CPU features it needs (x86, arm) or the GPU's
compute capability against the archs it holds code for (CUDA), the checkpoint's config
against the one it was built for, and each source tensor's shape.

The target family picks the device: an x86 or arm artifact runs on the CPU, a CUDA one on
cuda:0 (weights live there; logits come back to the host through `to_numpy`).
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

import vtool
from vtool.runtime.weights.checkpoint import Checkpoint, numpy_dtype
from vtool.runtime.artifact.library_arch import check_library_runs_here, check_target_runs_here
from vtool.runtime.artifact.manifest import (LIBRARY_NAME, ManifestError, artifact_config, read_manifest,
                                             source_config_mismatches)
from vtool.runtime.weights.ggml_blocks import TILE_ROWS
from vtool.runtime.weights.quant_blocks import repack
from vtool.runtime.weights.transforms import apply_transform
from vtool.runtime.artifact.tvm_runtime import bundled_tvm_version, cuda_runtime, ffi, global_func, load_cublas
from vtool.runtime.weights.fp8 import Fp8Rows, load_fp8
from vtool.runtime.weights.weights_file import WeightsFile, check_source

_DL_CPU = 1
_DL_CUDA = 2
_DL_CUDA_HOST = 3  # page-locked host memory (cudaMallocHost)
# A per-step upload at least this large goes through page-locked memory: from pageable memory
# cudaMemcpyAsync stages through a small driver buffer and, past it, waits for the stream (a
# batch's grammar mask, 500 KB at a 128k vocabulary and 32 rows, waited for the model step).
PINNED_MIN_BYTES = 64 * 1024
_NAIVE_ALLOCATOR = 1
_POOLED_ALLOCATOR = 2
# Target family -> (tvm_ffi device type, DLPack device type).
DEVICES = {"x86": ("cpu", _DL_CPU), "arm": ("cpu", _DL_CPU), "cuda": ("cuda", _DL_CUDA)}
log = logging.getLogger(__name__)
CUDA_DEVICE_INDEX = 0  # the first visible GPU (CUDA_VISIBLE_DEVICES picks which)


def installed_versions() -> dict[str, str | None]:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    # Without apache-tvm (the vtool-runtime wheel), TVM's version is that of the bundled libraries.
    tvm = version("apache-tvm") or bundled_tvm_version()
    return {"vtool": vtool.__version__, "tvm": tvm, "tvm_ffi": version("apache-tvm-ffi")}


def host_cpu_flags() -> set[str]:
    """CPU feature flags as Linux reports them (the kernel hides what the OS does not enable)."""
    from vtool.targets.host import linux_cpu_flags

    return set(linux_cpu_flags())


def check_compatible(manifest: dict[str, Any], checkpoint: Checkpoint | None) -> None:
    """Refuse, with the reason, an artifact that must not be loaded here or with this checkpoint."""
    built, have = manifest["versions"], installed_versions()
    for key in ("vtool", "tvm_ffi"):
        if built.get(key) != have.get(key):
            raise ManifestError(f"artifact built with {key} {built.get(key)}, this runtime has {have.get(key)}; rebuild it")
    if have.get("tvm") is not None and built.get("tvm") != have["tvm"]:
        raise ManifestError(f"artifact built with TVM {built.get('tvm')}, this runtime has TVM {have['tvm']}; rebuild it")
    target = manifest["target"]
    check_target_runs_here(target)  # another ISA's code: refused by name before any flag check
    if target.get("family") in ("x86", "arm"):
        missing = sorted(set(target.get("requires_cpu", [])) - host_cpu_flags())
        if missing:
            raise ManifestError(
                f"artifact targets {target['name']}, which this CPU cannot execute (missing {', '.join(missing)}); "
                "build for --target host"
            )
    elif target.get("family") == "cuda":
        check_gpu(target)
    else:
        raise ManifestError(f"artifact targets {target.get('name')} (family {target.get('family')!r}); "
                            f"this runtime runs {' and '.join(DEVICES)} artifacts")
    if checkpoint is not None:
        diffs = source_config_mismatches(manifest["source_config"], artifact_config(checkpoint.config(), manifest))
        if diffs:
            raise ManifestError(f"artifact was built for another config ({checkpoint.path}): " + "; ".join(diffs))
        if "weights_file" in manifest:  # weights quantized at build: from this checkpoint only
            check_source(manifest["weights_file"], checkpoint)


def check_gpu(target: dict[str, Any]) -> Any:
    """The GPU a CUDA artifact will run on (a vtool.runtime.artifact.cuda.GpuInfo), refusing by name
    when the CUDA runtime cannot load, there is no GPU, or the artifact holds no code for it."""
    from vtool.runtime.artifact.cuda import check_archs_cover

    gpu = cuda_runtime().gpu(CUDA_DEVICE_INDEX)
    check_archs_cover(target, gpu)
    return gpu


class CompiledModel:
    """The Relax VM over one artifact, with its weights bound in manifest order."""

    def __init__(self, folder: Path, checkpoint: Checkpoint, progress: Callable[[int, int], None] | None = None):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        check_compatible(self.manifest, checkpoint)
        self.ffi = ffi()
        self.device_type, dl_type = DEVICES[self.manifest["target"]["family"]]
        self.device_index = CUDA_DEVICE_INDEX if self.device_type == "cuda" else 0
        self.device = self.ffi.device(self.device_type, self.device_index)
        self._staging: dict[tuple[str, str], tuple[Any, int]] = {}
        self._host_slots: dict[str, tuple[int, Any, np.ndarray]] = {}  # upload_ints on the CPU
        # slot -> page-locked host buffers (tensor, numpy view), used in turn (_pinned_source)
        self._pinned: dict[tuple[str, str], list[tuple[Any, np.ndarray]]] = {}
        self._pinned_turn: dict[tuple[str, str], int] = {}
        self._pinned_ok = True  # False once page-locked memory could not be had: pageable copies
        if self.manifest.get("gemm") == "cublas":
            load_cublas()  # refuse here, by name, rather than at the first prefill
        check_library_runs_here(self.folder / LIBRARY_NAME)  # never dlopen another machine's code
        library = self.ffi.load_module(str(self.folder / LIBRARY_NAME))
        self.vm = library["vm_load_executable"]()
        if self.device_type == "cpu":
            # Naive, not pooled: TVM's PooledAllocator keeps every freed buffer for reuse at exactly
            # its page-rounded size and never gives one back. batch_prefill's intermediates are sized
            # by the step's packed token count, new almost every step under load, so the pool kept
            # about 31 KB per token of each new count for SmolLM2-135M (58 counts: +0.94 GB), without
            # bound (issue #13; tests/test_memory_bounded.py). On the CPU the naive allocator's
            # posix_memalign/free is as fast here (measured), and a freed buffer goes back to malloc.
            self.vm["vm_initialization"](_DL_CPU, 0, _NAIVE_ALLOCATOR)
        else:  # (device type, index, allocator) per device, the host last
            self.vm["vm_initialization"](dl_type, self.device_index, _POOLED_ALLOCATOR, _DL_CPU, 0, _POOLED_ALLOCATOR)
        t = time.perf_counter()
        self.params = self.ffi.convert(self._bind(checkpoint, progress))
        self.load_seconds = time.perf_counter() - t
        self.dtype: str = self.manifest["dtype"]
        self.hidden_size: int = self.manifest["config"]["hidden_size"]
        self.vocab_size: int = self.manifest["config"]["vocab_size"]
        self._fns = {name: self.vm[name] for name in self.manifest["entry_points"]}

    def function(self, name: str) -> Any:
        return self._fns[name]

    def has_function(self, name: str) -> bool:
        """Whether the library has this entry point (artifacts built before it was added lack it)."""
        return name in self._fns

    @property
    def on_gpu(self) -> bool:
        return self.device_type != "cpu"

    def upload(self, array: np.ndarray, dtype: str | None = None, slot: str | None = None) -> Any:
        """Copy into a TVM-allocated tensor on the model's device: TVM kernels assume 64-byte
        alignment, which zero-copy numpy buffers do not give (AVX-512 code crashed on them).

        `slot` names a per-step input (token ids, logit positions): on a GPU its device
        buffer is kept and reused (a view of the needed shape), sparing a cudaMalloc and a
        synchronizing cudaFree every step. A slot's previous tensor must be dead by then,
        which holds for inputs consumed by the call they are made for."""
        array = np.ascontiguousarray(array)
        dtype = dtype or str(array.dtype)
        if slot is not None and self.on_gpu:
            tensor = self._staged(slot, array.shape, dtype, array.size)
        else:
            tensor = global_func("runtime.TVMTensorAllocWithScope")(
                self.ffi.Shape(array.shape), dtype, self.device, None)
        if slot is not None and self.on_gpu:
            # Queued on the stream, not waited for: TVMTensorCopyFromBytes synchronizes the stream
            # after its copy, so every per-step input (token ids, a grammar's mask) waited for the
            # step the device was still running. From pageable host memory cudaMemcpyAsync stages
            # small copies before it returns, so `array` may change or die at once; the copy runs
            # in stream order, after the kernels that still read the slot's previous contents.
            # Large ones are copied into page-locked memory first (_pinned_source).
            source = self._pinned_source(slot, array, dtype) if array.nbytes >= PINNED_MIN_BYTES else None
            if source is None:
                if not array.flags.writeable:  # DLPack cannot export a read-only numpy array
                    array = array.copy()
                source = global_func("runtime.TVMTensorCreateView")(
                    self.ffi.from_dlpack(array), self.ffi.Shape(list(array.shape)), dtype, 0)
            global_func("runtime.TVMTensorCopyFromTo")(source, tensor)
        else:
            global_func("runtime.TVMTensorCopyFromBytes")(tensor, ctypes.c_void_p(array.ctypes.data), array.nbytes)
        return tensor

    def upload_ints(self, values: list[int], slot: str) -> Any:
        """`values` as a 1-D int32 tensor on the model's device, for a per-step input (token
        ids, logit positions), as upload(np.asarray(values, np.int32), slot=slot) gives it.

        On the CPU the slot keeps one tensor per length with a numpy view of its memory, and
        the values are written through the view: no allocation, dtype string, ascontiguousarray
        or copy call per step (a one-token decode step re-uses the same tensor every time). The
        slot's previous tensor is overwritten, so, as for upload's slots, it must be dead by
        then: it is consumed by the call it is made for (CPU calls return when done)."""
        if self.on_gpu:
            return self.upload(np.asarray(values, dtype=np.int32), slot=slot)
        n = len(values)
        held = self._host_slots.get(slot)
        if held is None or held[0] != n:
            tensor = global_func("runtime.TVMTensorAllocWithScope")(self.ffi.Shape([n]), "int32", self.device, None)
            held = self._host_slots[slot] = (n, tensor, np.from_dlpack(tensor))
        _, tensor, view = held
        if n == 1:
            view[0] = values[0]
        else:
            view[:] = values
        return tensor

    def _pinned_source(self, slot: str, array: np.ndarray, dtype: str) -> Any:
        """`array` copied into one of the slot's two page-locked host buffers, as a tensor of its
        shape (None: page-locked memory is not available; the caller copies from pageable memory).

        The buffers take turns: a buffer is written again two uploads of the slot later, and
        every caller of a slot waits for the work that read its previous upload before the
        next one (the engine collects each step before it launches the one after next)."""
        if not self._pinned_ok:
            return None
        key = (slot, dtype)
        size, nbytes = array.size, array.nbytes
        held = self._pinned.get(key)
        if held is None or held[0][1].nbytes < nbytes:
            capacity = max(64, 1 << max(0, size - 1).bit_length())
            try:
                host = self.ffi.device(_DL_CUDA_HOST, 0)
                held = []
                for _ in range(2):
                    tensor = global_func("runtime.TVMTensorAllocWithScope")(
                        self.ffi.Shape([capacity]), dtype, host, None)
                    held.append((tensor, np.from_dlpack(tensor)))
            except Exception as err:  # noqa: BLE001 - no page-locked memory here: pageable copies work
                log.info("per-step uploads from pageable memory: page-locked buffers failed (%s)", err)
                self._pinned_ok = False
                return None
            self._pinned[key] = held
        turn = self._pinned_turn.get(key, 0)
        self._pinned_turn[key] = turn ^ 1
        tensor, view = held[turn]
        view.view(np.uint8)[:nbytes] = array.reshape(-1).view(np.uint8)
        return global_func("runtime.TVMTensorCreateView")(tensor, self.ffi.Shape(list(array.shape)), dtype, 0)

    def scratch(self, slot: str, shape: tuple[int, ...], dtype: str) -> Any:
        """A device tensor of this shape for per-step results the runtime writes itself (a view
        of the slot's buffer, kept and grown as upload's staging: its previous contents must be
        dead by the next call with the same slot)."""
        size = 1
        for d in shape:
            size *= int(d)
        return self._staged(slot, tuple(shape), dtype, size)

    def _staged(self, slot: str, shape: tuple[int, ...], dtype: str, size: int) -> Any:
        buffer, capacity = self._staging.get((slot, dtype), (None, 0))
        if buffer is None or capacity < size:
            capacity = max(64, 1 << max(0, size - 1).bit_length())  # elements, a power of two
            buffer = global_func("runtime.TVMTensorAllocWithScope")(
                self.ffi.Shape([capacity]), dtype, self.device, None)
            self._staging[(slot, dtype)] = (buffer, capacity)
        return global_func("runtime.TVMTensorCreateView")(buffer, self.ffi.Shape(list(shape)), dtype, 0)

    def to_numpy(self, tensor: Any) -> np.ndarray:
        """A TVM tensor's values on the host. CPU: a zero-copy view (copy it to keep it past
        the next call); GPU: a fresh array (TVMTensorCopyToBytes waits for the copy)."""
        if not self.on_gpu:
            return np.from_dlpack(tensor)
        dtype = str(tensor.dtype)
        out = np.empty(tuple(int(d) for d in tensor.shape), dtype=numpy_dtype(dtype))
        global_func("runtime.TVMTensorCopyToBytes")(tensor, ctypes.c_void_p(out.ctypes.data), out.nbytes)
        return out

    def device_memory(self) -> tuple[int, int] | None:
        """(free, total) bytes on the model's GPU now; None on the CPU."""
        if not self.on_gpu:
            return None
        return cuda_runtime().mem_get_info(self.device_index)

    def _bind(self, checkpoint: Checkpoint, progress: Callable[[int, int], None] | None) -> list[Any]:
        plan = self.manifest["params"]
        # Blocks come from the checkpoint (a GGUF file's own) or from the artifact's weights
        # file (quantized at build time from a float checkpoint).
        record = self.manifest.get("weights_file")
        source = WeightsFile(self.folder, record) if record else checkpoint
        check_sources(plan, checkpoint, source)
        blocks = _BlockCache(source)
        fp8 = Fp8Rows()
        bound, streamed = [], {}  # streamed: plan index -> a part bound with its weight's first part
        for i, entry in enumerate(plan):
            if i not in streamed and _streams(entry, source) and not self.on_gpu:
                streamed.update(self._bind_streamed(plan, i, source))
            if i in streamed:
                bound.append(streamed.pop(i))
            else:
                if "fp8" in entry:  # an FP8 checkpoint's, or quantized here from a float one (runtime/weights/fp8.py)
                    value = fp8.part(entry["sources"], entry["fp8"]["part"],  # load_fp8 applies the transform
                                     lambda: load_fp8(checkpoint, entry["sources"], entry["transform"]))
                else:
                    arrays = ([blocks.part(src, entry["quant"]["part"]) for src in entry["sources"]] if "quant" in entry
                              else [checkpoint.load(src, dtype=entry["dtype"]) for src in entry["sources"]])
                    value = apply_transform(entry["transform"], arrays)
                    del arrays
                if list(value.shape) != entry["shape"] or str(value.dtype) != entry["dtype"]:
                    raise ManifestError(
                        f"{checkpoint.path}: {entry['name']!r} made from {entry['sources']} is {value.dtype} "
                        f"{list(value.shape)}, the library expects {entry['dtype']} {entry['shape']}")
                bound.append(self.upload(value, entry["dtype"]))
                del value
            if progress:
                progress(i + 1, len(plan))
        return bound

    def _bind_streamed(self, plan: list[dict[str, Any]], first: int, source: Any) -> dict[int, Any]:
        """The parts of plan[first]'s quantized weight (every entry with its sources), as
        runtime tensors filled a row chunk at a time: each chunk is read from the file,
        repacked and written into place, so neither the whole tensor's bytes nor its repacked
        copy are ever resident beside the bound parts (runtime/weights/block_rows.py)."""
        key = _stream_key(plan[first])
        members = {j: e for j, e in enumerate(plan) if j >= first and _stream_key(e) == key}
        entry = plan[first]
        sources = [source.block_rows(src) for src in entry["sources"]]
        tiles = sum(rows.rows for rows in sources) // TILE_ROWS
        alloc = global_func("runtime.TVMTensorAllocWithScope")
        tensors, views = {}, {}
        for j, e in members.items():
            if e["shape"][0] != tiles or any(rows.rows % TILE_ROWS for rows in sources):
                raise ManifestError(f"{source.path}: {e['name']!r} made from {e['sources']} has "
                                    f"{[rows.rows for rows in sources]} rows, the library expects {e['dtype']} "
                                    f"{e['shape']} (tiles of {TILE_ROWS} rows)")
            tensors[j] = alloc(self.ffi.Shape(e["shape"]), e["dtype"], self.device, None)
            views[j] = np.from_dlpack(tensors[j])  # the tensor's own memory, written in place
        tile = 0
        for src, rows in zip(entry["sources"], sources):
            cols = source.tensors()[src].shape[-1]
            step = max(TILE_ROWS, STREAM_CHUNK_BYTES // max(1, rows.row_bytes) // TILE_ROWS * TILE_ROWS)
            for start in range(0, rows.rows, step):
                stop = min(rows.rows, start + step)
                parts = repack(rows.kind, rows.read(start, stop), cols)
                at = tile + start // TILE_ROWS
                for j, e in members.items():
                    part, view = parts.get(e["quant"]["part"]), views[j]
                    if part is None or part.shape[1:] != view.shape[1:] or part.dtype != view.dtype:
                        got = "no such part" if part is None else f"{part.dtype} {[tiles, *part.shape[1:]]}"
                        raise ManifestError(f"{source.path}: {e['name']!r} made from {e['sources']} is {got}, the "
                                            f"library expects {e['dtype']} {e['shape']}")
                    view[at:at + part.shape[0]] = part
                del parts
            tile += rows.rows // TILE_ROWS
        return tensors


STREAM_CHUNK_BYTES = 1 << 20  # block bytes read, repacked and written per step of _bind_streamed
_STREAMED_TRANSFORMS = ("identity", "concat_rows")  # parts of one source, or of sources stacked by rows


def _streams(entry: dict[str, Any], source: Any) -> bool:
    """Whether a plan entry is bound a row chunk at a time (_bind_streamed)."""
    return "quant" in entry and entry["transform"] in _STREAMED_TRANSFORMS and hasattr(source, "block_rows")


def _stream_key(entry: dict[str, Any]) -> tuple[Any, ...] | None:
    """What the parts of one quantized weight share in the plan."""
    if "quant" not in entry:
        return None
    return tuple(entry["sources"]), entry["transform"], entry["quant"].get("format")


def check_sources(plan: list[dict[str, Any]], checkpoint: Checkpoint, blocks: Any = None) -> None:
    """Refuse, before anything is read, a missing source tensor or one stored in another
    block format than the library's kernels were compiled for. `blocks` (default: the
    checkpoint) holds the quantized parts' sources."""
    blocks = blocks if blocks is not None else checkpoint
    for entry in plan:
        want = entry.get("quant", {}).get("format")
        holder = checkpoint if want is None else blocks
        available = holder.tensors()
        for src in entry["sources"]:
            if src not in available:
                raise ManifestError(f"{holder.path}: missing tensor {src!r} needed by {entry['name']!r}")
            if want is not None and available[src].dtype != want:
                raise ManifestError(
                    f"{holder.path}: tensor {src!r} is stored as {available[src].dtype}, but this artifact "
                    f"was built to keep it as {want} blocks; rebuild for this file, or with --quantization none")


class _BlockCache:
    """Repacked parts of the sources of the weight being bound: its 2-3 parts are
    consecutive parameters, so each source is repacked once and then dropped."""

    def __init__(self, checkpoint: Any):  # a Checkpoint or a WeightsFile
        self.checkpoint = checkpoint
        self.repacked: dict[str, dict[str, np.ndarray]] = {}

    def part(self, source: str, part: str) -> np.ndarray:
        if source not in self.repacked:
            if len(self.repacked) >= 4:  # q|k|v is the widest fused weight
                self.repacked.clear()
            fmt, raw = self.checkpoint.load_blocks(source)
            cols = self.checkpoint.tensors()[source].shape[-1]
            self.repacked[source] = repack(fmt, raw, cols)
        return self.repacked[source][part]
