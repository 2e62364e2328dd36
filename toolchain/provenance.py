"""What a build records about where its artifact came from (manifest `build.provenance`):
the checkpoint's digest, the options as asked, the build host and the time.

`vtool dist archive` copies it into the archive's provenance.json (toolchain/dist.py), and
`vtool dist verify` holds the two equal (runtime/artifact/archive.py). None of it is in the
cache key: a cached library built from another checkpoint of the same config (the artifact
holds no weights unless they were quantized at build time) keeps the first checkpoint's record.
"""
from __future__ import annotations

import datetime
import hashlib
import platform
from pathlib import Path
from typing import Any

from vtool.runtime.weights.checkpoint import Checkpoint
from vtool.runtime.weights.default_model import sha256_of

# A safetensors folder's files that make the model (the tokenizer's files do not reach the library).
_FOLDER_FILES = ("config.json", "model.safetensors.index.json")


def checkpoint_files(ckpt: Checkpoint) -> list[Path]:
    """The files whose bytes are the checkpoint: the .gguf file, or config.json, the shard
    index when there is one, and every .safetensors file of the folder."""
    if ckpt.path.is_file():
        return [ckpt.path]
    folder = ckpt.path
    named = [folder / n for n in _FOLDER_FILES if (folder / n).is_file()]
    return named + sorted(folder.glob("*.safetensors"))


def checkpoint_record(ckpt: Checkpoint) -> dict[str, Any]:
    """{name, format, files: {file: sha256}, sha256}: `sha256` hashes the files' lines in
    sha256sum's format ("<sha256>  <file>\\n", sorted), so one value names the whole checkpoint."""
    files = {p.name: sha256_of(p) for p in checkpoint_files(ckpt)}
    sums = "".join(f"{digest}  {name}\n" for name, digest in sorted(files.items()))
    return {"name": ckpt.path.name, "format": ckpt.format, "files": files,
            "sha256": hashlib.sha256(sums.encode()).hexdigest()}


def cpu_model() -> str:
    """The CPU's model name as Linux reports it, else what Python's platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "Hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_record(ckpt: Checkpoint, options: dict[str, Any]) -> dict[str, Any]:
    """The manifest's `build.provenance`. `options`: the build's options as asked (the
    manifest's top-level keys hold what they resolved to)."""
    return {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"hostname": platform.node(), "machine": platform.machine(), "cpu": cpu_model()},
        "checkpoint": checkpoint_record(ckpt),
        "options": dict(options),
    }
