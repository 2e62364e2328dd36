"""What admitting a wave of prompts costs, in one process (issue 13: a served wave of 64 x 128/128
on the SmolLM2 shape spends ~150-200 ms of its ~650 in the 4-5 steps that admit the prompts).

    python tests/bench/wave_admission.py --artifact DIR --model CKPT [--batch 64] [--prompt 128]
                                         [--group 16] [--rounds 3] [--decode 32] [--profile]

Each round: `--batch` requests of `--prompt` random token ids arrive `--group` at a time, one
group before each engine step (as a served wave arrives while the first prompts run), until
every request has its first token; then `--decode` more steps of the full batch, then all are
aborted. Per round: the admission's wall time (first arrival to the last first token) and its
steps, the decode steps' median time, a digest of the greedy first tokens in request order (equal
for libraries that must compute alike). `--profile` adds, for the last round's admission, the GPU
kernels by total time (torch.profiler, CUPTI: TVM's kernels included) and the main thread's
Python functions by own time (cProfile), so host-bound and device-bound admissions tell apart.
One JSON line per round, then the profile line.
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import statistics
import time
from pathlib import Path

import numpy as np

from mixed_steps import engine_arguments, make_engine


def admit_wave(engine, rng: np.random.Generator, a: argparse.Namespace, round_no: int) -> dict:  # noqa: ANN001
    """Run one wave's admission; the requests stay running."""
    from vtool.runtime.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=a.decode + 8, ignore_eos=True, temperature=0.0)
    waiting = [f"w{round_no}-{i}" for i in range(a.batch)]
    started: set[str] = set()
    first: dict[str, int] = {}
    steps, t0 = 0, time.perf_counter()
    while len(first) < a.batch:
        for request_id in waiting[:a.group]:
            prompt = rng.integers(100, engine.vocab_size - 100, a.prompt).tolist()
            engine.add_request(request_id, prompt, params, with_text=False)
        del waiting[:a.group]
        for out in engine.step_core():
            if out.new_token_ids:
                first.setdefault(out.request_id, out.new_token_ids[0])
        steps += 1
    seconds = time.perf_counter() - t0
    # greedy first tokens in request order: libraries that must compute alike give the same digest
    tokens = np.array([first[f"w{round_no}-{i}"] for i in range(a.batch)], dtype=np.int64)
    return {"admission_ms": round(1e3 * seconds, 2), "admission_steps": steps,
            "step_tokens_last": engine.last_step_tokens,
            "first_tokens_digest": hashlib.sha256(tokens.tobytes()).hexdigest()[:16]}


def decode_and_clear(engine, a: argparse.Namespace) -> float:  # noqa: ANN001
    times = []
    for _ in range(a.decode):
        t = time.perf_counter()
        engine.step_core()
        times.append(time.perf_counter() - t)
    for request_id in list(engine.requests):
        engine.finish_request(request_id, "abort", None)
    while engine.has_unfinished():
        engine.step_core()
    return 1e3 * statistics.median(times)


def profiled_admission(engine, rng: np.random.Generator, a: argparse.Namespace) -> dict:  # noqa: ANN001
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    gpu = torch.cuda.is_available()
    device = torch.autograd.DeviceType.CUDA if gpu else torch.autograd.DeviceType.CPU
    host = cProfile.Profile()
    with torch_profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        host.enable()
        wave = admit_wave(engine, rng, a, -1)
        host.disable()
        if gpu:
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == device:
            kernels.setdefault(event.name, []).append(event.device_time_total)
    stats = pstats.Stats(host)
    own = sorted(((v[2], f"{Path(k[0]).name}:{k[1]}:{k[2]}", v[1]) for k, v in stats.stats.items()), reverse=True)
    decode_and_clear(engine, a)
    return {"profile": wave,
            "kernel_ms_total": round(sum(sum(v) for v in kernels.values()) / 1e3, 2),
            "top_kernels": [(k[:90], round(sum(v) / 1e3, 3), len(v))
                            for k, v in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:15]],
            "host_ms_total": round(1e3 * sum(v[2] for v in stats.stats.values()), 2),
            "top_host": [(name, round(1e3 * t, 2), calls) for t, name, calls in own[:20]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    engine_arguments(ap)
    ap.add_argument("--group", type=int, default=16, help="prompts arriving before each admission step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", type=int, default=32, help="full-batch decode steps after each admission")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    a.context = a.decode + 16  # make_engine sizes max_model_len from prompt + context
    engine = make_engine(a.artifact, a.model, a)
    rng = np.random.default_rng(0)
    for r in range(a.rounds + 1):  # round 0 warms up (graph captures, allocator pools)
        wave = admit_wave(engine, rng, a, r)
        wave["decode_step_ms"] = round(decode_and_clear(engine, a), 3)
        if r:
            print(json.dumps({"round": r, "batch": a.batch, "group": a.group, "prompt": a.prompt, **wave}), flush=True)
    if a.profile:
        print(json.dumps(profiled_admission(engine, rng, a)), flush=True)


if __name__ == "__main__":
    main()
