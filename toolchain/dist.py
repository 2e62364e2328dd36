"""Release files: an artifact archive (.tar.gz with SHA256SUMS and provenance.json) and the
vtool-runtime wheel (the runtime alone, with TVM's runtime libraries and no compiler).

The runtime side of archives (verify, unpack) is runtime/artifact/archive.py; the archive
written here is checked there before it is handed back.
"""
from __future__ import annotations

import base64
import datetime
import gzip
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import re
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import vtool
from vtool import VtoolError
from vtool.runtime.artifact.tvm_runtime import BUNDLED_TVM_VERSION_FILE
from vtool.runtime.artifact.archive import (PROVENANCE_FORMAT, PROVENANCE_NAME, SUMS_NAME, ArchiveInfo,
                                            expected_provenance, verify_archive)
from vtool.runtime.artifact.manifest import MANIFEST_NAME, read_manifest

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


class DistError(VtoolError):
    pass


# ---- artifact archives -------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def artifact_files(folder: Path) -> dict[str, Path]:
    """name (POSIX, relative) -> path of every file an archive of `folder` carries: all its
    plain files but an earlier SHA256SUMS and provenance.json (written afresh). Links refused."""
    files = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_symlink():
            raise DistError(f"{folder}: {name} is a symbolic link; an artifact archive holds plain files only")
        if path.is_file() and name not in (SUMS_NAME, PROVENANCE_NAME):
            files[name] = path
    return files


def provenance_record(manifest: dict, manifest_sha256: str) -> dict:
    """provenance.json: the manifest's record of the build (versions, target and features,
    checkpoint digest, options, host, time) plus when, where and by which vtool it was archived."""
    expected = expected_provenance(manifest, manifest_sha256)
    missing = [key for key in ("checkpoint", "build_host", "built_at") if expected[key] is None]
    if missing or expected["options"]["requested"] is None:
        raise DistError(f"{MANIFEST_NAME} has no build.provenance (it lacks {missing or ['options']}): the artifact "
                        "was built by an older vtool; rebuild it (`vtool build --force`) to archive it")
    return {"format": PROVENANCE_FORMAT, **expected,
            "archived_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "archived_by": {"vtool": vtool.__version__, "hostname": platform.node()}}


def write_archive(folder: Path, output: Path, progress: Progress | None = None) -> ArchiveInfo:
    """Pack artifact `folder` into `output` (.tar.gz): its files, SHA256SUMS and
    provenance.json, all at the archive's root; the written archive is verified."""
    folder, output = Path(folder), Path(output)
    manifest = read_manifest(folder)  # refuses a folder that is no artifact
    files = artifact_files(folder)
    sums = {name: _sha256(path) for name, path in files.items()}
    provenance = json.dumps(provenance_record(manifest, sums[MANIFEST_NAME]), indent=1, sort_keys=True).encode()
    sums[PROVENANCE_NAME] = hashlib.sha256(provenance).hexdigest()
    sums_text = "".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items())).encode()
    total = sum(p.stat().st_size for p in files.values())
    done = 0
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".archive-", dir=output.parent)
    try:
        # Fixed times and owners: the same artifact archived twice differs only in provenance's time.
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=6) as gz, \
                tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(_member(SUMS_NAME, len(sums_text)), io.BytesIO(sums_text))
            tar.addfile(_member(PROVENANCE_NAME, len(provenance)), io.BytesIO(provenance))
            for name, path in files.items():
                with open(path, "rb") as f:
                    tar.addfile(_member(name, path.stat().st_size), f)
                done += path.stat().st_size
                if progress:
                    progress(done, total)
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return verify_archive(output)


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info


# ---- the runtime wheel ------------------------------------------------------------------

