"""Time the device sampler's functions alone (schedules/cuda/sampler.py), one or more libraries
side by side, and check they agree.

    python tests/bench/sampler_kernels.py --vocab 128256 --lib old=OLD.so --lib new=NEW.so \
        [--batches 1,8,64] [--calls 200]

Each library is a standalone sampler library (tests/test_gpu_sampler.py's build_cuda_library
makes one for a vocabulary). For every batch size: the same float32 logits [b, V] (standard
normal, so no ties) on the device, each function queued `calls` times back to back with the
host synchronised once (ms per call: the device time when the launches keep ahead of it, the
host's when they do not), in turn per library, three rounds, the best kept. Then the libraries'
outputs for one call: tokens must match the first library's (a temperature draw with the
same uniforms may differ only at a float near-tie, counted), logprobs within 2e-5.

Prints one JSON line per (library, function, batch) and one per comparison.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.artifact.tvm_runtime import cuda_runtime, ffi, global_func

_DL_CPU, _DL_CUDA, _POOLED = 1, 2, 2


class SamplerLibrary:
    """A standalone sampler library on the GPU, with the runtime's own upload and copy back
    (CompiledModel's, as tests/test_gpu_sampler.py's Library borrows them)."""

    upload = CompiledModel.upload
    to_numpy = CompiledModel.to_numpy
    on_gpu = CompiledModel.on_gpu

    def __init__(self, label: str, path: Path, device_type: str = "cuda"):
        if device_type == "cuda":
            cuda_runtime()  # registers TVM's CUDA module loader
        self.label, self.ffi = label, ffi()
        self.device_type, self.device = device_type, self.ffi.device(device_type, 0)
        self.vm = self.ffi.load_module(str(path))["vm_load_executable"]()
        if device_type == "cuda":
            self.vm["vm_initialization"](_DL_CUDA, 0, _POOLED, _DL_CPU, 0, _POOLED)
        else:
            self.vm["vm_initialization"](_DL_CPU, 0, _POOLED)

    def has(self, name: str) -> bool:
        try:
            self.vm[name]
        except Exception:  # noqa: BLE001 - the VM answers a missing name with an FFI error
            return False
        return True


def inputs(lib: SamplerLibrary, b: int, vocab: int, rng: np.random.Generator) -> dict[str, list]:
    logits = lib.upload(rng.standard_normal((b, vocab)).astype(np.float32) * 3)
    t = lib.upload(np.full(b, 1.0, np.float32))
    min_p = lib.upload(np.zeros(b, np.float32))
    u = lib.upload(rng.random(b))
    top_p = lib.upload(np.full(b, 0.9, np.float64))
    top_k = lib.upload(np.full(b, 50, np.int32))
    filtered = [logits, t, top_p, top_k, min_p, u]
    return {"sample_argmax": [logits], "sample_temperature": [logits, t, min_p, u],
            "sample_top_p_top_k": filtered, "sample_top_p_top_k_few_rows": filtered}


def timed(lib: SamplerLibrary, fn, args: list, calls: int, sync_each: bool = False) -> float:  # noqa: ANN001
    """ms a call: `calls` calls queued back to back and one wait, or (sync_each) a wait after
    every call, as the engine waits for each step's tokens."""
    sync = global_func("runtime.Device_StreamSync")
    for _ in range(3):
        fn(*args)
    sync(lib.device, 0)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
        if sync_each:
            sync(lib.device, 0)
    sync(lib.device, 0)
    return (time.perf_counter() - t0) / calls * 1e3


def kernel_times(lib: SamplerLibrary, fn, args: list, calls: int = 10) -> list:  # noqa: ANN001
    """[(kernel name, GPU microseconds per call, launches per call)] of `calls` calls, slowest
    first, from torch.profiler (its CUPTI trace sees TVM's and the linked objects' kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sync = global_func("runtime.Device_StreamSync")
    fn(*args)
    sync(lib.device, 0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*args)
        sync(lib.device, 0)
    groups: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            groups.setdefault(event.name[:60], []).append(getattr(event, "device_time_total", 0.0))
    rows = [(name, round(sum(v) / calls, 1), len(v) // calls) for name, v in groups.items()]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--lib", action="append", required=True, help="label=path of a sampler library")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--functions", default="sample_argmax,sample_temperature,sample_top_p_top_k")
    ap.add_argument("--sync-each", action="store_true", help="wait for the device after every call")
    ap.add_argument("--profile", action="store_true",
                    help="also print each function's kernels and their GPU time per call (torch.profiler: needs torch)")
    args = ap.parse_args()
    libs = [SamplerLibrary(*item.split("=", 1)) for item in args.lib]
    functions = args.functions.split(",")
    for b in (int(x) for x in args.batches.split(",")):
        data = {lib.label: inputs(lib, b, args.vocab, np.random.default_rng(b)) for lib in libs}
        best: dict[tuple[str, str], float] = {}
        for _ in range(3):
            for name in functions:
                for lib in libs:
                    if not lib.has(name):
                        continue
                    calls = args.calls if not name.startswith("sample_top_p_top_k") else max(args.calls // 10, 5)
                    ms = timed(lib, lib.vm[name], data[lib.label][name], calls, args.sync_each)
                    key = (lib.label, name)
                    best[key] = min(best.get(key, ms), ms)
        for (label, name), ms in best.items():
            print(json.dumps({"lib": label, "function": name, "batch": b, "vocab": args.vocab, "ms": round(ms, 4)}))
        if args.profile:
            for name in functions:
                for lib in (lib for lib in libs if lib.has(name)):
                    print(json.dumps({"profile": lib.label, "function": name, "batch": b,
                                      "kernels_us": kernel_times(lib, lib.vm[name], data[lib.label][name])}))
        first = libs[0]
        for name in (name for name in functions if first.has(name)):
            ref = first.vm[name](*data[first.label][name])
            ref_tok, ref_lp = first.to_numpy(ref[0]), first.to_numpy(ref[1])
            for lib in (lib for lib in libs[1:] if lib.has(name)):
                out = lib.vm[name](*data[lib.label][name])
                tok, lp = lib.to_numpy(out[0]), lib.to_numpy(out[1])
                print(json.dumps({"compare": f"{lib.label} vs {first.label}", "function": name, "batch": b,
                                  "tokens_differ": int((tok != ref_tok).sum()),
                                  "max_logprob_diff": float(np.nanmax(np.abs(lp - ref_lp))) if b else 0.0}))


if __name__ == "__main__":
    main()
