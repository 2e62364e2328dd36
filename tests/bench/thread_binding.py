"""Whether TVM's thread pinning slows whole processes: N fresh processes each time one 64-row
float32 matmul (the row schedule, k = 768, n = 2304, best of 30 calls) with TVM_NUM_THREADS set
and TVM_BIND_THREADS unset (TVM's default: pinned) or 0 (vtool's runtime default).

    python tests/bench/thread_binding.py [--processes 10] [--threads 2]

Prints one JSON line per setting: each process's best time in ms. A pinned pool whose calling
thread shares a worker's core shows as a process at about twice the others' time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import time, numpy as np, tvm
from tvm import te
from vtool.schedules.cpu.matmul import _schedule_rows
k, n, m = 768, 2304, 64
A = te.placeholder((m, k), "float32", name="A"); W = te.placeholder((n, k), "float32", name="W")
r = te.reduce_axis((0, k), "k")
C = te.compute((m, n), lambda i, j: te.sum(A[i, r] * W[j, r], axis=r), name="NT_matmul")
f = _schedule_rows(te.create_prim_func([A, W, C]).with_attr("global_symbol", "main"), 16)
target = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})
with target:
    lib = tvm.compile(tvm.IRModule({"main": f}), target=target)
args = [tvm.runtime.tensor(np.random.rand(*s).astype("float32")) for s in ((m, k), (n, k), (m, n))]
best = 1e9
for _ in range(30):
    t0 = time.perf_counter(); lib["main"](*args); best = min(best, time.perf_counter() - t0)
print(best * 1e3)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    for bind in (None, "0"):
        env = {k: v for k, v in os.environ.items() if k not in ("TVM_BIND_THREADS", "VTOOL_CPU_THREADS")}
        env["TVM_NUM_THREADS"] = str(args.threads)
        if bind is not None:
            env["TVM_BIND_THREADS"] = bind
        times = [round(float(subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                                            check=True).stdout.split()[-1]), 3) for _ in range(args.processes)]
        print(json.dumps({"TVM_BIND_THREADS": bind or "unset (pinned)", "best_ms": times}), flush=True)


if __name__ == "__main__":
    main()
