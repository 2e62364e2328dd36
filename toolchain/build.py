"""The build driver: checkpoint -> Relax module -> TVM library + manifest.json.

An artifact folder holds model.so and manifest.json. Builds are cached under the user
cache, keyed by everything that changes the library: the config fields, the target (for
CUDA its arch list), the dtype, the quantization, the vtool/TVM versions (for CUDA also
nvcc's) and vtool's own compiler sources.

CPU builds compile in this process. CUDA builds embed an nvcc fatbin and usually compile
in a subprocess with a build-time driver stub (toolchain/cuda.py says why).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from vtool import VtoolError
from vtool.models.config import ModelConfig, parse_hf_config, source_config
from vtool.models.weights import check_checkpoint_shapes, kept_formats, plan_parameters
from vtool.runtime.artifact.library import installed_versions
from vtool.runtime.weights.checkpoint import Checkpoint, open_checkpoint
from vtool.runtime.artifact.manifest import FORMAT_VERSION, LIBRARY_NAME, MANIFEST_NAME, ManifestError, read_manifest, write_manifest
from vtool.runtime.paths import artifact_cache
from vtool.targets import TargetSpec, buildable
from vtool.toolchain.quantize import SCHEMES, plan_formats, quantized_sources, source_key, write_weights

DTYPES = ("float32", "float16", "bfloat16")
# --quantization: auto = gguf for a GGUF file on a CPU target, else none;
# none = every weight dequantized to the dtype at load; gguf = keep the file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks.
# q4_0/q4_1/q8_0 = quantize a float checkpoint's weights at build time (toolchain/quantize.py).
QUANTIZATIONS = ("auto", "none", "gguf", *SCHEMES)
QUANT_TARGET_FAMILIES = ("x86", "arm")
# --activations: how the matmuls over kept Q8_0/Q4_0/Q4_1 weights take their input
# (models/int8_gemv.py): rows quantized to Q8_0 and integer dot products in decode ("decode",
# what auto picks on integer-dot CPUs) or everywhere ("q8_0", llama.cpp's numerics), or float32.
ACTIVATIONS = ("auto", "decode", "q8_0", "none")  # families with quantized kernels (the CPU ones)
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
# Sources whose change changes the compiled library (part of the cache key).
_COMPILER_SOURCES = ("models", "schedules", "targets", "toolchain/pipeline.py", "toolchain/build.py",
                     "toolchain/cuda.py", "toolchain/gemm_offload.py", "toolchain/native/cublas_gemm.cc",
                     "toolchain/flashinfer_attention.py", "toolchain/quantize.py",
                     "runtime/weights/quant_blocks.py")  # the block layout the kernels are compiled for

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


def _toolchain_versions(target: TargetSpec) -> dict[str, str]:
    """Versions of external compilers that change the library (nvcc for CUDA)."""
    if target.family == "cuda":
        from vtool.toolchain.cuda import nvcc_version

        return {"nvcc": nvcc_version()}
    from vtool.toolchain.cross_link import record

    return record(target)  # the cross linker, for a CPU target of another instruction set


def cache_key(raw_config: dict[str, Any], target: TargetSpec, dtype: str, quantization: str,
              gemm: str = "tir", attention: str = "tir", tuning: str = "") -> str:
    payload = {"config": source_config(raw_config), "target": target.describe(), "dtype": dtype,
               "quantization": quantization, "gemm": gemm, "versions": installed_versions(),
               "compiler": compiler_source_digest()}
    if attention != "tir":  # e.g. "flashinfer-0.6.15.post1"; tir builds keep their keys
        payload["attention"] = attention
    if tuning:  # the digest of the tuning records that apply; builds without records keep their keys
        payload["tuning"] = tuning
    toolchain = _toolchain_versions(target)
    if toolchain:
        payload["toolchain"] = toolchain
    blob = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _validate_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise VtoolError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")


def resolve_quantization(requested: str, ckpt: Checkpoint, cfg: ModelConfig,
                         target_spec: TargetSpec) -> tuple[str, dict[str, str], dict[str, str]]:
    """(scheme, kept: module -> block format, dense: module -> stored types dequantized
    instead) for --quantization `requested`; a combination that cannot work is refused."""
    if requested not in QUANTIZATIONS:
        raise VtoolError(f"unknown quantization {requested!r}; supported: {', '.join(QUANTIZATIONS)}")
    if requested == "none":
        return "none", {}, {}
    if requested in SCHEMES:
        return requested, _scheme_formats(requested, ckpt, cfg, target_spec), {}
    if requested == "auto" and (ckpt.format != "gguf" or target_spec.family not in QUANT_TARGET_FAMILIES):
        return "none", {}, {}
    if ckpt.format != "gguf":
        raise VtoolError(f"--quantization gguf keeps a GGUF file's quantized blocks, but {ckpt.path} is a "
                         f"{ckpt.format} checkpoint; use --quantization none")
    if target_spec.family not in QUANT_TARGET_FAMILIES:
        raise VtoolError(f"--quantization gguf has kernels for x86 CPU targets only, not {target_spec.name} "
                         f"({target_spec.family}); use --quantization none there")
    kept, dense = kept_formats(cfg, {n: (t.dtype, t.shape) for n, t in ckpt.tensors().items()})
    if not kept:
        if requested == "auto":
            return "none", {}, {}
        raise VtoolError(f"--quantization gguf: {ckpt.path} has no weight stored as Q8_0, Q4_0, Q4_1, Q4_K or Q6_K "
                         f"(the formats with kernels); use --quantization none")
    return "gguf", kept, dense


def _scheme_formats(scheme: str, ckpt: Checkpoint, cfg: ModelConfig, target_spec: TargetSpec) -> dict[str, str]:
    """module -> GGML type for a build-time scheme (q4_0, q4_1, q8_0), refusing what cannot work."""
    if ckpt.format == "gguf":
        raise VtoolError(f"--quantization {scheme} quantizes a float (safetensors) checkpoint at build time, but "
                         f"{ckpt.path} is a GGUF file, whose blocks are kept as they are: use --quantization gguf "
                         "(or auto); re-quantizing already quantized weights would only add error")
    if target_spec.family not in QUANT_TARGET_FAMILIES:
        raise VtoolError(f"--quantization {scheme} has kernels for CPU targets only "
                         f"({', '.join(QUANT_TARGET_FAMILIES)}), not {target_spec.name} ({target_spec.family}): "
                         "there are no quantized CUDA kernels yet; use --quantization none")
    kept, _ = plan_formats(cfg, {n: t.shape for n, t in ckpt.tensors().items()}, scheme)
    if not kept:
        raise VtoolError(f"--quantization {scheme}: no weight of {ckpt.path} fits the quantized kernels' tiles "
                         "(rows a multiple of 4, columns a multiple of 32); use --quantization none")
    return kept


def resolve_activations(requested: str, target_spec: TargetSpec, kept: dict[str, str]) -> str:
    """"decode", "q8_0" or "none" for --activations `requested`; a quantized mode asked of a
    build that cannot run it is refused by name."""
    if requested not in ACTIVATIONS:
        raise VtoolError(f"unknown --activations {requested!r}; supported: {', '.join(ACTIVATIONS)}")
    from vtool.models.quant_formats import INT8_FORMATS, int8_isa

    isa = int8_isa(str(target_spec.tvm.get("mcpu", "")), list(target_spec.tvm.get("mattr", []))) \
        if target_spec.family == "x86" else None
    usable = isa is not None and bool(set(kept.values()) & set(INT8_FORMATS))
    if requested == "none" or (requested == "auto" and not usable):
        return "none"
    if requested == "auto":
        return "decode"
    if isa is None:
        raise VtoolError(f"--activations {requested} needs an x86 target with integer dot products (AVX2 or "
                         f"AVX-512 VNNI); {target_spec.name} has none: use --activations none")
    if not usable:
        raise VtoolError(f"--activations {requested} applies to weights kept as Q8_0, Q4_0 or Q4_1 blocks and this "
                         "build keeps none: use --activations none (or --quantization gguf / q4_1 / q8_0)")
    return requested


def _quantization_key(scheme: str, kept: dict[str, str]) -> str:
    """The cache key's quantization: the scheme plus which weight keeps which format
    (two GGUF files of one model in different formats need different libraries)."""
    if not kept:
        return scheme
    return scheme + ":" + hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def _count_formats(kept: dict[str, str], dense: dict[str, str], left_float: list[str] | None = None
                   ) -> dict[str, Any]:
    """The manifest's summary: how many weights keep each block format, which were
    dequantized at load for want of a kernel (module -> stored types), and (build-time
    schemes) which stay float because their shape does not fit the kernels' tiles."""
    counts: dict[str, int] = {}
    for fmt in kept.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    summary: dict[str, Any] = {"kept": counts, "dequantized": dict(sorted(dense.items()))}
    if left_float is not None:
        summary["float"] = sorted(left_float)
    return summary


