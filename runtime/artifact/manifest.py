"""manifest.json: the contract between a build and the runtime.

Everything the runtime needs to know about a compiled library is here, so runtime code
never imports the compiler or the model definitions. Bump FORMAT_VERSION on any
incompatible change; a manifest of another format version is refused.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vtool import VtoolError
from vtool.runtime.weights.hf_overrides import apply_hf_overrides

# 2: params may carry `quant` (a part of a weight kept in GGUF blocks); a format-1
# runtime would bind those as floats, so format 1 and 2 refuse each other.
FORMAT_VERSION = 2
LIBRARY_NAME = "model.so"
MANIFEST_NAME = "manifest.json"

REQUIRED_KEYS = ("format_version", "arch", "config", "config_digest", "source_config", "target", "dtype",
                 "quantization", "versions", "entry_points", "params", "library")


class ManifestError(VtoolError):
    """An artifact that is malformed or does not match what it is asked to run."""


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise ManifestError(f"manifest is missing {missing}")
    path = folder / MANIFEST_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def read_manifest(folder: Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST_NAME
    if not path.exists():
        raise ManifestError(f"{folder} is not a vtool artifact: no {MANIFEST_NAME}")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path} is not valid JSON: {e}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ManifestError(
            f"{path} has manifest format {manifest.get('format_version')!r}; this vtool reads format {FORMAT_VERSION}"
        )
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise ManifestError(f"{path} is missing {missing}")
    return manifest


def source_config_mismatches(built: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """Fields of the checkpoint's config that differ from those the artifact was built for."""
    diffs = []
    for key, want in sorted(built.items()):
        got = found.get(key)
        if got != want:
            diffs.append(f"{key}: artifact built for {want!r}, checkpoint has {got!r}")
    return diffs


def artifact_config(checkpoint_config: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's config as the artifact was built from it: with the manifest's
    `hf_overrides` applied (none in a build made without --hf-overrides)."""
    return apply_hf_overrides(checkpoint_config, manifest.get("hf_overrides"))
