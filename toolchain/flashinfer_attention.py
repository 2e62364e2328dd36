"""FlashInfer attention for CUDA builds (`vtool build --attention flashinfer`), ahead of time.

TVM 0.27 can run the paged KV cache's prefill and decode attention on FlashInfer kernels
(relax.frontend.nn.llm.kv_cache.FlashInferPagedKVCache): the KV-cache builtin then calls
`batch_prefill_{plan,paged_run,ragged_run}` and `batch_decode_{plan,run}` by name, and
those must be linked into model.so. TIR keeps the rest (RoPE, KV append, tree attention,
sliding-window kernels, state merge).

Where the kernels come from. `flashinfer.jit` renders CUDA sources from Jinja templates
for one (dtype, head_dim) and names them in a ninja file; nvcc compiles them. Nothing
needs a GPU: FLASHINFER_CUDA_ARCH_LIST replaces the device query. This module

1. renders the sources exactly as TVM's `relax.backend.cuda.flashinfer.gen_flashinfer_
   {prefill,decode}_module` would (same uri, variant, additional scalars), renames the
   exported tvm-ffi functions with the `batch_prefill_` / `batch_decode_` prefixes the
   KV cache looks up, and builds only the object files (ninja, every core): no .so is
   linked, so no libcuda is needed. It runs in a subprocess
   (`python -m vtool.toolchain.flashinfer_attention build REQ RES`): flashinfer imports
   torch, which the CUDA compile worker keeps out, and its paths are fixed at import;
2. caches the objects under <cache>/flashinfer/<key>, the key holding the flashinfer
   version, the arch list, dtype, head dims, nvcc's version and BUILDER_VERSION;
3. hands them to export_library as addons, with libcudart.so (the objects call the CUDA
   runtime API; model.so records DT_NEEDED libcudart.so.13, which the GPU machine has for
   libtvm_runtime_cuda.so anyway). Neither torch nor flashinfer is needed at run time.

Which FlashInfer. TVM 0.27's runtime (src/runtime/vm/attn_backend.h) calls the prefill
plan with 19 arguments (..., disable_split_kv, num_colocated_ctas) and the runs/decode
plan in flashinfer 0.6's tvm-ffi form. flashinfer 0.6.16 added `uniform_q_len` to the
prefill plan (0.7 adds `fixed_uniform_q_len` too): a library built from those fails at the
first prefill with an argument-count error. So 0.6.15.post1 is the newest that fits; the
build checks the binding's signature rather than trusting the version number. flashinfer
is not a dependency of vtool itself: the `cuda-build` extra pins it (`pip install
'vtool[cuda-build]'`), or install it anywhere (`pip install --target DIR
flashinfer-python==0.6.15.post1 --no-deps` plus nvidia-ml-py, einops, tabulate, ninja,
tqdm) and point VTOOL_FLASHINFER_PATH at DIR.

Model side: `use_attention(model, "flashinfer")` makes DecoderForCausalLM's
create_tir_paged_kv_cache build a FlashInferPagedKVCache (models/decoder.py reads
`model.kv_cache_class`). TVM's constructor would compile FlashInfer itself through
gen_flashinfer_*_module; `flashinfer_kv_cache` swaps those for empty lists while it runs,
since this module builds and links the objects.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from vtool import VtoolError
from vtool.runtime.paths import cache_root
from vtool.targets.table import sm_number

ATTENTIONS = ("auto", "tir", "flashinfer")
TESTED_FLASHINFER = "0.6.15.post1"
FLASHINFER_PATH_ENV = "VTOOL_FLASHINFER_PATH"
FLASHINFER_DTYPES = ("float16", "bfloat16")
# FlashInfer's FA2 prefill/decode instantiate these head dims (DISPATCH_HEAD_DIM).
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_GROUP_SIZES = (1, 2, 3, 4, 8)
# The symbols the KV cache looks up (kv_cache.FlashInferPagedKVCache's ExternFuncs).
PREFILL_SYMBOLS = ("batch_prefill_plan", "batch_prefill_paged_run", "batch_prefill_ragged_run")
DECODE_SYMBOLS = ("batch_decode_plan", "batch_decode_run")
# The last parameter of the prefill plan TVM 0.27's runtime calls (19 arguments).
_PLAN_TAIL = re.compile(r"BatchPrefillWithKVCachePlan\([^;]*?\bnum_colocated_ctas\s*\)\s*;", re.S)
_EXPORT = re.compile(r"^(\s*TVM_FFI_DLL_EXPORT_TYPED_FUNC\()([A-Za-z0-9_]+)(,.*)$")
# Bump when the objects this module builds change (sources, flags, names): part of their cache key.
BUILDER_VERSION = 1

Progress = Callable[[str], None]


class FlashInferError(VtoolError):
    """--attention flashinfer cannot be built here, or not for this model."""


# ---------------------------------------------------------------------------------------
# Choosing


def resolve_attention(choice: str, family: str, dtype: str, cfg: Any,
                      notice: Callable[[str], None] | None = None) -> str:
    """The attention backend a build uses; flashinfer is refused where it cannot work.

    auto: flashinfer for a CUDA build it can serve when a fitting flashinfer-python is
    importable (it measured 7x faster on long prefills), else tir, saying why (`notice`)."""
    from vtool.toolchain.families import family_named, offering

    if choice not in ATTENTIONS:
        raise FlashInferError(f"--attention {choice!r} is not one of {', '.join(ATTENTIONS)}")
    if choice == "auto":
        if "flashinfer" not in family_named(family).attention:
            return "tir"
        try:
            chosen = resolve_attention("flashinfer", family, dtype, cfg)
            probe()
            return chosen
        except FlashInferError as err:
            if notice is not None:
                notice(f"attention: TVM's TIR kernels (FlashInfer not used: {str(err).splitlines()[0]})")
            return "tir"
    if choice == "tir":
        return "tir"
    if "flashinfer" not in family_named(family).attention:
        raise FlashInferError(f"--attention flashinfer needs a {offering('attention', 'flashinfer')} target; "
                              f"this build's target family is {family}")
    if dtype not in FLASHINFER_DTYPES:
        raise FlashInferError(f"--attention flashinfer has kernels for {', '.join(FLASHINFER_DTYPES)}, not {dtype}")
    if cfg.head_dim not in FLASHINFER_HEAD_DIMS:
        raise FlashInferError(f"--attention flashinfer supports head_dim {FLASHINFER_HEAD_DIMS}, "
                              f"this model has {cfg.head_dim}; use --attention tir")
    group, rem = divmod(cfg.num_attention_heads, cfg.num_key_value_heads)
    if rem or group not in FLASHINFER_GROUP_SIZES:
        raise FlashInferError(f"--attention flashinfer's decode kernels take {FLASHINFER_GROUP_SIZES} query heads per "
                              f"KV head (DISPATCH_GQA_GROUP_SIZE), this model has {cfg.num_attention_heads}/"
                              f"{cfg.num_key_value_heads}; use --attention tir")
    if getattr(cfg, "attn_logit_softcap", 0.0):
        # FlashInfer has a soft-cap variant (DefaultAttention's use_logits_soft_cap, with a logits_soft_cap
        # scalar), but TVM 0.27's runtime calls the run functions with sm_scale and the rope scalars only
        raise FlashInferError(f"--attention flashinfer: this model soft-caps its attention logits "
                              f"(attn_logit_softcapping={cfg.attn_logit_softcap:g}), which the FlashInfer kernels "
                              "vtool builds (DefaultAttention, no logits soft-cap) do not; use --attention tir "
                              "(TVM's TIR kernels, capped: models/softcap.py)")
    return "flashinfer"


# ---------------------------------------------------------------------------------------
# Model side


def flashinfer_kv_cache(**kwargs: Any):
    """A FlashInferPagedKVCache (same arguments as TIRPagedKVCache) whose FlashInfer
    modules are left to this module's objects instead of being compiled by TVM."""
    from tvm.relax.backend.cuda import flashinfer as tvm_flashinfer
    from tvm.relax.frontend.nn.llm.kv_cache import FlashInferPagedKVCache

    names = ("gen_flashinfer_prefill_module", "gen_flashinfer_decode_module", "gen_flashinfer_mla_module")
    saved = {name: getattr(tvm_flashinfer, name) for name in names}
    try:
        for name in names:
            setattr(tvm_flashinfer, name, lambda *_a, **_k: [])
        return FlashInferPagedKVCache(**kwargs)
    finally:
        for name, fn in saved.items():
            setattr(tvm_flashinfer, name, fn)