def _export(cfg: ModelConfig, target_spec: TargetSpec, dtype: str, progress: Progress,
            formats: dict[str, str] | None = None, attention: str = "tir", activations: str = "decode"):
    import tvm

    from vtool.models.llama import DecoderForCausalLM

    target = tvm.target.Target(target_spec.tvm)
    progress("exporting the Relax module")
    model = DecoderForCausalLM(cfg, dtype, target, formats, int8_activations=activations)
    if attention != "tir":
        from vtool.toolchain.flashinfer_attention import use_attention

        use_attention(model, attention)
    spec = model.get_default_spec()
    mod, named_params = model.export_tvm(spec=spec)
    return target, mod, plan_parameters(named_params, formats), list(spec)


def model_module(cfg: ModelConfig, target_spec: TargetSpec, dtype: str, progress: Progress,
                 formats: dict[str, str] | None = None, attention: str = "tir", activations: str = "decode"):
    """(tvm target, Relax module, params, entry points): everything a build compiles, before
    the pipeline. One place for it, so that `vtool tune` extracts the very kernels a build
    schedules (their structural hashes key the tuning records)."""
    target, mod, params, entry_points = _export(cfg, target_spec, dtype, progress, formats, attention, activations)
    if target_spec.family == "cuda":
        # Sampling on the GPU (models/sampler.py): the engine samples there, so logits stay put.
        from vtool.models.sampler import sampler_module

        mod.update(sampler_module(cfg.vocab_size))
    return target, mod, params, entry_points


