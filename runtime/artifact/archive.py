"""Artifact archives at run time: verify a .tar.gz made by `vtool dist archive` and unpack it
into the cache.

An archive holds the artifact folder's files (manifest.json, model.so, ...) plus two files
`vtool dist archive` (toolchain/dist.py) adds: SHA256SUMS, every other file's sha256 in
sha256sum's format (so `sha256sum -c SHA256SUMS` checks an unpacked copy), and
provenance.json, where the artifact came from. Verification refuses, naming the file:
a member that is not a plain file (links, folders, devices), a name that is absolute,
climbs out (`..`) or appears twice, a file missing from SHA256SUMS or listed but absent,
a sha256 that differs, a malformed manifest, a library or weights file the manifest names
but the archive lacks, and a provenance.json that disagrees with the manifest.

`open_artifact` unpacks into <cache_root>/archives/<sha256 of the archive>, checked again
(SHA256SUMS) whenever it is reused; a damaged copy is unpacked afresh.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path
from typing import IO, Any, Callable

from vtool import VtoolError
from vtool.runtime.artifact.manifest import FORMAT_VERSION, MANIFEST_NAME, REQUIRED_KEYS
from vtool.runtime.paths import cache_root

SUMS_NAME = "SHA256SUMS"
PROVENANCE_NAME = "provenance.json"
PROVENANCE_FORMAT = 1
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")
_SMALL_FILES = (SUMS_NAME, MANIFEST_NAME, PROVENANCE_NAME)  # read into memory to be checked
_SMALL_LIMIT = 256 << 20
_CHUNK = 1 << 20
# sha256sum's lines as `vtool dist archive` writes them: "<lowercase hex>  <name>\n". Only that
# spelling is read (not " *name", uppercase hex or CR line ends, which sha256sum also takes), so
# that every change to a byte of SHA256SUMS is refused.
_SUMS_LINE = re.compile(r"([0-9a-f]{64})  ([^\r\n]+)")

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


class ArchiveError(VtoolError):
    """An artifact archive that is damaged, tampered with, or not one vtool made."""


@dataclasses.dataclass(frozen=True)
class ArchiveInfo:
    """A verified archive: its own sha256, every file's sha256 (SHA256SUMS), the manifest
    and the provenance record."""

    path: Path
    sha256: str
    files: dict[str, str]
    manifest: dict[str, Any]
    provenance: dict[str, Any]


def archive_cache() -> Path:
    return cache_root() / "archives"


def expected_provenance(manifest: dict[str, Any], manifest_sha256: str) -> dict[str, Any]:
    """The part of provenance.json that restates the manifest: `vtool dist archive` writes it,
    verification holds each key equal. None where the manifest predates `build.provenance`."""
    build = manifest.get("build") or {}
    record = build.get("provenance") or {}
    return {
        "manifest_sha256": manifest_sha256,
        "cache_key": manifest.get("cache_key"),
        "versions": manifest.get("versions"),  # vtool, apache-tvm, apache-tvm-ffi
        "target": manifest.get("target"),  # name, family, TVM target, features, CPU flags / archs
        "checkpoint": record.get("checkpoint"),
        "options": {"requested": record.get("options"),
                    "resolved": {"target": (manifest.get("target") or {}).get("name"),
                                 **{k: manifest.get(k) for k in ("dtype", "quantization", "activations", "gemm",
                                                                 "attention")}}},
        "build_host": record.get("host"),
        "built_at": record.get("time"),
        "build_seconds": build.get("seconds"),
    }


def check_member_name(name: str) -> str | None:
    """Why `name` may not be unpacked, or None: it must be a relative path of plain parts."""
    if not name:
        return "an empty name"
    if name.startswith("/") or "\\" in name or "\0" in name:
        return "an absolute or non-POSIX path"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "a path with an empty, '.' or '..' part"
    return None


def parse_sums(where: str, text: bytes) -> dict[str, str]:
    """SHA256SUMS -> {file: sha256}, refusing a malformed line or a file listed twice."""
    try:
        lines = text.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise ArchiveError(f"{where}: {SUMS_NAME} is not UTF-8 text") from None
    if lines.pop() != "":
        raise ArchiveError(f"{where}: {SUMS_NAME} does not end with a line break")
    sums: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        match = _SUMS_LINE.fullmatch(line)
        if not match:
            raise ArchiveError(f"{where}: {SUMS_NAME} line {number} is not '<sha256>  <file>': {line[:120]!r}")
        digest, name = match.groups()
        why = check_member_name(name)
        if why or name == SUMS_NAME:
            raise ArchiveError(f"{where}: {SUMS_NAME} line {number} lists {name!r}, "
                               f"{why or 'the sums file itself'}")
        if name in sums:
            raise ArchiveError(f"{where}: {SUMS_NAME} lists {name} twice")
        sums[name] = digest
    return sums


def check_contents(where: str, digests: dict[str, str], small: dict[str, bytes]) -> ArchiveInfo:
    """Everything but the member types and names: sums, manifest, provenance. `digests`: the
    sha256 of every file found; `small`: the bytes of SHA256SUMS, manifest.json and
    provenance.json where found. Returns the ArchiveInfo (its path and sha256 left empty)."""
    if SUMS_NAME not in small:
        raise ArchiveError(f"{where}: no {SUMS_NAME}; an artifact archive lists every file's sha256 there "
                           "(make archives with `vtool dist archive`)")
    sums = parse_sums(where, small[SUMS_NAME])
    for name in sorted(sums):
        if name not in digests:
            raise ArchiveError(f"{where}: {SUMS_NAME} lists {name}, which the archive lacks")
    for name in sorted(digests):
        if name != SUMS_NAME and name not in sums:
            raise ArchiveError(f"{where}: {name} is in the archive but not in {SUMS_NAME}")
    for name in sorted(sums):
        if digests[name] != sums[name]:
            raise ArchiveError(f"{where}: {name} does not match {SUMS_NAME} (its sha256 is {digests[name][:16]}..., "
                               f"{SUMS_NAME} lists {sums[name][:16]}...)")
    manifest = _json(where, small, MANIFEST_NAME)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArchiveError(f"{where}: {MANIFEST_NAME} has format {manifest.get('format_version')!r}; "
                           f"this vtool reads format {FORMAT_VERSION}")
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise ArchiveError(f"{where}: {MANIFEST_NAME} is missing {missing}")
    library = manifest["library"]
    if library not in sums:
        raise ArchiveError(f"{where}: {MANIFEST_NAME} names the library {library!r}, which the archive lacks")
    weights = manifest.get("weights_file")
    if weights:
        if weights.get("file") not in sums:
            raise ArchiveError(f"{where}: {MANIFEST_NAME} names the weights file {weights.get('file')!r}, "
                               "which the archive lacks")
        if sums[weights["file"]] != weights.get("sha256"):
            raise ArchiveError(f"{where}: {weights['file']} has sha256 {sums[weights['file']][:16]}..., "
                               f"{MANIFEST_NAME} records {str(weights.get('sha256'))[:16]}...")
    provenance = _json(where, small, PROVENANCE_NAME)
    if provenance.get("format") != PROVENANCE_FORMAT:
        raise ArchiveError(f"{where}: {PROVENANCE_NAME} has format {provenance.get('format')!r}; "
                           f"this vtool reads format {PROVENANCE_FORMAT}")
    for key, want in expected_provenance(manifest, digests[MANIFEST_NAME]).items():
        if provenance.get(key) != want:
            raise ArchiveError(f"{where}: {PROVENANCE_NAME} disagrees with {MANIFEST_NAME} on {key!r} "
                               f"({_short(provenance.get(key))} against {_short(want)})")
    return ArchiveInfo(Path(where), "", sums, manifest, provenance)


def _json(where: str, small: dict[str, bytes], name: str) -> dict[str, Any]:
    if name not in small:
        raise ArchiveError(f"{where}: no {name}")
    try:
        value = json.loads(small[name])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArchiveError(f"{where}: {name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ArchiveError(f"{where}: {name} is not a JSON object")
    return value


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 100 else text[:97] + "..."


class _HashingReader:
    """A file read front to back, hashed as it goes: the archive verified is the one hashed."""

    def __init__(self, raw: IO[bytes], progress: Progress | None, total: int):
        self.raw, self.hash, self.done = raw, hashlib.sha256(), 0
        self.progress, self.total = progress, total

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.hash.update(data)
        self.done += len(data)
        if self.progress:
            self.progress(self.done, self.total)
        return data

    def drain(self) -> str:
        while self.read(_CHUNK):
            pass
        return self.hash.hexdigest()


def _scan(path: Path, dest: Path | None, progress: Progress | None) -> ArchiveInfo:
    """Read the archive once: check each member's type and name, hash it, and write it
    under `dest` when given; then check the contents. Any refusal names the member."""
    where = str(path)
    digests: dict[str, str] = {}
    small: dict[str, bytes] = {}
    try:
        with open(path, "rb") as raw:
            reader = _HashingReader(raw, progress, path.stat().st_size)
            with tarfile.open(fileobj=reader, mode="r|gz") as tar:  # type: ignore[call-overload]
                for member in tar:
                    _check_member(where, member, digests)
                    digests[member.name] = _copy_member(where, tar, member, dest, small)
            archive_sha256 = reader.drain()
    except ArchiveError:
        raise
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise ArchiveError(f"{where}: not a readable .tar.gz ({type(e).__name__}: {e})") from None
    info = check_contents(where, digests, small)
    return dataclasses.replace(info, path=path, sha256=archive_sha256)


def _check_member(where: str, member: tarfile.TarInfo, seen: dict[str, str]) -> None:
    name = member.name
    why = check_member_name(name)
    if why:
        raise ArchiveError(f"{where}: member {name!r} is {why}; an artifact archive holds relative paths only")
    if not member.isreg():
        kind = ("a symbolic link" if member.issym() else "a hard link" if member.islnk() else
                "a folder" if member.isdir() else "a device or FIFO")
        raise ArchiveError(f"{where}: member {name!r} is {kind}; an artifact archive holds plain files only")
    if name in seen:
        raise ArchiveError(f"{where}: member {name!r} appears twice")


def _copy_member(where: str, tar: tarfile.TarFile, member: tarfile.TarInfo, dest: Path | None,
                 small: dict[str, bytes]) -> str:
    """The member's sha256, writing it to dest/name on the way; keeps the small files' bytes."""
    keep = member.name in _SMALL_FILES
    if keep and member.size > _SMALL_LIMIT:
        raise ArchiveError(f"{where}: {member.name} is {member.size} bytes, more than a {member.name} can be")
    source = tar.extractfile(member)
    assert source is not None  # a regular file
    h, kept = hashlib.sha256(), bytearray()
    out = None
    if dest is not None:
        target = dest / member.name
        target.parent.mkdir(parents=True, exist_ok=True)
        out = open(target, "xb")  # "x": a name seen twice could never overwrite
    try:
        while chunk := source.read(_CHUNK):
            h.update(chunk)
            if keep:
                kept += chunk
            if out:
                out.write(chunk)
    finally:
        if out:
            out.close()
    if keep:
        small[member.name] = bytes(kept)
    return h.hexdigest()


def verify_archive(path: Path, progress: Progress | None = None) -> ArchiveInfo:
    """Verify an archive without unpacking it; raises ArchiveError naming what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ArchiveError(f"{path}: no such archive file")
    return _scan(path, None, progress)