def attention_key(attention: str) -> str:
    """The build cache key's attention entry: "tir", or "flashinfer-<version>"."""
    return attention if attention == "tir" else f"{attention}-{probe()['version']}"


def use_attention(model: Any, attention: str) -> None:
    """Point models/decoder.py's KV-cache hook at the backend's cache class."""
    if attention == "flashinfer":
        model.kv_cache_class = flashinfer_kv_cache
    elif attention != "tir":
        raise FlashInferError(f"unknown attention backend {attention!r}")


# ---------------------------------------------------------------------------------------
# Building the objects (parent side)


def arch_list(archs) -> str:
    """FLASHINFER_CUDA_ARCH_LIST for vtool arch names: ("sm_80", "sm_90a") -> "8.0 9.0a"."""
    out = []
    for arch in archs:
        n = sm_number(arch)
        suffix = arch.split("_", 1)[1][len(str(n)):]
        out.append(f"{n // 10}.{n % 10}{suffix}")
    return " ".join(out)


def _flashinfer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    path = env.get(FLASHINFER_PATH_ENV)
    if path:
        env["PYTHONPATH"] = os.pathsep.join([path] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        # flashinfer's ninja comes with it when installed with --target
        if (Path(path) / "bin").is_dir():
            env["PATH"] = os.pathsep.join([str(Path(path) / "bin"), env.get("PATH", "")])
    # a venv's console scripts (ninja, which `pip install 'vtool[cuda-build]'` puts there) are
    # beside its python, which is not on PATH unless the venv is activated
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), bin_dir]) if env.get("PATH") else bin_dir
    env.update(extra or {})
    return env