WHEEL_NAME = "vtool-runtime"
# Subpackages the runtime needs (vtool/__init__.py comes along): the runtime imports
# vtool.targets.host, and nothing of models/, schedules/ or toolchain/.
RUNTIME_PACKAGES = ("runtime", "targets")
LIBRARY_SUBDIR = "runtime/artifact/lib"  # tvm_runtime.BUNDLED_LIBRARY_DIR, inside the package
# TVM's runtime libraries (Apache-2.0); libtvm_compiler.so (259 MB) is never shipped.
TVM_LIBRARIES = ("libtvm_runtime.so", "libtvm_runtime_extra.so", "libtvm_runtime_cuda.so")
REQUIRED_LIBRARY = "libtvm_runtime.so"
# What the runtime imports (runtime/, targets/, tvm_ffi), by distribution. Specifiers come from
# vtool's own requirements when it names the distribution, else from here.
RUNTIME_REQUIREMENTS = {
    "apache-tvm-ffi": "", "numpy": "", "safetensors": "", "gguf": "", "tokenizers": "", "jinja2": "",
    "click": "", "rich": "", "psutil": "", "fastapi": "", "pydantic": "", "uvicorn": "",
    "prometheus-client": "", "pyzmq": "", "msgspec": "", "httpx": "", "huggingface-hub": ">=0.20",
    "ml-dtypes": ">=0.4",  # the checkpoint readers' bfloat16 (apache-tvm brings it in a full install)
    "llguidance": "",  # grammar-constrained decoding (runtime/sampling/grammar.py)
    "threadpoolctl": "",  # one BLAS thread for the embedding pooler (runtime/engine/pooling.py)
}
# `vtool-runtime[cuda]`: the CUDA 13 runtime TVM's libtvm_runtime_cuda.so links and cuBLAS
# (libcublas.so.13) for artifacts built with `--gemm cublas`.
CUDA_REQUIREMENTS = ("nvidia-cuda-runtime>=13.0,<14", "nvidia-cublas>=13.0,<14")
ENTRY_POINT = "vtool = vtool.runtime.cli:main"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_requirements() -> list[str]:
    """The wheel's Requires-Dist lines: RUNTIME_REQUIREMENTS, pinned as vtool pins them."""
    pinned = {}
    for line in importlib.metadata.requires("vtool") or []:
        if ";" in line:  # an extra's requirement
            continue
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)", line)
        if match:
            pinned[_canonical(match.group(1))] = match.group(2).strip()
    return [f"{name}{pinned.get(name) or spec}" for name, spec in RUNTIME_REQUIREMENTS.items()]