def _compile(cfg: ModelConfig, target_spec: TargetSpec, dtype: str, library_path: Path,
             progress: Progress, gemm: str = "tir", formats: dict[str, str] | None = None,
             attention: str = "tir", activations: str = "decode") -> dict[str, Any]:
    """Compile and link model.so; returns the manifest's params, entry_points and, for
    CUDA, the cuda build record. `formats`: the weights kept in blocks (CPU only)."""
    if target_spec.family == "cuda":
        if formats:
            raise VtoolError(f"quantized weights have no CUDA kernels yet ({target_spec.name}); "
                             "use --quantization none")
        return _compile_cuda(cfg, target_spec, dtype, library_path, progress, gemm, attention)
    import tvm

    from vtool.toolchain.cross_link import fcompile_for
    from vtool.toolchain.pipeline import build_pipeline, describe

    fcompile = fcompile_for(target_spec)  # before compiling: a missing cross linker is refused at once
    target, mod, params, entry_points = model_module(cfg, target_spec, dtype, progress, formats,
                                                     activations=activations)
    records = _tuning_records(target_spec, progress)
    progress(f"compiling for {target_spec.name}")
    with target:
        executable = tvm.compile(mod, target=target, relax_pipeline=build_pipeline(target, target_spec.family,
                                                                                  records=records))
    _report_tuning(records, progress)
    progress("linking the shared library" + (f" for {target_spec.tvm['mtriple']} (zig cc)" if fcompile else ""))
    executable.export_library(str(library_path), fcompile=fcompile)
    pipeline = describe(target_spec.family)
    if fcompile is not None:  # the manifest says which linker made another ISA's library
        from vtool.toolchain.cross_link import record

        pipeline["link"] = record(target_spec)
    return {"params": params, "entry_points": entry_points, "pipeline": pipeline, "tuning": records.summary()}


def _tuning_records(target_spec: TargetSpec, progress: Progress):  # noqa: ANN202 - a records.RecordSet
    """The tuning records for this target (toolchain/records.py); each one ignored for
    another target or TVM version is reported."""
    from vtool.toolchain.records import RecordSet

    records = RecordSet.load(target_spec.name, dict(target_spec.tvm))
    for notice in records.notices:
        progress(notice)
    return records


def _report_tuning(records, progress: Progress) -> None:  # noqa: ANN001 - a records.RecordSet
    t = records.summary()
    progress(f"tuning: {t['from_records']} kernels from records, {t['from_rules']} from rules")