def _run_helper(args: list[str], env: dict[str, str], progress: Progress | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vtool-fi-") as tmp:
        res = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "vtool.toolchain.flashinfer_attention", *args, str(res)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not res.exists():
            text = (proc.stdout + proc.stderr).strip()
            last = text.splitlines()[-1] if text else ""
            if last.startswith("vtool-error: "):
                raise FlashInferError(last[len("vtool-error: "):].replace("\\n", "\n"))
            raise FlashInferError(f"the FlashInfer helper failed (exit {proc.returncode}):\n{text[-6000:]}")
        return json.loads(res.read_text())


_PROBE: dict[str, Any] | None = None


def probe() -> dict[str, Any]:
    """flashinfer's version and location, and whether its binding fits TVM 0.27's runtime;
    refuses (FlashInferError) when flashinfer is missing or does not fit."""
    global _PROBE
    if _PROBE is None:
        try:
            _PROBE = _run_helper(["probe"], _flashinfer_env())
        except FlashInferError as err:
            _PROBE = {"error": err}  # asked once per process: `auto` asks on every CUDA build
    if "error" in _PROBE:
        raise _PROBE["error"]
    return _PROBE


def _nvcc() -> str:
    from vtool.toolchain.cuda import find_nvcc

    return find_nvcc()


def object_key(dtype: str, head_dim: int, archs, info: dict[str, Any]) -> str:
    from vtool.toolchain.cuda import nvcc_version

    payload = {"flashinfer": info["version"], "archs": list(archs), "arch_list": arch_list(archs), "dtype": dtype,
               "qk_head_dim": head_dim, "v_head_dim": head_dim, "nvcc": nvcc_version(),
               "builder": BUILDER_VERSION}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


@dataclasses.dataclass
class FlashInferObjects:
    folder: Path
    objects: list[Path]
    record: dict[str, Any]  # the manifest's build.cuda.attention

    def addons(self) -> list[str]:
        """export_library addons: the objects, the stubs for what they name but never
        call, then libcudart (what they call)."""
        from vtool.toolchain.cuda import cuda_toolkit_library

        return [str(p) for p in self.objects] + [str(unreachable_stubs(self))] + [str(cuda_toolkit_library("cudart"))]


def build_objects(dtype: str, head_dim: int, archs, progress: Progress | None = None,
                  jobs: int | None = None) -> FlashInferObjects:
    """The FlashInfer prefill + decode objects for one shape, from the cache or built now."""
    progress = progress or (lambda _m: None)
    info = probe()
    key = object_key(dtype, head_dim, archs, info)
    folder = cache_root() / "flashinfer" / key
    meta_path = folder / "objects.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        objects = [folder / name for name in meta["objects"]]
        if all(p.exists() for p in objects):
            progress(f"using cached FlashInfer kernels {folder}")
            meta["cached"] = True
            return FlashInferObjects(folder, objects, meta)
    progress(f"compiling FlashInfer {info['version']} prefill + decode kernels ({dtype}, head_dim {head_dim}, "
             f"{', '.join(archs)}); this takes minutes")
    t0 = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=folder.parent))
    try:
        nvcc = Path(_nvcc()).resolve()
        env = _flashinfer_env({
            "FLASHINFER_CUDA_ARCH_LIST": arch_list(archs),
            "CUDA_HOME": str(nvcc.parent.parent),
            "FLASHINFER_WORKSPACE_BASE": str(staging / "work"),
            "MAX_JOBS": str(jobs or os.cpu_count() or 1),
        })
        req = staging / "request.json"
        req.write_text(json.dumps({"dtype": dtype, "head_dim": head_dim, "out": str(staging)}))
        result = _run_helper(["build", str(req)], env)
        shutil.rmtree(staging / "work", ignore_errors=True)
        req.unlink()
        meta = {"backend": "flashinfer", "flashinfer": info["version"], "arch_list": arch_list(archs),
                "dtype": dtype, "head_dim": head_dim, "objects": result["objects"],
                "symbols": list(PREFILL_SYMBOLS + DECODE_SYMBOLS), "nvcc_flags": result["nvcc_flags"],
                "object_bytes": sum((staging / n).stat().st_size for n in result["objects"]),
                "seconds": round(time.perf_counter() - t0, 1), "cache_key": key}
        (staging / "objects.json").write_text(json.dumps(meta, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        staging.replace(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    progress(f"FlashInfer kernels built in {meta['seconds']:.0f} s")
    meta["cached"] = False
    return FlashInferObjects(folder, [folder / n for n in meta["objects"]], meta)


def check_library(path: str | Path, archs, ptx: str, fi: FlashInferObjects, linked=()) -> dict[str, Any]:
    """cuda.check_library for a library that also links FlashInfer objects: their fatbins
    (SASS only, one per object), and those of the other `linked` objects, are taken off before
    TVM's module is checked; the exported symbols must be there."""
    from vtool.toolchain import cuda

    info = cuda.check_library(path, archs, ptx, linked=[*fi.objects, *linked])
    extra: list[str] = []
    for obj in fi.objects:
        extra += cuda.inspect_library(obj)["sass"]
    missing = missing_symbols(path)
    if missing:
        raise cuda.CudaBuildError(f"{path} does not export the FlashInfer functions {missing}")
    unresolved = unexpected_undefined(path)
    if unresolved:
        raise cuda.CudaBuildError(f"{path} leaves symbols undefined that nothing at run time provides: "
                                  f"{unresolved[:10]}")
    info["flashinfer_sass"] = extra
    return info


def _nm(path: str | Path, *flags: str) -> list[str]:
    out = subprocess.run(["nm", "-D", *flags, str(path)], capture_output=True, text=True, check=False).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def missing_symbols(path: str | Path) -> list[str]:
    defined = set(_nm(path, "--defined-only"))
    return [s for s in PREFILL_SYMBOLS + DECODE_SYMBOLS if f"__tvm_ffi_{s}" not in defined]


# Undefined in FlashInfer's own JIT libraries too: batch_prefill.cu's DISPATCH_CTA_TILE_Q
# names CTA_TILE_Q=32, which the kernel files instantiate only for head_dim >= 512 (where
# FA2DetermineCtaTileQ can pick it). Never called; left undefined they would still make
# model.so fail to load under RTLD_NOW / LD_BIND_NOW=1 (TVM itself dlopens with RTLD_LAZY),
# so unreachable_stubs() defines them to return cudaErrorNotSupported.
_UNREACHABLE = re.compile(r"^_ZN10flashinfer\d+BatchPrefillWith(Paged|Ragged)KVCacheDispatchedILj32E")
_CUDA_ERROR_NOT_SUPPORTED = 801


def unreachable_stubs(fi: FlashInferObjects) -> Path:
    """An object defining each symbol the FlashInfer objects reference, none defines and
    _UNREACHABLE names (C functions under the mangled names, returning cudaError_t
    cudaErrorNotSupported; the SysV caller owns its arguments, so ignoring them is safe)."""
    stub = fi.folder / "unreachable_stubs.o"
    if stub.exists():
        return stub
    defined: set[str] = set()
    undefined: set[str] = set()
    for obj in fi.objects:
        out = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[-2] == "U":
                undefined.add(parts[-1])
            elif len(parts) == 3:
                defined.add(parts[-1])
    names = sorted(sym for sym in undefined - defined if _UNREACHABLE.match(sym))
    source = "/* FlashInfer instantiations that batch_prefill.cu names but never calls. */\n" + "".join(
        f"int {name}(void) {{ return {_CUDA_ERROR_NOT_SUPPORTED}; }}\n" for name in names)
    from vtool.toolchain.cuda import _c_compiler

    with tempfile.TemporaryDirectory(prefix="vtool-fi-stub-") as tmp:
        src, obj = Path(tmp) / "unreachable_stubs.c", Path(tmp) / "unreachable_stubs.o"
        src.write_text(source)
        proc = subprocess.run([_c_compiler(), "-c", "-fPIC", "-O1", str(src), "-o", str(obj)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise FlashInferError(f"compiling the FlashInfer stubs failed:\n{proc.stderr[-2000:]}")
        shutil.copy2(obj, stub.with_suffix(".tmp"))
        stub.with_suffix(".tmp").replace(stub)
    return stub


def unexpected_undefined(path: str | Path) -> list[str]:
    """Undefined dynamic symbols that neither a versioned system library (libc, libstdc++,
    libcudart.so.13: `name@VERSION`) nor tvm-ffi (TVMFFI*, loaded by the runtime) defines."""
    return [sym for sym in _nm(path, "--undefined-only")
            if "@" not in sym and not sym.startswith(("TVMFFI", "_ITM_", "__gmon_start__", "__cxa_finalize"))]


# ---------------------------------------------------------------------------------------
# The helper subprocess (flashinfer + torch importable, env set before import)


def _binding_fits(csrc: Path) -> str | None:
    """None if flashinfer's prefill binding has the plan TVM 0.27's runtime calls, else why not."""
    text = (csrc / "batch_prefill_jit_binding.cu").read_text()
    if not _PLAN_TAIL.search(text):
        m = re.search(r"BatchPrefillWithKVCachePlan\(([^;]*?)\)\s*;", text, re.S)
        tail = " ".join(m.group(1).split()[-4:]) if m else "?"
        return (f"its BatchPrefillWithKVCachePlan ends with `{tail}`, but TVM 0.27's runtime calls it with 19 "
                f"arguments ending in num_colocated_ctas (flashinfer <= {TESTED_FLASHINFER})")
    return None


# flashinfer's optional CuTe-DSL kernels (nvidia-cutlass-dsl, a dependency of flashinfer-python since
# 0.6) ask torch for the GPU's properties when they are imported, which fails on a build machine
# without one (an AssertionError flashinfer does not catch). The build needs only the attention
# kernels' sources: the helper process hides the DSL, and flashinfer's import then skips those kernels.
_HIDDEN_MODULES = ("cutlass",)


def hide_gpu_probing_modules() -> None:
    """Make `import cutlass` raise ImportError in this (helper) process (_HIDDEN_MODULES)."""
    for name in _HIDDEN_MODULES:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def _helper_probe() -> dict[str, Any]:
    hide_gpu_probing_modules()
    try:
        import flashinfer  # noqa: F401
        from flashinfer.jit import env as jit_env
    except ImportError as err:
        raise FlashInferError(
            f"--attention flashinfer needs the flashinfer-python package at build time ({err}); "
            f"pip install 'vtool[cuda-build]' (flashinfer-python=={TESTED_FLASHINFER}), or install it anywhere "
            f"(pip install --target DIR ... --no-deps, plus nvidia-ml-py einops tabulate ninja tqdm) and set "
            f"{FLASHINFER_PATH_ENV}=DIR") from None
    from flashinfer.version import __version__

    why = _binding_fits(jit_env.FLASHINFER_CSRC_DIR)
    if why:
        raise FlashInferError(f"flashinfer {__version__} does not fit TVM 0.27: {why}; install flashinfer-python=="
                              f"{TESTED_FLASHINFER}")
    if shutil.which("ninja") is None:
        raise FlashInferError("flashinfer's build needs ninja on PATH (pip install ninja)")
    return {"version": __version__, "location": str(Path(flashinfer.__file__).parent)}


def _rename_exports(sources, prefix: str) -> None:
    """TVM's _rename_exported_func_names: `plan` -> `<prefix>_plan` in the *_binding.cu files."""
    for src in sources:
        if not src.name.endswith("_binding.cu"):
            continue
        lines = src.read_text().splitlines(keepends=True)
        for i, line in enumerate(lines):
            body = line.rstrip("\r\n")
            m = _EXPORT.match(body)
            if m:
                lines[i] = f"{m.group(1)}{prefix}_{m.group(2)}{m.group(3)}" + line[len(body):]
        src.write_text("".join(lines))


def _specs(dtype: str, head_dim: int):
    """The two JitSpecs, with TVM 0.27's arguments (relax/backend/cuda/flashinfer.py)."""
    import torch
    from flashinfer.jit import gen_customize_batch_decode_module, gen_customize_batch_prefill_module

    t = getattr(torch, dtype)
    tail = f"dtype_q_{dtype}_dtype_kv_{dtype}_dtype_o_{dtype}_qk_head_dim_{head_dim}_v_head_dim_{head_dim}" \
           f"_enable_inline_rope_False"
    common = dict(dtype_q=t, dtype_kv=t, dtype_o=t, idtype=torch.int32, head_dim_qk=head_dim, head_dim_vo=head_dim,
                  pos_encoding_mode=0, additional_tensor_names=[], additional_tensor_dtypes=[],
                  additional_scalar_names=["sm_scale", "rope_rcp_scale", "rope_rcp_theta"],
                  additional_scalar_dtypes=["double", "double", "double"],
                  variant_name="DefaultAttention<false, false, false, false>",
                  variant_decl="#include <flashinfer/attention/variants.cuh>")
    prefill = gen_customize_batch_prefill_module(backend="fa2", uri="batch_prefill_tvm_" + tail, **common)
    decode = gen_customize_batch_decode_module(uri="batch_decode_tvm_" + tail, **common)
    _rename_exports(prefill.sources, "batch_prefill")
    _rename_exports(decode.sources, "batch_decode")
    return [prefill, decode]


def _ninja_objects(ninja_file: Path) -> list[str]:
    return [line.split()[1].rstrip(":") for line in ninja_file.read_text().splitlines()
            if line.startswith("build ") and line.split()[2] in ("cuda_compile", "compile")]


def _helper_build(request: dict[str, Any]) -> dict[str, Any]:
    _helper_probe()
    out = Path(request["out"])
    specs = _specs(request["dtype"], int(request["head_dim"]))
    objects, flags = [], ""
    for spec in specs:
        spec.write_ninja()
        objs = _ninja_objects(spec.ninja_path)
        cmd = ["ninja", "-C", str(spec.build_dir), "-f", str(spec.ninja_path), *objs]
        if os.environ.get("MAX_JOBS"):
            cmd[1:1] = ["-j", os.environ["MAX_JOBS"]]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise FlashInferError(f"compiling FlashInfer's {spec.name} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        for obj in objs:
            dest = out / Path(obj).name  # <uri>_<source>.cuda.o: unique across the two specs
            shutil.copy2(obj, dest)
            objects.append(dest.name)
        m = re.search(r"^cuda_cflags = (.*?)\n\S", spec.ninja_path.read_text(), re.S | re.M)
        flags = " ".join(m.group(1).replace("$\n", " ").split()) if m else ""
    flags = re.sub(r"-I\S+|-isystem \S+", "", flags)
    return {"objects": objects, "nvcc_flags": " ".join(flags.split())}


def main(argv: list[str]) -> int:
    try:
        if argv[0] == "probe":
            result = _helper_probe()
        elif argv[0] == "build":
            result = _helper_build(json.loads(Path(argv[1]).read_text()))
        else:
            raise FlashInferError(f"unknown command {argv[0]!r}")
    except VtoolError as err:
        print("vtool-error: " + str(err).replace("\n", "\\n"), flush=True)
        return 2
    Path(argv[-1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