def tvm_runtime_files() -> tuple[str, dict[str, Path], dict[str, Path], list[str]]:
    """(apache-tvm's version, library name -> path, license name -> path, its wheel's
    platform tags) from the installed apache-tvm distribution, found by its file list
    (importing `tvm` would load the compiler)."""
    try:
        dist = importlib.metadata.distribution("apache-tvm")
    except importlib.metadata.PackageNotFoundError:
        raise DistError("the runtime wheel takes TVM's runtime libraries from the installed apache-tvm, "
                        "which is not installed here") from None
    libraries, licenses = {}, {}
    for file in dist.files or []:
        parts = file.parts
        if len(parts) == 3 and parts[:2] == ("tvm", "lib") and parts[2] in TVM_LIBRARIES:
            libraries[parts[2]] = Path(dist.locate_file(file))
        elif parts in (("tvm", "LICENSE"), ("tvm", "NOTICE")) or (len(parts) == 3 and parts[:2] == ("tvm", "licenses")):
            licenses["/".join(parts[1:])] = Path(dist.locate_file(file))
    if REQUIRED_LIBRARY not in libraries or not libraries[REQUIRED_LIBRARY].is_file():
        raise DistError(f"the installed apache-tvm {dist.version} has no tvm/lib/{REQUIRED_LIBRARY}")
    tags = [line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")]
    platforms = sorted({tag.split("-")[2] for tag in tags if tag.count("-") == 2})
    if not platforms:  # apache-tvm not installed from a wheel: this machine's platform
        platforms = [sysconfig.get_platform().replace("-", "_").replace(".", "_")]
    return dist.version, libraries, licenses, platforms


def _package_files(root: Path) -> dict[str, Path]:
    """archive name -> path of vtool/__init__.py and every file of RUNTIME_PACKAGES, without
    bytecode, shared objects (the TVM libraries are added apart) or hidden files."""
    files = {"vtool/__init__.py": root / "__init__.py"}
    for package in RUNTIME_PACKAGES:
        for path in sorted((root / package).rglob("*")):
            rel = path.relative_to(root)
            if (not path.is_file() or "__pycache__" in rel.parts or path.suffix in (".pyc", ".so")
                    or any(p.startswith(".") for p in rel.parts) or rel.as_posix().startswith(LIBRARY_SUBDIR + "/")):
                continue
            files[f"vtool/{rel.as_posix()}"] = path
    return files


def _metadata(tvm_version: str, libraries: list[str]) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {WHEEL_NAME}", f"Version: {vtool.__version__}",
             f"Summary: vtool's inference runtime without the compiler: runs artifacts made by `vtool build`, "
             f"with the Apache TVM {tvm_version} runtime libraries",
             "License: Apache-2.0 (vtool and the bundled TVM runtime libraries; TVM's LICENSE and NOTICE "
             f"are in vtool/{LIBRARY_SUBDIR}/)",
             "Requires-Python: >=3.10"]
    lines += [f"Requires-Dist: {r}" for r in runtime_requirements()]
    lines += ["Provides-Extra: cuda"] + [f'Requires-Dist: {r}; extra == "cuda"' for r in CUDA_REQUIREMENTS]
    description = (f"The vtool runtime alone: `vtool run`, `vtool serve`, `vtool bench` and `vtool tokenize` on "
                   f"prebuilt artifacts. It bundles TVM {tvm_version}'s runtime libraries "
                   f"({', '.join(libraries)}) and never the TVM compiler (libtvm_compiler.so). Install it alone: "
                   f"it shares the `vtool` package and command with the full vtool distribution.\n")
    return "\n".join(lines) + "\n\n" + description


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_runtime_wheel(output: Path, progress: Callable[[str], None] | None = None) -> Path:
    """Write the vtool-runtime wheel into folder `output`; returns its path. Built with the
    standard library (PEP 427: WHEEL, METADATA, entry_points.txt, RECORD with sha256)."""
    progress = progress or (lambda _msg: None)
    root = Path(vtool.__file__).resolve().parent
    tvm_version, libraries, licenses, platforms = tvm_runtime_files()
    if "libtvm_compiler.so" in libraries:  # by construction never; a guard against a widened glob
        raise DistError("refusing to ship libtvm_compiler.so in the runtime wheel")
    version = vtool.__version__
    stem = f"{WHEEL_NAME.replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    tag = f"py3-none-{'.'.join(platforms)}"
    entries: dict[str, bytes] = {}
    for name, path in _package_files(root).items():
        entries[name] = path.read_bytes()
    for name, path in sorted(libraries.items()):
        progress(f"bundling {name} from apache-tvm {tvm_version} ({path.stat().st_size / 1e6:.1f} MB)")
        entries[f"vtool/{LIBRARY_SUBDIR}/{name}"] = path.read_bytes()
    for name, path in sorted(licenses.items()):
        entries[f"vtool/{LIBRARY_SUBDIR}/{name}"] = path.read_bytes()
    # The runtime compares an artifact's TVM version with the libraries it loads (library.py).
    entries[f"vtool/{LIBRARY_SUBDIR}/{BUNDLED_TVM_VERSION_FILE}"] = f"{tvm_version}\n".encode()
    entries[f"{info}/METADATA"] = _metadata(tvm_version, sorted(libraries)).encode()
    entries[f"{info}/WHEEL"] = ("Wheel-Version: 1.0\nGenerator: vtool (toolchain/dist.py)\nRoot-Is-Purelib: false\n"
                                + "".join(f"Tag: py3-none-{p}\n" for p in platforms)).encode()
    entries[f"{info}/entry_points.txt"] = f"[console_scripts]\n{ENTRY_POINT}\n".encode()
    entries[f"{info}/top_level.txt"] = b"vtool\n"
    record = "".join(_record_line(name, data) + "\n" for name, data in entries.items()) + f"{info}/RECORD,,\n"
    entries[f"{info}/RECORD"] = record.encode()

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    wheel = output / f"{stem}-{tag}.whl"
    fd, tmp = tempfile.mkstemp(prefix=".wheel-", dir=output)
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
            for name, data in entries.items():  # dist-info last, RECORD at the very end (PEP 427)
                item = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                item.compress_type = zipfile.ZIP_DEFLATED
                mode = 0o755 if name.endswith(".so") else 0o644
                item.external_attr = (0o100000 | mode) << 16
                zf.writestr(item, data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, wheel)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    progress(f"wrote {wheel} ({wheel.stat().st_size / 1e6:.1f} MB)")
    return wheel
