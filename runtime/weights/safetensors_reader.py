"""Hugging Face safetensors folders: config.json + model.safetensors, or shards listed
in model.safetensors.index.json.

The header is parsed here rather than through safetensors.safe_open because the
numpy framework of safe_open cannot return bfloat16. The format is small: an 8-byte
little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then
the data region, which is memory-mapped so opening a multi-GB model reads only headers.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

from vtool.runtime.weights.checkpoint import Checkpoint, CheckpointError, TensorInfo, numpy_dtype

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype -> numpy dtype name (numpy_dtype: bfloat16's and e4m3's ml_dtypes is imported
# only for such a file); weights are floats (e4m3: an FP8 checkpoint's, runtime/weights/fp8.py),
# anything else is refused by name
DTYPES: dict[str, str] = {"F32": "<f4", "F16": "<f2", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn"}
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1}
# Integer buffers that older transformers saved with BERT-style encoders (a 0..n-1 range and zeros,
# not weights): skipped when stored as integers; any other integer tensor is refused.
INTEGER_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")
INTEGER_DTYPES = ("I64", "I32", "I16", "I8", "U8")
UNREAD_FP8_DTYPES = ("F8_E5M2",)
MAX_HEADER = 100 * 1024 * 1024  # a header larger than this is corruption, not a model


class _Entry:
    __slots__ = ("file", "dtype", "shape", "start", "end")

    def __init__(self, file: Path, dtype: str, shape: tuple[int, ...], start: int, end: int):
        self.file, self.dtype, self.shape, self.start, self.end = file, dtype, shape, start, end


def read_header(file: Path) -> dict[str, _Entry]:
    """Parse and check one .safetensors header: every tensor's bytes must lie inside the file."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"{file}: truncated or not safetensors: header length {n} runs past the end of the file ({size} bytes)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: malformed safetensors header: {e}") from None
    base = 8 + n
    entries: dict[str, _Entry] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(meta["dtype"])
            shape = tuple(int(d) for d in meta["shape"])
            start, end = (int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {name!r} has a malformed header entry {meta!r}") from None
        if dtype in INTEGER_DTYPES and name.endswith(INTEGER_BUFFERS):
            continue
        if dtype in UNREAD_FP8_DTYPES:
            raise CheckpointError(
                f"{file}: tensor {name!r} has dtype {dtype}: e5m2 weights are not read (FP8 checkpoints in e4m3 "
                "are: --quantization fp8)")
        if dtype not in DTYPES:
            raise CheckpointError(
                f"{file}: tensor {name!r} has dtype {dtype}; supported weight dtypes: {', '.join(DTYPES)}"
            )
        want = math.prod(shape) * ITEMSIZE[dtype]
        if start < 0 or end - start != want:
            raise CheckpointError(
                f"{file}: tensor {name!r} ({dtype} {list(shape)}) needs {want} bytes "
                f"but its data_offsets {[start, end]} span {end - start}"
            )
        if base + end > size:
            raise CheckpointError(
                f"{file}: truncated: tensor {name!r} ends at byte {base + end} but the file has {size} bytes"
            )
        entries[name] = _Entry(file, dtype, shape, base + start, base + end)
    return entries


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: not readable JSON: {e}") from None


class SafetensorsCheckpoint(Checkpoint):
    format = "safetensors"

    def __init__(self, folder: Path):
        self.path = folder
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"{folder}: no config.json; a safetensors checkpoint folder needs one")
        if (folder / INDEX_FILE).is_file():
            self._entries = self._read_index(folder / INDEX_FILE)
        elif (folder / SINGLE_FILE).is_file():
            self._entries = read_header(folder / SINGLE_FILE)
        else:
            found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf", ".safetensors"))
            raise CheckpointError(
                f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} found"
                + (f" (found: {', '.join(found)}; .gguf files are opened by their own path)" if found else "")
            )
        self._infos = {n: TensorInfo(n, e.shape, e.dtype) for n, e in self._entries.items()}
        self._maps: dict[Path, np.memmap] = {}
        self._config: dict[str, Any] | None = None

    def _read_index(self, index: Path) -> dict[str, _Entry]:
        doc = _read_json(index)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: has no 'weight_map' of tensor name -> shard file")
        shards: dict[str, dict[str, _Entry]] = {}
        for name, shard in weight_map.items():
            if shard not in shards:
                file = index.parent / shard
                if not file.is_file():
                    raise CheckpointError(f"{index}: shard {shard!r} (holding {name!r}) is missing")
                shards[shard] = read_header(file)
            if name not in shards[shard]:
                raise CheckpointError(f"{index}: tensor {name!r} is listed in shard {shard!r} but that shard lacks it")
        entries: dict[str, _Entry] = {}
        for shard, header in shards.items():
            for name, entry in header.items():
                if name in entries:
                    raise CheckpointError(f"{index}: tensor {name!r} appears in more than one shard ({shard!r})")
                entries[name] = entry
        return entries

    def config(self) -> dict[str, Any]:
        if self._config is None:
            cfg = _read_json(self.path / "config.json")
            if not isinstance(cfg, dict):
                raise CheckpointError(f"{self.path / 'config.json'}: expected a JSON object")
            self._config = cfg
        return dict(self._config)

    def generation_config(self) -> dict[str, Any] | None:
        # Optional and advisory: a missing or broken file means "no defaults", not an error.
        try:
            gen = json.loads((self.path / "generation_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return gen if isinstance(gen, dict) else None

    def tensors(self) -> dict[str, TensorInfo]:
        return self._infos

    def _load_raw(self, name: str) -> np.ndarray:
        e = self._entries[name]
        mm = self._maps.get(e.file)
        if mm is None:
            mm = self._maps[e.file] = np.memmap(e.file, dtype=np.uint8, mode="r")
        # A plain ndarray view of the mapped bytes: nothing is read until it is used.
        return mm[e.start : e.end].view(np.ndarray).view(numpy_dtype(DTYPES[e.dtype])).reshape(e.shape)
