"""models/moe.py's two kernels alone on CUDA, against numpy: where a tiny MoE model's wrong
CUDA logits come from, without the rest of the model around them.

    python tests/support/moe_probe.py build OUT.so [--target sm_90a]   # here: compiles with nvcc
    python tests/support/moe_probe.py check OUT.so                     # on the GPU: prints the errors

`build` compiles every CASES kernel with the schedules a model build gives it
(vtool.schedules.cuda's pass, which finds them by block name) into one library; the compile
runs in a subprocess with the build-time driver stub (toolchain/cuda.py worker_env), as a
model's does. `check` (also tests/test_gpu_parity.py's test_moe_kernels_match_numpy_on_the_gpu)
runs each on random inputs on the GPU through the vtool runtime's TVM and compares it with
numpy: route's expert ids exactly and its weights within 1e-6, the gather-GEMVs within a
bound for their dtype.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class GemvCase:
    """gather_gemv(rows, top_k, out_features, in_features, experts, dtype, dtype) at `tokens` tokens."""
    name: str
    rows: int
    top_k: int
    out_features: int
    in_features: int
    experts: int
    dtype: str
    tokens: int


@dataclass(frozen=True)
class RouteCase:
    name: str
    experts: int
    top_k: int
    renormalize: bool
    tokens: int


# The tiny models' shapes (tests/support/tiny_models.py: Qwen3-MoE experts of 36 over hidden 48,
# Mixtral's of 40), a real one (Qwen3-30B-A3B: 128 experts of 768 over 2048, top 8, at a few
# experts), a prompt's tokens and a decode step's one.
CASES: tuple[GemvCase | RouteCase, ...] = (
    RouteCase("route_e8_k2", 8, 2, False, 11),
    RouteCase("route_e8_k2_norm", 8, 2, True, 11),
    RouteCase("route_e128_k8_norm", 128, 8, True, 5),
    *(GemvCase(f"qwen3moe_gate_up_{d}", 1, 2, 72, 48, 8, d, 11) for d in ("float32", "bfloat16")),
    *(GemvCase(f"qwen3moe_down_{d}", 2, 2, 48, 36, 8, d, 11) for d in ("float32", "bfloat16")),
    *(GemvCase(f"mixtral_gate_up_{d}", 1, 2, 80, 48, 8, d, 11) for d in ("float32", "bfloat16")),
    *(GemvCase(f"mixtral_down_{d}", 2, 2, 48, 40, 8, d, 11) for d in ("float32", "bfloat16")),
    GemvCase("qwen3moe_decode_down_float32", 2, 2, 48, 36, 8, "float32", 1),
    GemvCase("a3b_gate_up_bfloat16", 1, 8, 1536, 2048, 16, "bfloat16", 3),
    GemvCase("a3b_down_bfloat16", 8, 8, 2048, 768, 16, "bfloat16", 3),
)


def kernel(case: GemvCase | RouteCase) -> Any:
    from vtool.models.moe import gather_gemv, router

    if isinstance(case, RouteCase):
        func = router(case.experts, case.top_k, case.renormalize)
    else:
        func = gather_gemv(case.rows, case.top_k, case.out_features, case.in_features, case.experts,
                           case.dtype, case.dtype)
    return func.with_attr("global_symbol", case.name)


def compile_here(library: Path, target_name: str) -> None:
    """In the stub's subprocess: the CASES kernels through vtool's CUDA schedules, one library."""
    import tvm

    from vtool.schedules.cuda import cuda_schedule_pass
    from vtool.targets import lookup
    from vtool.toolchain import cuda

    spec = lookup(target_name)
    target = tvm.target.Target(spec.tvm)
    mod = tvm.IRModule({case.name: kernel(case) for case in CASES})
    record: dict[str, Any] = {}
    with cuda.fatbin_callback(spec.archs, spec.ptx, record), target:
        mod = cuda_schedule_pass()(mod)
        unscheduled = [gv.name_hint for gv, f in mod.functions_items() if not f.attrs.get("tirx.is_scheduled", False)]
        if unscheduled:
            raise SystemExit(f"not scheduled by vtool's CUDA pass: {unscheduled}")
        tvm.compile(mod, target=target).export_library(str(library))
    if "_error" in record:
        raise record["_error"]


def build(library: Path, target_name: str) -> None:
    from vtool.toolchain import cuda

    library.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "compile-here", str(library), "--target", target_name]
    subprocess.run(cmd, env=cuda.worker_env(), check=True)
    print(json.dumps(cuda.inspect_library(library)["sass"]))


# -- on the GPU -------------------------------------------------------------------------

def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def reference_route(logits: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    idx = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, idx, axis=1)
    if renormalize:
        w /= w.sum(axis=1, keepdims=True)
    return idx.astype(np.int32), w.astype(np.float32)


def check(library: Path, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Each CASES kernel on GPU 0 against numpy: {name: {"error": ..., "bound": ..., "ok": ...}}."""
    from vtool.runtime.artifact.tvm_runtime import ffi, global_func

    tvm_ffi = ffi()
    dev = tvm_ffi.device("cuda", 0)
    lib = tvm_ffi.load_module(str(library))
    alloc, put, get = (global_func(f"runtime.{n}") for n in
                       ("TVMTensorAllocWithScope", "TVMTensorCopyFromBytes", "TVMTensorCopyToBytes"))

    def to_gpu(a: np.ndarray, dtype: str) -> Any:
        t = alloc(tvm_ffi.Shape(a.shape), dtype, dev, None)
        a = np.ascontiguousarray(a)
        put(t, ctypes.c_void_p(a.ctypes.data), a.nbytes)
        return t

    def empty(shape: tuple[int, ...], dtype: str) -> Any:
        return alloc(tvm_ffi.Shape(shape), dtype, dev, None)

    def to_host(t: Any, np_dtype: Any) -> np.ndarray:
        out = np.empty(tuple(int(d) for d in t.shape), dtype=np_dtype)
        get(t, ctypes.c_void_p(out.ctypes.data), out.nbytes)
        return out

    rng = np.random.default_rng(seed)
    results: dict[str, dict[str, Any]] = {}
    for case in CASES:
        fn = lib[case.name]
        if isinstance(case, RouteCase):
            logits = rng.normal(0, 2, (case.tokens, case.experts)).astype(np.float32)
            idx_t, w_t = empty((case.tokens, case.top_k), "int32"), empty((case.tokens, case.top_k), "float32")
            fn(to_gpu(logits, "float32"), idx_t, w_t)
            ref_idx, ref_w = reference_route(logits, case.top_k, case.renormalize)
            idx, w = to_host(idx_t, np.int32), to_host(w_t, np.float32)
            ids_equal = bool((idx == ref_idx).all())
            err = float(np.abs(w - ref_w).max())
            results[case.name] = {"ids_equal": ids_equal, "error": err, "bound": 1e-6,
                                  "ok": ids_equal and err <= 1e-6}
            continue
        x = rng.normal(0, 1, (case.tokens, case.rows, case.in_features)).astype(np.float32)
        w = rng.normal(0, 1, (case.experts, case.out_features, case.in_features)).astype(np.float32)
        idx = np.stack([rng.choice(case.experts, case.top_k, replace=False) for _ in range(case.tokens)])
        idx = idx.astype(np.int32)
        if case.dtype == "bfloat16":
            xb, wb = _bf16_bits(x), _bf16_bits(w)
            x, w = _bf16_values(xb), _bf16_values(wb)  # the reference multiplies the rounded values
            args = [to_gpu(xb, "bfloat16"), to_gpu(wb, "bfloat16")]
        else:
            args = [to_gpu(x, "float32"), to_gpu(w, "float32")]
        out = empty((case.tokens, case.top_k, case.out_features), "float32")
        fn(*args, to_gpu(idx, "int32"), out)
        got = to_host(out, np.float32)
        rows = x if case.rows > 1 else np.repeat(x, case.top_k, axis=1)
        ref = np.einsum("tjc,tjnc->tjn", rows.astype(np.float64), w[idx].astype(np.float64))
        err = float(np.abs(got - ref).max())
        bound = 1e-4 * float(np.sqrt(case.in_features))  # float32 sums of in_features products of N(0, 1)
        results[case.name] = {"error": err, "bound": bound, "ok": err <= bound}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("build", "compile-here"):
        p = sub.add_parser(name)
        p.add_argument("library", type=Path)
        p.add_argument("--target", default="sm_90a")
    c = sub.add_parser("check")
    c.add_argument("library", type=Path)
    args = ap.parse_args()
    if args.cmd == "build":
        build(args.library.resolve(), args.target)
    elif args.cmd == "compile-here":
        compile_here(args.library, args.target)
    else:
        results = check(args.library)
        for name, r in results.items():
            print(f"{'ok  ' if r['ok'] else 'BAD '} {name}: {r}")
        sys.exit(0 if all(r["ok"] for r in results.values()) else 1)


if __name__ == "__main__":
    main()