def check_unpacked(folder: Path) -> ArchiveInfo:
    """Verify an unpacked archive folder as its archive was: same files, same sums."""
    digests: dict[str, str] = {}
    small: dict[str, bytes] = {}
    for file in sorted(folder.rglob("*")):
        name = file.relative_to(folder).as_posix()
        if file.is_symlink() or not (file.is_file() or file.is_dir()):
            raise ArchiveError(f"{folder}: {name} is not a plain file")
        if file.is_file():
            digests[name] = _sha256_file(file)
            if name in _SMALL_FILES:
                small[name] = file.read_bytes()
    return dataclasses.replace(check_contents(str(folder), digests, small), path=folder)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def is_archive(path: Path) -> bool:
    return Path(path).name.endswith(ARCHIVE_SUFFIXES)


def open_artifact(path: Path, progress: Progress | None = None) -> Path:
    """The artifact folder for `path`: a folder as it is; a .tar.gz verified and unpacked into
    the cache (reused while intact). Raises ArchiveError (a VtoolError) naming what is wrong."""
    path = Path(path)
    if path.is_dir():
        return path
    if not path.is_file():
        raise ArchiveError(f"{path}: no such artifact folder or archive")
    if not is_archive(path):
        raise ArchiveError(f"{path}: an artifact is a folder or a {' / '.join(ARCHIVE_SUFFIXES)} archive made by "
                           "`vtool dist archive`")
    digest = _sha256_file(path)
    folder = archive_cache() / digest[:32]
    if folder.is_dir():
        try:
            check_unpacked(folder)
            return folder
        except ArchiveError:
            shutil.rmtree(folder, ignore_errors=True)  # damaged in the cache: unpack it again
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=folder.parent))
    try:
        info = _scan(path, staging, progress)
        if info.sha256 != digest:
            raise ArchiveError(f"{path}: the file changed while it was being read; try again")
        try:
            staging.rename(folder)  # whole or not at all
        except OSError:  # another process unpacked it first
            check_unpacked(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
