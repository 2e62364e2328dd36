"""Where the engine's host time goes per decode step, in one process (issue 13): at 64
sequences a small model's served step is host-bound on a GPU (SmolLM2-135M on an H100: ~2.7 ms
a step against a 1.7 ms model step with its draw), so every Python call per sequence counts.

    python tests/bench/engine_host_profile.py --artifact DIR --model CKPT [--batch 64] [--steps 60]
                                              [--temperature 0] [--top 30]

`--batch` requests of 128 random prompt tokens decode without end (ignore_eos) through
Engine.step_core with the metrics observer on, as the engine core runs them. After a warm-up,
`--steps` steps are timed plainly, then the same number under cProfile: the per-step wall time,
the engine's phase seconds per step, and the functions with the most own time (vtool's code and
the FFI calls it makes). The profiler slows Python calls, so read its list for where, the plain
timing for how much.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import numpy as np

PHASES = ("schedule_seconds", "output_seconds", "forward_seconds", "sample_seconds")


def time_ffi_calls(engine) -> dict[str, float]:  # noqa: ANN001
    """Wrap the compiled functions, the KV cache's TVM calls and the uploads the runner makes so
    that each adds its host seconds to the returned dict (cProfile does not see FFI calls: they
    fold into their Python caller's own time). On a GPU a call's host time is its queueing."""
    seconds: dict[str, float] = {}

    def timed(name: str, fn):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t
        return call

    model, kv = engine.runner.model, engine.kv
    plain_function, wrapped = model.function, {}

    def function(name: str):  # noqa: ANN202
        if name not in wrapped:
            wrapped[name] = timed(f"vm:{name}", plain_function(name))
        return wrapped[name]

    model.function = function
    for attr in ("upload", "upload_ints", "to_numpy"):
        setattr(model, attr, timed(f"model.{attr}", getattr(model, attr)))
    kv._begin, kv._end = timed("kv.tvm_begin_forward", kv._begin), timed("kv.tvm_end_forward", kv._end)
    sampler = engine.runner.device_sampler
    if sampler is not None:
        sampler._fns = {name: timed(f"sampler:{name}", fn) for name, fn in sampler._fns.items()}
    if engine.runner.decode_buckets is not None:
        buckets = engine.runner.decode_buckets
        buckets.entry = timed("vm:batch_decode_captured", buckets.entry)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True, type=Path)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.serving.metrics import ServerMetrics
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint

    length = 128 + 3 * a.steps + 64
    session = open_session(str(a.artifact), open_checkpoint(str(a.model)), None, length)
    engine = Engine(session, EngineConfig(max_num_seqs=a.batch, max_num_batched_tokens=max(8192, a.batch * 128),
                                          enable_prefix_caching=False, gpu_memory_utilization=0.3,
                                          max_model_len=length))
    engine.observer = ServerMetrics("m", max_model_len=length)
    rng = np.random.default_rng(0)
    vocab = min(session.model.vocab_size, 40000)
    for i in range(a.batch):
        engine.add_request(f"r{i}", rng.integers(10, vocab, 128).tolist(),
                           SamplingParams(max_tokens=3 * a.steps + 32, ignore_eos=True, temperature=a.temperature,
                                          seed=i), with_text=False)
    for _ in range(8):  # the prompts, then a few decode steps
        engine.step_core()
    calls = time_ffi_calls(engine)

    def phases() -> dict[str, float]:
        stats = engine.stats()
        return {k: stats[k] for k in PHASES}

    before, t0 = phases(), time.perf_counter()
    for _ in range(a.steps):
        engine.step_core()
    wall = (time.perf_counter() - t0) / a.steps * 1e3
    after = phases()
    per_step = {k.removesuffix("_seconds"): round((after[k] - before[k]) / a.steps * 1e3, 3) for k in PHASES}
    ffi = {name: round(seconds / a.steps * 1e3, 3) for name, seconds in sorted(calls.items(), key=lambda kv: -kv[1])}
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    for _ in range(a.steps):
        engine.step_core()
    profile.disable()
    profiled = (time.perf_counter() - t0) / a.steps * 1e3
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(a.top)
    print(json.dumps({"batch": a.batch, "temperature": a.temperature, "ms_per_step": round(wall, 3),
                      "ms_per_step_profiled": round(profiled, 3), "phase_ms_per_step": per_step,
                      "ffi_host_ms_per_step": ffi}))
    print(out.getvalue())


if __name__ == "__main__":
    main()
