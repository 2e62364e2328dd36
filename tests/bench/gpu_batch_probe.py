"""Uncaptured `batch_decode` steps at several batch sizes from fresh caches, then a kernel
profile of the largest (a step of 64 sequences once took 2.9 s in gpu_decode_8b.py, twice in
all, not reproducible since; this is the probe that looks for it).

    python tests/bench/gpu_batch_probe.py ARTIFACT CHECKPOINT [--sizes 32,48,63,64] [--repeats 3] [--steps 2]
        [--per-step 40]

One JSON line per size (ms a step, each of `repeats` timings of 2 steps), then the profile's
kernel time per step and its top kernels (microseconds a step, launches a step).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu_decode_8b as g  # noqa: E402 - the 8B benchmark's timers and profiler


def time_each_step(model, batch: int, steps: int) -> None:  # noqa: ANN001
    """Each step of a fresh cache timed alone: where a slow step's time goes (host or device)."""
    import time

    import numpy as np

    from vtool.runtime.artifact.tvm_runtime import global_func
    from vtool.runtime.engine.kv_cache import PagedKVCache

    sync = global_func("runtime.Device_StreamSync")
    S = model.ffi.Shape
    kv = PagedKVCache(model, num_blocks=batch * (384 // 16 + 1) + 8, block_size=16, max_num_seqs=batch,
                      prefill_chunk=2048)
    for seq in range(batch):
        kv.add(seq)
    ids = model.upload(np.full(batch, 1234, dtype=np.int32))
    flat = model.function("embed")(ids, model.params)
    embeds = global_func("runtime.TVMTensorCreateView")(flat, S([batch, 1, model.hidden_size]), model.dtype, 0)
    slow, total = [], 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        kv.begin_forward(list(range(batch)), [1] * batch)
        t1 = time.perf_counter()
        model.function("batch_decode")(embeds, kv.tvm, model.params)
        kv.end_forward()
        t2 = time.perf_counter()
        sync(model.device, 0)
        t3 = time.perf_counter()
        total += t3 - t0
        if t3 - t0 > 0.05:
            slow.append({"step": step, "begin_ms": round((t1 - t0) * 1e3, 1), "launch_ms": round((t2 - t1) * 1e3, 1),
                         "wait_ms": round((t3 - t2) * 1e3, 1)})
    print(json.dumps({"batch": batch, "per_step_steps": steps, "mean_ms": round(total / steps * 1e3, 2),
                      "slow_steps": slow}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--sizes", default="32,48,63,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed steps of each timing (the 8B bench times 32)")
    ap.add_argument("--per-step", type=int, default=0,
                    help="then this many steps of --per-step-batch sequences from a fresh cache, each timed alone: the "
                         "host's launch and its wait for the device, for any step over 50 ms")
    ap.add_argument("--per-step-batch", type=int, default=64)
    args = ap.parse_args()
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint

    model = CompiledModel(args.artifact, open_checkpoint(args.checkpoint))
    sizes = [int(s) for s in args.sizes.split(",")]
    for batch in sizes:
        timed = g.batch_decode_timer(model, batch)
        print(json.dumps({"batch": batch, "ms": [round(timed(args.steps) * 1e3, 2) for _ in range(args.repeats)]}),
              flush=True)
    if args.per_step:
        time_each_step(model, args.per_step_batch, args.per_step)
    timed = g.batch_decode_timer(model, sizes[-1])
    timed(1)
    per_step, launches, _ = g.kernel_times(lambda: timed(2), 6)  # 4 warm-up + 2 timed steps
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[:15]
    print(json.dumps({"batch": sizes[-1], "kernel_us_per_step": round(sum(per_step.values()), 1),
                      "top": [(k[:90], round(v, 1), launches[k]) for k, v in top]}), flush=True)


if __name__ == "__main__":
    main()