def _compile_cuda(cfg: ModelConfig, target_spec: TargetSpec, dtype: str, library_path: Path,
                  progress: Progress, gemm: str = "tir", attention: str = "tir") -> dict[str, Any]:
    from vtool.toolchain import cuda

    cuda.find_nvcc()  # refuse early, with the reason, when there is no toolkit
    if cuda.compile_in_process():
        import tvm  # noqa: F401  (loads the CUDA runtime when a driver is installed)

        if cuda.cuda_runtime_loaded():
            return compile_cuda_here(cfg, target_spec, dtype, library_path, progress, gemm=gemm,
                                     attention=attention)
    request = {"config": cfg.to_dict(), "target": target_spec.name, "dtype": dtype, "library": str(library_path),
               "gemm": gemm, "attention": attention}
    return cuda.run_worker(request, progress)


def compile_cuda_here(cfg: ModelConfig, target_spec: TargetSpec, dtype: str, library_path: Path,
                      progress: Progress, in_subprocess: bool = False, gemm: str = "tir",
                      attention: str = "tir") -> dict[str, Any]:
    """The CUDA compile proper, in a process whose TVM has its CUDA runtime loaded (the
    worker subprocess, or this one when a real driver is installed)."""
    import tvm

    from vtool.toolchain import cuda
    from vtool.toolchain.pipeline import build_pipeline, describe, pass_context

    if not cuda.cuda_runtime_loaded():
        raise cuda.CudaBuildError(
            "TVM's CUDA runtime (libtvm_runtime_cuda.so) did not load, so codegen would embed CUDA source; "
            "it needs libcuda.so.1 (the build-time stub or a driver) and libcudart.so.13 (the CUDA 13 toolkit) "
            f"on the loader path (LD_LIBRARY_PATH={os.environ.get('LD_LIBRARY_PATH', '')!r})")
    fi = None
    if attention == "flashinfer":  # the kernels' objects, cached apart from the model (minutes to build)
        from vtool.toolchain import flashinfer_attention

        fi = flashinfer_attention.build_objects(dtype, cfg.head_dim, target_spec.archs, progress)
    t0 = time.perf_counter()
    target, mod, params, entry_points = model_module(cfg, target_spec, dtype, progress, attention=attention)
    t_export = time.perf_counter() - t0
    records = _tuning_records(target_spec, progress)
    record: dict[str, Any] = {"archs": list(target_spec.archs), "ptx": target_spec.ptx}
    progress(f"compiling for {target_spec.name} (nvcc fatbin: SASS {', '.join(target_spec.archs)} "
             f"+ PTX {target_spec.ptx})")
    t0 = time.perf_counter()
    try:
        with cuda.fatbin_callback(target_spec.archs, target_spec.ptx, record), target, \
                pass_context("cuda"):
            executable = tvm.compile(mod, target=target, relax_pipeline=build_pipeline(target, "cuda", gemm,
                                                                                      records=records))
    except Exception:
        nvcc_error = record.pop("_error", None)
        if nvcc_error is not None:
            raise nvcc_error from None
        raise
    t_compile = time.perf_counter() - t0
    progress("linking the shared library")
    t0 = time.perf_counter()
    shims: list[str] = []
    if gemm == "cublas":
        from vtool.toolchain.gemm_offload import compile_shim

        shims.append(str(compile_shim()))
    # export_library appends its own objects to the list it is given: hand it a copy.
    executable.export_library(str(library_path), addons=list(shims) + (fi.addons() if fi else []))
    t_link = time.perf_counter() - t0
    if fi:
        info = flashinfer_attention.check_library(library_path, target_spec.archs, target_spec.ptx, fi)
        record["attention"] = fi.record
    else:
        info = cuda.check_library(library_path, target_spec.archs, target_spec.ptx)
    record.update({
        "embedded": {"module_formats": info["module_formats"], "sass": info["sass"], "ptx": info["ptx"]},
        "codegen_process": "subprocess (build-time libcuda stub)" if in_subprocess else "in-process (CUDA driver)",
        "seconds": {"export_tvm": round(t_export, 2), "tvm.compile (incl. nvcc)": round(t_compile, 2),
                    "nvcc": record.pop("nvcc_seconds", 0.0), "export_library": round(t_link, 2)},
    })
    from vtool.runtime.sampling.device import FUNCTIONS as SAMPLER_FUNCTIONS

    return {"params": params, "entry_points": entry_points, "pipeline": describe("cuda", gemm), "cuda": record,
            "sampler": list(SAMPLER_FUNCTIONS), "tuning": records.summary()}


