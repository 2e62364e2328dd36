"""Where the device idles between an engine's decode steps (issue 13: a served step of one
sequence costs ~0.35 ms more than the model's `decode` steps queued back to back).

    python tests/bench/device_gaps.py --artifact DIR --model CKPT [--batch 1] [--warm-steps 40]
                                      [--steps 20] [--modes default,waiting] [--top 12]

Per mode (as tests/bench/chained_steps_ab.py's: "default" is EngineConfig's, "waiting" never
chains) the engine runs `--batch` greedy requests in one process, `--warm-steps` steps first
(the one-sequence chain rule decides within 8), then `--steps` engine steps under torch.profiler
(CUPTI sees TVM's kernels and copies). From the trace: the device's busy time per step (the union
of kernels and copies), its idle time per step, and the idle time per transition between two
named device activities (the one before the gap, the one after), largest first: which handoff
between steps the device waits through. One JSON line per mode.

Profiling adds host time to every launch, so gaps read larger than in an unprofiled run; compare
modes within one run.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from chained_steps_ab import MODES


def device_intervals(trace_path: Path) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every kernel and memory copy/set in a chrome trace, by start."""
    events = json.loads(trace_path.read_text()).get("traceEvents", [])
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            out.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", ""))[:70]))
    return sorted(out)


def idle_by_transition(intervals: list[tuple[float, float, str]], min_gap_us: float = 2.0
                       ) -> tuple[float, float, dict[tuple[str, str], float]]:
    """Busy and idle microseconds over the traced window, and idle time per (before, after) pair."""
    busy = idle = 0.0
    pairs: dict[tuple[str, str], float] = {}
    end, last = None, ""
    for start, stop, name in intervals:
        if end is None:
            end, last, busy = stop, name, stop - start
            continue
        if start > end:
            gap = start - end
            idle += gap
            if gap >= min_gap_us:
                pairs[(last, name)] = pairs.get((last, name), 0.0) + gap
            busy += stop - start
        elif stop > end:
            busy += stop - end
        if stop >= end:
            end, last = stop, name
    return busy, idle, pairs


def run_mode(session, mode: str, a: argparse.Namespace) -> dict:  # noqa: ANN001
    import torch
    from torch.profiler import ProfilerActivity, profile

    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.sampling.params import SamplingParams

    tokens = a.warm_steps + a.steps + 8
    engine = Engine(session, EngineConfig(max_num_seqs=max(a.batch, 2), enable_prefix_caching=False,
                                          gpu_memory_utilization=0.3, max_model_len=a.prompt + tokens + 16,
                                          chain_steps=MODES[mode][0], overlap_model_calls=MODES[mode][1]))
    rng = np.random.default_rng(0)
    for i in range(a.batch):
        engine.add_request(f"r{i}", rng.integers(100, engine.vocab_size - 100, a.prompt).tolist(),
                           SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0), with_text=False)
    for _ in range(a.warm_steps):
        engine.step_core()
    chained_before = engine.counters.chained_steps
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(a.steps):
                engine.step_core()
            wall = time.perf_counter() - t0
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace))
        intervals = device_intervals(trace)
    chained = engine.counters.chained_steps - chained_before
    while engine.has_unfinished():
        engine.step_core()
    if engine.model_thread is not None:
        engine.model_thread.close()
    busy, idle, pairs = idle_by_transition(intervals)
    top = sorted(pairs.items(), key=lambda kv: -kv[1])[:a.top]
    n = a.steps
    return {"mode": mode, "batch": a.batch, "steps": n, "chained_steps": chained,
            "step_ms": round(1e3 * wall / n, 3), "device_busy_ms_per_step": round(busy / 1e3 / n, 3),
            "device_idle_ms_per_step": round(idle / 1e3 / n, 3), "activities_per_step": round(len(intervals) / n, 1),
            "idle_us_per_step_by_transition": [(f"{before} -> {after}", round(us / n, 1)) for (before, after), us in top]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", required=True, type=Path)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--warm-steps", type=int, default=40)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", default="default,waiting")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint

    session = open_session(a.artifact, open_checkpoint(a.model), max_model_len=a.prompt + a.warm_steps + a.steps + 40)
    for mode in a.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
        print(json.dumps(run_mode(session, mode, a)), flush=True)


if __name__ == "__main__":
    main()
