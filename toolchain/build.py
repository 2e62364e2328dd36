"""The build driver: checkpoint -> Relax module -> TVM library + manifest.json.

An artifact folder holds model.so and manifest.json. Builds are cached under the user
cache, keyed by everything that changes the library: the config fields, the target, the
dtype, the quantization, the vtool/TVM versions and vtool's own compiler sources.
"""
from __future__ import annotations

import hashlib
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from vtool import VtoolError
from vtool.models.config import ModelConfig, parse_hf_config, source_config
from vtool.models.weights import check_checkpoint_shapes, plan_parameters
from vtool.runtime.artifact import installed_versions
from vtool.runtime.checkpoint import Checkpoint, open_checkpoint
from vtool.runtime.manifest import FORMAT_VERSION, LIBRARY_NAME, MANIFEST_NAME, ManifestError, read_manifest, write_manifest
from vtool.runtime.paths import artifact_cache
from vtool.targets import TargetSpec, buildable

DTYPES = ("float32", "float16", "bfloat16")
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
# Sources whose change changes the compiled library (part of the cache key).
_COMPILER_SOURCES = ("models", "schedules", "targets", "toolchain/pipeline.py", "toolchain/build.py")

Progress = Callable[[str], None]


def compiler_source_digest() -> str:
    h = hashlib.sha256()
    for entry in _COMPILER_SOURCES:
        path = _PACKAGE_ROOT / entry
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.relative_to(_PACKAGE_ROOT)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def cache_key(raw_config: dict[str, Any], target: TargetSpec, dtype: str, quantization: str) -> str:
    blob = json.dumps({"config": source_config(raw_config), "target": target.describe(), "dtype": dtype,
                       "quantization": quantization, "versions": installed_versions(),
                       "compiler": compiler_source_digest()}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _validate_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise VtoolError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")


def _compile(cfg: ModelConfig, target_spec: TargetSpec, dtype: str, library_path: Path,
             progress: Progress) -> tuple[list[dict[str, Any]], list[str]]:
    import tvm

    from vtool.models.llama import DecoderForCausalLM
    from vtool.toolchain.pipeline import build_pipeline

    target = tvm.target.Target(target_spec.tvm)
    progress("exporting the Relax module")
    model = DecoderForCausalLM(cfg, dtype, target)
    spec = model.get_default_spec()
    mod, named_params = model.export_tvm(spec=spec)
    progress(f"compiling for {target_spec.name}")
    with target:  # CUDA's nvcc callback reads Target.current(); harmless on CPU
        executable = tvm.compile(mod, target=target, relax_pipeline=build_pipeline(target, target_spec.family))
    progress("linking the shared library")
    executable.export_library(str(library_path))
    return plan_parameters(named_params), list(spec)


def build_artifact(model_path: str | Path, target_name: str = "host", dtype: str = "float32",
                   output: str | Path | None = None, progress: Progress | None = None,
                   checkpoint: Checkpoint | None = None, force: bool = False) -> Path:
    """Build (or find in the cache) the artifact for one checkpoint, target and dtype."""
    progress = progress or (lambda _msg: None)
    _validate_dtype(dtype)
    target_spec = buildable(target_name)
    ckpt = checkpoint or open_checkpoint(model_path)
    raw = ckpt.config()
    cfg = parse_hf_config(raw)
    check_checkpoint_shapes(cfg, {n: t.shape for n, t in ckpt.tensors().items()}, str(ckpt.path))
    quantization = "none"
    key = cache_key(raw, target_spec, dtype, quantization)
    folder = Path(output) if output else artifact_cache() / key
    if not force and _is_complete(folder, key):
        progress(f"using cached build {folder}")
        return folder

    t0 = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=folder.parent))
    try:
        params, entry_points = _compile(cfg, target_spec, dtype, staging / LIBRARY_NAME, progress)

        write_manifest(staging, {
            "format_version": FORMAT_VERSION,
            "cache_key": key,
            "arch": cfg.architecture,
            "family": cfg.family,
            "config": cfg.to_dict(),
            "config_digest": cfg.digest(),
            "source_config": source_config(raw),
            "source_format": ckpt.format,
            "target": target_spec.describe(),
            "dtype": dtype,
            "quantization": quantization,
            "versions": installed_versions(),
            "entry_points": entry_points,
            "params": params,
            "library": LIBRARY_NAME,
            "build": {"seconds": round(time.perf_counter() - t0, 2), "host": platform.machine(),
                      "compiler_digest": compiler_source_digest()},
        })
        if folder.exists():
            shutil.rmtree(folder)
        staging.replace(folder)  # the artifact appears whole or not at all
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    progress(f"built {folder} in {time.perf_counter() - t0:.1f} s")
    return folder


def _is_complete(folder: Path, key: str) -> bool:
    if not (folder / LIBRARY_NAME).exists() or not (folder / MANIFEST_NAME).exists():
        return False
    try:
        return read_manifest(folder).get("cache_key") == key
    except ManifestError:
        return False