def build_artifact(model_path: str | Path, target_name: str = "host", dtype: str = "float32",
                   output: str | Path | None = None, progress: Progress | None = None,
                   checkpoint: Checkpoint | None = None, force: bool = False, gemm: str = "auto",
                   quantization: str = "auto", attention: str = "auto", activations: str = "auto") -> Path:
    """Build (or find in the cache) the artifact for one checkpoint, target and dtype.

    activations: ACTIVATIONS; "auto" ("decode" where the target has integer dot products)
    quantizes the activation rows of the decode matmuls over kept Q8_0/Q4_0/Q4_1 weights to
    Q8_0 blocks; "q8_0" those of every matmul (prompts too), "none" none.

    quantization: QUANTIZATIONS; "auto" keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks on a
    CPU target and dequantizes everything elsewhere.

    gemm: "auto" | "tir" | "cublas" (toolchain/gemm_offload.py): which kernels run the
    prefill and batched-decode matmuls of a CUDA build."""
    progress = progress or (lambda _msg: None)
    # The options as asked, for the manifest's provenance (several are resolved below).
    requested = {"target": target_name, "dtype": dtype, "quantization": quantization, "gemm": gemm,
                 "attention": attention, "activations": activations}
    _validate_dtype(dtype)
    target_spec = buildable(target_name)
    ckpt = checkpoint or open_checkpoint(model_path)
    raw = ckpt.config()
    cfg = parse_hf_config(raw)
    check_checkpoint_shapes(cfg, {n: t.shape for n, t in ckpt.tensors().items()}, str(ckpt.path))
    if target_spec.family == "cuda":
        from vtool.toolchain.cuda import check_attention_shape

        check_attention_shape(cfg)
    quantization, kept, dense = resolve_quantization(quantization, ckpt, cfg, target_spec)
    quantize_now = quantization in SCHEMES  # blocks made here and written into the artifact
    qsources = quantized_sources(cfg, kept) if quantize_now else {}
    left_float = plan_formats(cfg, {n: t.shape for n, t in ckpt.tensors().items()}, quantization)[1] \
        if quantize_now else None
    from vtool.toolchain.gemm_offload import resolve_gemm

    gemm = resolve_gemm(gemm, target_spec.family, dtype)
    from vtool.toolchain.flashinfer_attention import attention_key, resolve_attention

    attention = resolve_attention(attention, target_spec.family, dtype, cfg, notice=progress)
    activations = resolve_activations(activations, target_spec, kept)
    qkey = _quantization_key(quantization, kept) + (f":{activations}-activations" if activations != "none" else "")
    if quantize_now:  # the artifact holds weights: another checkpoint of this config needs its own
        qkey += ":" + source_key(ckpt, qsources)
    from vtool.toolchain.records import RecordSet

    key = cache_key(raw, target_spec, dtype, qkey, gemm, attention_key(attention),
                    RecordSet.load(target_spec.name, dict(target_spec.tvm)).digest)  # records change the library
    folder = Path(output) if output else artifact_cache() / key
    if not force and _is_complete(folder, key):
        progress(f"using cached build {folder}")
        return folder

    t0 = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=folder.parent))
    try:
        if dense:
            progress(f"no kernels for {', '.join(sorted(set(dense.values())))}: "
                     f"{len(dense)} weights dequantized to {dtype} at load")
        weights_record = write_weights(ckpt, qsources, quantization, staging, progress) if quantize_now else None
        compiled = _compile(cfg, target_spec, dtype, staging / LIBRARY_NAME, progress, gemm, kept, attention,
                            activations)
        build_info: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 2), "host": platform.machine(),
                                      "compiler_digest": compiler_source_digest(),
                                      "pipeline": compiled["pipeline"]}
        from vtool.toolchain.provenance import build_record

        build_info["provenance"] = build_record(ckpt, requested)  # checkpoint digest, host, time
        if "cuda" in compiled:
            build_info["cuda"] = compiled["cuda"]
        if "sampler" in compiled:
            build_info["sampler"] = compiled["sampler"]
        if "tuning" in compiled:  # kernels from tuning records / from rules (toolchain/records.py)
            build_info["tuning"] = compiled["tuning"]

        extra: dict[str, Any] = {"weights_file": weights_record} if weights_record else {}
        write_manifest(staging, {**extra,
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
            "quantized_weights": _count_formats(kept, dense, left_float),
            "activations": activations,
            "gemm": gemm,
            "attention": attention,
            "versions": installed_versions(),
            "entry_points": compiled["entry_points"],
            "params": compiled["params"],
            "library": LIBRARY_NAME,
            "build": build_info,
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
