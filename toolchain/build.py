"""The build driver: BuildPlan -> Relax module -> TVM library + manifest.json.

The options are resolved once, into a BuildPlan (toolchain/plan.py); the target family's
entry (toolchain/families.py) compiles and links it. An artifact folder holds model.so and
manifest.json. Builds are cached under the user cache, keyed by the plan
(BuildPlan.cache_key: everything that changes the library: the config fields, the target
(for CUDA its arch list), the dtype, the quantization, the vtool/TVM versions (for CUDA
also nvcc's) and vtool's own compiler sources).

CPU builds compile in this process. CUDA builds embed an nvcc fatbin and usually compile
in a subprocess with a build-time driver stub (toolchain/cuda.py says why).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

from vtool.models.config import ModelConfig
from vtool.models.registry import model_family
from vtool.runtime.artifact.library import installed_versions
from vtool.runtime.weights.checkpoint import Checkpoint, open_checkpoint
from vtool.runtime.artifact.manifest import FORMAT_VERSION, LIBRARY_NAME, MANIFEST_NAME, ManifestError, read_manifest, write_manifest
from vtool.runtime.paths import artifact_cache
from vtool.targets import TargetSpec
from vtool.toolchain.families import family_of
# The options and their resolution live in plan.py; these names stay importable from here.
from vtool.toolchain.plan import (ACTIVATIONS, DTYPES, QUANT_TARGET_FAMILIES, QUANTIZATIONS,  # noqa: F401
                                  BuildOptions, BuildPlan, cache_key, check_request, compiler_source_digest,
                                  resolve_activations, resolve_plan, resolve_quantization)
from vtool.toolchain.block_mma import block_mma_formats
from vtool.toolchain.fp8_plan import fp8_tensor_cores
from vtool.toolchain.quantize import write_weights

Progress = Callable[[str], None]


def splits_decode(target_spec: TargetSpec) -> bool:
    """Whether the library gets decode in two calls too (models/decoder.py decode_hidden and
    decode_logits): on CUDA, where a chained one-sequence step records the KV cache's fence
    between them, so the next step is queued while the lm_head runs (BENCHMARKS.md, session 42)."""
    return family_of(target_spec).name == "cuda"


def _export(cfg: ModelConfig, target_spec: TargetSpec, dtype: str, progress: Progress,
            formats: dict[str, str] | None = None, attention: str = "tir", activations: str = "decode",
            gemm: str = "tir", draft_cache_len: int = 0):
    import tvm

    from vtool.schedules.cpu.int8_gemv import Int8GemvKernels

    target = tvm.target.Target(target_spec.tvm)
    progress("exporting the Relax module")
    family = model_family(cfg.architecture)
    isa = family_of(target_spec).int8_isa(target_spec)  # integer-dot kernels: handed in (models/ never imports schedules/)
    model = family.module(cfg, dtype, target, formats, int8_activations=activations,
                          int8_kernels=Int8GemvKernels(isa) if isa else None)
    if family.task == "embed" and family_of(target_spec).device == "cpu" and dtype == "float32":
        from vtool.models.dense_attention import use_dense_attention
        from vtool.schedules.cpu.encoder_attention import DenseAttentionKernels

        use_dense_attention(model, DenseAttentionKernels())  # one parallel kernel per attention (no CPU rule
        # schedules the ops' batched matmuls)
    if formats and family_of(target_spec).name == "cuda":
        from vtool.models.quantized_linear import dequantize_prompts

        # in-register GEMVs for decode (schedules/cuda/quantized.py); prompts on tensor cores
        dequantize_prompts(model)
        mma = block_mma_formats(formats, dtype)
        if mma:  # batched decode over 4-bit/8-bit blocks on the tensor cores (toolchain/block_mma.py)
            from vtool.models.quantized_linear import use_block_mma

            use_block_mma(model, mma)
        if fp8_tensor_cores(target_spec, gemm):
            from vtool.models.fp8_linear import use_fp8_tensor_cores

            # FP8 weights: prompts and batches W8A8 on the FP8 tensor cores (cuBLASLt), decode W8A16 GEMVs
            use_fp8_tensor_cores(model)
    if attention != "tir":
        from vtool.toolchain.flashinfer_attention import use_attention

        use_attention(model, attention)
    if draft_cache_len:  # draft_extend / draft_step (models/draft_chain.py)
        model.draft_cache_len = draft_cache_len
    if splits_decode(target_spec) and hasattr(model, "decode_hidden"):
        model.split_decode = True
    spec = model.get_default_spec()
    grid = contextlib.nullcontext()
    if family_of(target_spec).name == "cuda":  # TVM's tiled prefill kernels on a grid that fills the GPU
        from vtool.schedules.cuda.prefill_grid import wide_prefill_grid

        grid = wide_prefill_grid()
    with grid:
        mod, named_params = model.export_tvm(spec=spec)
    if draft_cache_len:
        from vtool.models.draft_chain import STEP_ENTRY, VERIFY_ENTRY

        # Every input of draft_step and chain_verify stays at one address for the runtime's whole
        # run (its state and the two caches), so they count as fixed, as weights do: a CUDA build
        # then captures each whole in one graph (RewriteCUDAGraph treats the params past
        # num_input as fixed).
        for entry in (STEP_ENTRY, VERIFY_ENTRY):
            mod[entry] = mod[entry].with_attr("num_input", 0)
    return target, mod, family.weights.parameters(named_params, formats), list(spec)


def model_module(cfg: ModelConfig, target_spec: TargetSpec, dtype: str, progress: Progress,
                 formats: dict[str, str] | None = None, attention: str = "tir", activations: str = "decode",
                 gemm: str = "tir", draft_cache_len: int = 0):
    """(tvm target, Relax module, params, entry points): everything a build compiles, before
    the pipeline. One place for it, so that `vtool tune` extracts the very kernels a build
    schedules (their structural hashes key the tuning records)."""
    target, mod, params, entry_points = _export(cfg, target_spec, dtype, progress, formats, attention, activations, gemm,
                                                draft_cache_len)
    for extra in family_of(target_spec).extra_modules(cfg):  # CUDA: the GPU sampler
        mod.update(extra)
    return target, mod, params, entry_points


def compile_cpu(plan: BuildPlan, library_path: Path, progress: Progress) -> dict[str, Any]:
    """The CPU families' compile and link step (toolchain/families.py): LLVM in this
    process, linked by the system compiler, or by zig cc for another instruction set
    (toolchain/cross_link.py). Returns the manifest's params, entry_points, pipeline and
    tuning records."""
    import tvm

    from vtool.toolchain.cross_link import fcompile_for
    from vtool.toolchain.pipeline import build_pipeline, describe

    target_spec = plan.target
    fcompile = fcompile_for(target_spec)  # before compiling: a missing cross linker is refused at once
    target, mod, params, entry_points = model_module(plan.config, target_spec, plan.dtype, progress, dict(plan.kept),
                                                     plan.attention, plan.activations,
                                                     draft_cache_len=plan.draft_cache_len)
    records = _tuning_records(target_spec, progress, plan.records)
    progress(f"compiling for {target_spec.name}")
    with target, plan.family.pass_context(plan.dtype):
        executable = tvm.compile(mod, target=target, relax_pipeline=build_pipeline(target, target_spec.family,
                                                                                  plan.gemm, records=records))
    _report_tuning(records, progress)
    progress("linking the shared library" + (f" for {target_spec.tvm['mtriple']} (zig cc)" if fcompile else ""))
    executable.export_library(str(library_path), fcompile=fcompile)
    pipeline = describe(target_spec.family, plan.gemm)
    if fcompile is not None:  # the manifest says which linker made another ISA's library
        from vtool.toolchain.cross_link import record

        pipeline["link"] = record(target_spec)
    return {"params": params, "entry_points": entry_points, "pipeline": pipeline, "tuning": records.summary()}


def _tuning_records(target_spec: TargetSpec, progress: Progress, use: bool = True):  # noqa: ANN202 - a RecordSet
    """The tuning records for this target (toolchain/records.py), none when the plan says
    so; each one ignored for another target or TVM version is reported."""
    from vtool.toolchain.records import RecordSet

    if not use:
        return RecordSet.empty(target_spec.name)
    records = RecordSet.load(target_spec.name, dict(target_spec.tvm))
    for notice in records.notices:
        progress(notice)
    return records


def _report_tuning(records, progress: Progress) -> None:  # noqa: ANN001 - a records.RecordSet
    t = records.summary()
    progress(f"tuning: {t['from_records']} kernels from records, {t['from_rules']} from rules")


def compile_cuda(plan: BuildPlan, library_path: Path, progress: Progress) -> dict[str, Any]:
    """The CUDA family's compile and link step (toolchain/families.py): compile_cuda_here,
    in this process when a real driver is loaded, else in the worker subprocess with the
    build-time driver stub (toolchain/cuda.py)."""
    from vtool.toolchain import cuda

    cuda.find_nvcc()  # refuse early, with the reason, when there is no toolkit
    if cuda.compile_in_process():
        import tvm  # noqa: F401  (loads the CUDA runtime when a driver is installed)

        if cuda.cuda_runtime_loaded():
            return compile_cuda_here(plan.config, plan.target, plan.dtype, library_path, progress, gemm=plan.gemm,
                                     attention=plan.attention, records=plan.records,
                                     cuda_graph_sizes=plan.cuda_graph_sizes, formats=dict(plan.kept),
                                     draft_cache_len=plan.draft_cache_len)
    request = {"config": plan.config.to_dict(), "target": plan.target.name, "dtype": plan.dtype,
               "library": str(library_path), "gemm": plan.gemm, "attention": plan.attention, "records": plan.records,
               "cuda_graph_sizes": list(plan.cuda_graph_sizes), "formats": dict(plan.kept),
               "draft_cache_len": plan.draft_cache_len}
    return cuda.run_worker(request, progress)


def compile_cuda_here(cfg: ModelConfig, target_spec: TargetSpec, dtype: str, library_path: Path,
                      progress: Progress, in_subprocess: bool = False, gemm: str = "tir",
                      attention: str = "tir", records: bool = True,
                      cuda_graph_sizes: tuple[int, ...] = (), formats: dict[str, str] | None = None,
                      draft_cache_len: int = 0) -> dict[str, Any]:
    """The CUDA compile proper, in a process whose TVM has its CUDA runtime loaded (the
    worker subprocess, or this one when a real driver is installed)."""
    import tvm

    from vtool.schedules.cuda.prefill_attention import replace_prefill_attention
    from vtool.toolchain import cuda, prefill_attention
    from vtool.toolchain.pipeline import build_pipeline, describe, graph_entry_points, pass_context

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
    target, mod, params, entry_points = model_module(cfg, target_spec, dtype, progress, formats or None,
                                                     attention=attention, activations="none", gemm=gemm,
                                                     draft_cache_len=draft_cache_len)
    native_prefill = 0
    if attention == "tir":  # vtool's tensor-core prefill attention where it fits (schedules/cuda/prefill_attention.py)
        mod, native_prefill = replace_prefill_attention(mod)
    graph_sizes = tuple(cuda_graph_sizes)
    entry_points = entry_points + graph_entry_points(graph_sizes, entry_points)  # the *_captured copies (pipeline.py)
    t_export = time.perf_counter() - t0
    tuning = _tuning_records(target_spec, progress, records)
    record: dict[str, Any] = {"archs": list(target_spec.archs), "ptx": target_spec.ptx}
    progress(f"compiling for {target_spec.name} (nvcc fatbin: SASS {', '.join(target_spec.archs)} "
             f"+ PTX {target_spec.ptx})")
    t0 = time.perf_counter()
    try:
        with cuda.fatbin_callback(target_spec.archs, target_spec.ptx, record), target, \
                pass_context(target_spec.family, dtype):
            executable = tvm.compile(mod, target=target, relax_pipeline=build_pipeline(
                target, target_spec.family, gemm, records=tuning, graph_sizes=graph_sizes))
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
    from vtool.toolchain import row_sort

    # Objects with kernels of their own (their fatbins sit beside TVM's): the sampler's row sort
    # for a large vocabulary, the block matmuls where weights stay in blocks, the prefill attention.
    linked: list[str] = []
    if row_sort.uses_row_sort(cfg.vocab_size):
        linked.append(str(row_sort.compile_object(target_spec.archs, target_spec.ptx)))
    if native_prefill:
        linked.append(str(prefill_attention.compile_object(target_spec.archs, target_spec.ptx)))
    if block_mma_formats(formats, dtype):
        from vtool.toolchain import block_mma

        linked.append(str(block_mma.compile_object(target_spec.archs, target_spec.ptx)))
    if linked:
        shims += [*linked, str(cuda.cuda_toolkit_library("cudart"))]
    # export_library appends its own objects to the list it is given: hand it a copy.
    executable.export_library(str(library_path), addons=list(shims) + (fi.addons() if fi else []))
    t_link = time.perf_counter() - t0
    if fi:
        info = flashinfer_attention.check_library(library_path, target_spec.archs, target_spec.ptx, fi, linked)
        record["attention"] = fi.record
    else:
        info = cuda.check_library(library_path, target_spec.archs, target_spec.ptx, linked)
        # which kernels attend prompts: vtool's tensor-core ones, or TVM's TIR ones (other shapes)
        record["prefill_attention"] = "vtool" if native_prefill else "tir"
    record.update({
        "embedded": {"module_formats": info["module_formats"], "sass": info["sass"], "ptx": info["ptx"]},
        "codegen_process": "subprocess (build-time libcuda stub)" if in_subprocess else "in-process (CUDA driver)",
        "seconds": {"export_tvm": round(t_export, 2), "tvm.compile (incl. nvcc)": round(t_compile, 2),
                    "nvcc": record.pop("nvcc_seconds", 0.0), "export_library": round(t_link, 2)},
    })
    from vtool.runtime.sampling.device import (APPLY_LOGIT_EDITS, ARGMAX_MASKED, FUNCTIONS as SAMPLER_FUNCTIONS, MASK_FUNCTIONS,
                                               TOP_P_TOP_K_FEW_ROWS)

    few_rows = [TOP_P_TOP_K_FEW_ROWS] if row_sort.uses_row_sort(cfg.vocab_size) else []

    return {"params": params, "entry_points": entry_points, "pipeline": describe(target_spec.family, gemm, graph_sizes),
            "cuda": record, "sampler": [*SAMPLER_FUNCTIONS, *MASK_FUNCTIONS, ARGMAX_MASKED, APPLY_LOGIT_EDITS, *few_rows], "tuning": tuning.summary()}


def build_artifact(model_path: str | Path, target_name: str = "host", dtype: str = "float32",
                   output: str | Path | None = None, progress: Progress | None = None,
                   checkpoint: Checkpoint | None = None, force: bool = False, gemm: str = "auto",
                   quantization: str = "auto", attention: str = "auto", activations: str = "auto",
                   records: bool = True, cuda_graph_sizes: str = "auto", hf_overrides: str = "",
                   draft_cache_len: int = 0, notice: Progress | None = None) -> Path:
    """Build (or find in the cache) the artifact for one checkpoint, target and dtype: the
    options (BuildOptions: plan.py says what each value does) are resolved into a BuildPlan,
    refused there by name when they cannot work, and the plan is built.

    activations: ACTIVATIONS; "auto" ("decode" where the target has integer dot products)
    quantizes the activation rows of the decode matmuls over kept Q8_0/Q4_0/Q4_1/Q5_0 weights to
    Q8_0 blocks (over kept Q4_K/Q6_K weights to Q8_K blocks); "q8_0" those of every matmul
    (prompts too), "none" none.

    quantization: QUANTIZATIONS; "auto" keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q6_K blocks on a
    CPU target and dequantizes everything elsewhere.

    gemm: "auto" | "tir" | "cublas" (toolchain/gemm_offload.py): which kernels run the
    prefill and batched-decode matmuls of a CUDA build.

    records: apply the tuning records found for the target (toolchain/records.py).

    cuda_graph_sizes: "auto" | "none" | "1,2,4,..." (plan.resolve_cuda_graph_sizes): the batch
    sizes whose batched decode a CUDA build captures in CUDA graphs.

    hf_overrides: a JSON object of config.json fields put in place of the checkpoint's before
    the config is parsed (vLLM's --hf-overrides; runtime/weights/hf_overrides.py); the manifest
    records it and the runtime applies it to the checkpoint's config too.

    draft_cache_len: positions of the speculative draft cache (models/draft_chain.py): the library
    gets draft_extend / draft_step, which a draft model drafts through (0: none).

    notice: hears why an "auto" choice fell back (dequantized GGUF blocks, TIR attention, no draft
    cache) or what a dtype costs, for the user to read; default: progress."""
    progress = progress or (lambda _msg: None)
    options = BuildOptions(dtype=dtype, quantization=quantization, activations=activations, gemm=gemm,
                           attention=attention, records=records, cuda_graph_sizes=cuda_graph_sizes,
                           hf_overrides=hf_overrides or "", draft_cache_len=int(draft_cache_len or 0))
    # The options as asked, for the manifest's provenance (the plan holds what they resolve to).
    requested = {"target": target_name, **dataclasses.asdict(options)}
    if not options.hf_overrides:  # builds without keep their provenance records as they were
        del requested["hf_overrides"]
    if not options.draft_cache_len:
        del requested["draft_cache_len"]
    target_spec = check_request(target_name, options)  # refused before the checkpoint is read
    ckpt = checkpoint or open_checkpoint(model_path)
    plan = resolve_plan(ckpt, target_spec, options, notice=notice or progress)
    return build_from_plan(plan, ckpt, output, progress, force, requested)


def _draft_chain_record(plan: BuildPlan) -> dict[str, Any]:
    from vtool.models import draft_chain

    c = plan.config
    return {"cache_len": plan.draft_cache_len,
            "cache_shape": [c.num_hidden_layers, plan.draft_cache_len, c.num_key_value_heads, c.head_dim],
            "state_len": draft_chain.STATE_LEN, "max_steps": draft_chain.MAX_STEPS,
            "max_forced": draft_chain.MAX_FORCED, "verify_state_len": draft_chain.VERIFY_STATE_LEN,
            "max_verify": draft_chain.MAX_VERIFY}


def build_from_plan(plan: BuildPlan, checkpoint: Checkpoint, output: str | Path | None = None,
                    progress: Progress | None = None, force: bool = False,
                    requested: dict[str, Any] | None = None) -> Path:
    """Build (or find in the cache) the artifact `plan` describes. `checkpoint` is the one
    the plan was resolved from (weights quantized at build time are read from it);
    `requested`: the options as asked, for the manifest's provenance (default: the plan's)."""
    progress = progress or (lambda _msg: None)
    key = plan.cache_key()
    folder = Path(output) if output else artifact_cache() / key
    if not force and _is_complete(folder, key):
        progress(f"using cached build {folder}")
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One builder per folder: a second process asking for the same build (two `vtool serve`
    # started together, parallel test workers) waits and then takes the finished artifact
    # instead of compiling it again and replacing the folder under the first one's feet.
    with FileLock(folder.parent / f".{folder.name}.lock"):
        if not force and _is_complete(folder, key):
            progress(f"using cached build {folder} (another process built it meanwhile)")
            return folder
        return _build_into(folder, key, plan, checkpoint, progress, requested)


def _build_into(folder: Path, key: str, plan: BuildPlan, checkpoint: Checkpoint, progress: Progress,
                requested: dict[str, Any] | None) -> Path:
    cfg = plan.config
    t0 = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=folder.parent))
    try:
        if plan.dense:
            progress(f"no kernels for {', '.join(sorted(set(plan.dense.values())))}: "
                     f"{len(plan.dense)} weights dequantized to {plan.dtype} at load")
        weights_record = write_weights(checkpoint, dict(plan.quantized_sources), plan.quantization, staging,
                                       progress) if plan.quantize_now else None
        compiled = plan.family.compile(plan, staging / LIBRARY_NAME, progress)
        build_info: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 2), "host": platform.machine(),
                                      "compiler_digest": compiler_source_digest(),
                                      "pipeline": compiled["pipeline"], "plan": plan.as_dict()}
        from vtool.toolchain.provenance import build_record

        asked = requested if requested is not None else {"target": plan.target.name, "dtype": plan.dtype,
                                                          "quantization": plan.quantization, "gemm": plan.gemm,
                                                          "attention": plan.attention,
                                                          "activations": plan.activations, "records": plan.records}
        build_info["provenance"] = build_record(checkpoint, asked)  # checkpoint digest, host, time
        if "cuda" in compiled:
            build_info["cuda"] = compiled["cuda"]
        if "sampler" in compiled:
            build_info["sampler"] = compiled["sampler"]
        if "tuning" in compiled:  # kernels from tuning records / from rules (toolchain/records.py)
            build_info["tuning"] = compiled["tuning"]

        extra: dict[str, Any] = {"weights_file": weights_record} if weights_record else {}
        extra |= _window_freeing_record(cfg, plan.family.device, compiled["entry_points"])
        write_manifest(staging, {**extra,
            "format_version": FORMAT_VERSION,
            "cache_key": key,
            "arch": cfg.architecture,
            "family": cfg.family,
            "config": cfg.to_dict(),
            "config_digest": cfg.digest(),
            "source_config": dict(plan.source_config),
            # --hf-overrides: the runtime applies them to the checkpoint's config (runtime/weights/hf_overrides.py)
            **({"hf_overrides": dict(plan.hf_overrides)} if plan.hf_overrides else {}),
            # --draft-cache-len: the draft cache's layout (models/draft_chain.py; runtime/engine/draft_chain.py)
            **({"draft_chain": _draft_chain_record(plan)} if plan.draft_cache_len else {}),
            "source_format": plan.source_format,
            "target": plan.target.describe(),
            "dtype": plan.dtype,
            "quantization": plan.quantization,
            "quantized_weights": plan.quantized_weights(),
            "activations": plan.activations,
            "gemm": plan.gemm,
            "attention": plan.attention,
            "versions": installed_versions(),
            "entry_points": compiled["entry_points"],
            # "generate" or "embed" (models/family.py; an embedding model's pooling when its
            # checkpoint has no sentence-transformers config: runtime/engine/pooling.py)
            "task": model_family(cfg.architecture).task,
            **({"default_pooling": model_family(cfg.architecture).default_pooling}
               if model_family(cfg.architecture).task == "embed" else {}),
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


def _window_freeing_record(cfg: ModelConfig, device: str, entry_points: list[str]) -> dict[str, str]:
    """The manifest's record of the window-freeing KV cache's attention kernels, when the library
    has that cache: on the CPU vtool's parallel ones, which the runtime uses by default, or TVM's
    serial ones, used only when asked for (runtime/engine/kv_cache.py frees_window_by_default); on
    CUDA TVM's own GPU kernels ("tvm-gpu"), also used only when asked for (slower than the
    per-layer cache's). Imported here, not at the top: `vtool run` imports this module, and these
    pull in TVM's compiler."""
    from vtool.models.window_cache import ENTRY
    from vtool.schedules.cpu.rope_attention import window_freeing_kernels

    if ENTRY not in entry_points:
        return {}
    return {"window_freeing_kernels": window_freeing_kernels(cfg.head_dim) if device == "cpu" else "tvm-gpu"}


def _is_complete(folder: Path, key: str) -> bool:
    if not (folder / LIBRARY_NAME).exists() or not (folder / MANIFEST_NAME).exists():
        return False
    try:
        return read_manifest(folder).get("cache_key") == key
    except ManifestError:
        return False
