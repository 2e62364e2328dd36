"""Uncaptured `batch_decode` steps at several batch sizes from fresh caches, then a kernel
profile of the largest (a step of 64 sequences once took 2.9 s in gpu_decode_8b.py, twice in
all, not reproducible since; this is the probe that looks for it).

    python tests/bench/gpu_batch_probe.py ARTIFACT CHECKPOINT [--sizes 32,48,63,64] [--repeats 3]

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--sizes", default="32,48,63,64")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint

    model = CompiledModel(args.artifact, open_checkpoint(args.checkpoint))
    sizes = [int(s) for s in args.sizes.split(",")]
    for batch in sizes:
        timed = g.batch_decode_timer(model, batch)
        print(json.dumps({"batch": batch, "ms": [round(timed(2) * 1e3, 2) for _ in range(args.repeats)]}), flush=True)
    timed = g.batch_decode_timer(model, sizes[-1])
    timed(1)
    per_step, launches = g.kernel_times(lambda: timed(2), 6)  # 4 warm-up + 2 timed steps
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[:15]
    print(json.dumps({"batch": sizes[-1], "kernel_us_per_step": round(sum(per_step.values()), 1),
                      "top": [(k[:90], round(v, 1), launches[k]) for k, v in top]}), flush=True)


if __name__ == "__main__":
    main()
