"""The weights a build quantized itself (`--quantization q4_0|q4_1|q8_0|q4_k|q6_k` on a float checkpoint).

They travel in the artifact folder as one GGUF file (written by gguf-py, read here with
vtool's own header reader) holding, under their Hugging Face names and in HF row order,
the GGML blocks of every weight the library keeps quantized. The runtime binds those
parts from it and everything else (norms, biases, weights left float) from the checkpoint
it is handed. So that the two halves always belong to one model, the build records a
fingerprint of the source tensors it quantized, and a checkpoint whose tensors differ is
refused. Nothing here imports TVM or the gguf package.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from vtool.runtime.weights.block_rows import BlockRows
from vtool.runtime.weights.checkpoint import Checkpoint, TensorInfo
from vtool.runtime.weights.gguf_reader import GGUFFile
from vtool.runtime.artifact.manifest import ManifestError

WEIGHTS_NAME = "weights.gguf"
# Stored safetensors dtype -> the load() dtype that returns the stored bytes untouched.
STORED_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# The fingerprint hashes every quantized tensor's name, type and shape, plus SAMPLES windows
# of WINDOW bytes spread over its data: reading whole tensors would cost what binding them
# from the file saves. A different checkpoint (another fine-tune, another dtype) differs in
# every window; an in-place edit of a few rows may not, which the build's cache key catches
# by the files' sizes and modification times.
SAMPLES = 16
WINDOW = 1024


def source_fingerprint(checkpoint: Checkpoint, names: Iterable[str]) -> str:
    """sha256 (hex) over the float tensors `names` of `checkpoint`, as described above."""
    infos = checkpoint.tensors()
    h = hashlib.sha256()
    for name in sorted(set(names)):
        info = infos.get(name)
        if info is None:
            raise ManifestError(f"{checkpoint.path}: missing tensor {name!r}")
        if info.dtype not in STORED_DTYPES:
            raise ManifestError(f"{checkpoint.path}: tensor {name!r} is stored as {info.dtype}, not a float "
                                f"({', '.join(STORED_DTYPES)})")
        data = checkpoint.load(name, STORED_DTYPES[info.dtype]).reshape(-1).view(np.uint8)
        h.update(f"{name}|{info.dtype}|{list(info.shape)}|".encode())
        last = max(0, data.size - WINDOW)
        for start in sorted({round(last * i / (SAMPLES - 1)) for i in range(SAMPLES)}):
            h.update(data[start:start + WINDOW].tobytes())
    return h.hexdigest()


def check_source(record: dict[str, Any], checkpoint: Checkpoint) -> None:
    """Refuse a checkpoint other than the one the artifact's quantized weights were made from."""
    if checkpoint.format != record["source_format"]:
        raise ManifestError(
            f"this artifact holds weights quantized at build time from a {record['source_format']} checkpoint; "
            f"{checkpoint.path} is a {checkpoint.format} checkpoint")
    got = source_fingerprint(checkpoint, record["sources"])
    if got != record["source_fingerprint"]:
        raise ManifestError(
            f"{checkpoint.path}: its weights differ from those this artifact quantized at build time "
            f"(source fingerprint {got[:16]}, artifact {record['source_fingerprint'][:16]}); build for this "
            "checkpoint (vtool build --model ... --quantization " + record["scheme"] + ")")


class WeightsFile:
    """The artifact's quantized weights, as a blocks source for the binder: `tensors()` and
    `load_blocks(name)` like a GGUF checkpoint's (HF names, HF rows, no un-permuting)."""

    def __init__(self, folder: Path, record: dict[str, Any]):
        self.path = Path(folder) / record["file"]
        if not self.path.is_file():
            raise ManifestError(f"{folder}: the manifest names {record['file']!r} (the quantized weights) but it "
                                "is missing; copy the whole artifact folder")
        size = self.path.stat().st_size
        if size != record["bytes"]:
            raise ManifestError(f"{self.path}: {size} bytes, the manifest records {record['bytes']}; the file is "
                                "damaged or from another build")
        try:
            header = GGUFFile(self.path)
        except Exception as e:  # noqa: BLE001  (malformed: ValueError, KeyError or truncation)
            raise ManifestError(f"{self.path}: not a readable GGUF file: {e}") from None
        self._entries = {t.name: t for t in header.tensors}
        self._infos = {t.name: TensorInfo(t.name, tuple(int(d) for d in reversed(t.shape.tolist())),
                                          t.tensor_type.name) for t in header.tensors}

    def tensors(self) -> dict[str, TensorInfo]:
        return self._infos

    def load_blocks(self, name: str) -> tuple[str, np.ndarray]:
        """(GGML type name, raw bytes uint8 [rows, row_bytes]), read rather than mapped (as
        GGUFCheckpoint.load_blocks: the bytes only pass through on their way to the repacker)."""
        rows = self.block_rows(name)
        return rows.kind, rows.read(0, rows.rows)

    def block_rows(self, name: str) -> BlockRows:
        """Where tensor `name`'s blocks lie, to be read a few rows at a time (the binder
        streams them: runtime/weights/block_rows.py)."""
        t = self._entries.get(name)
        if t is None:
            raise ManifestError(f"{self.path}: no tensor named {name!r}")
        rows = math.prod(self._infos[name].shape[:-1])
        return BlockRows(t.tensor_type.name, self.path, int(t.data_offset), rows, int(t.n_bytes) // rows)
