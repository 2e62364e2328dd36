"""The command line of the kernel benchmarks that build here and run on the GPU machine:
`SCRIPT build OUT.so` compiles (with nvcc and the build-time driver stub), `SCRIPT run OUT.so`
loads the library with the runtime alone and measures."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable


def rerun_with_driver_stub() -> None:
    """Start this command again with the CUDA driver stub on the loader path (the build needs
    it where no GPU is), unless this is that second run."""
    if os.environ.get("TVM_CUDA_COMPILE_MODE") != "nvcc":
        from vtool.toolchain.cuda import worker_env

        sys.exit(subprocess.call([sys.executable, *sys.argv], env=worker_env()))


def build_or_run(doc: str, build: Callable[[str], None], run: Callable[[str], None]) -> None:
    args = sys.argv[1:]
    if args[:1] == ["build"] and len(args) == 2:
        rerun_with_driver_stub()
        build(args[1])
    elif args[:1] == ["run"] and len(args) == 2:
        run(args[1])
    else:
        raise SystemExit(doc)


def rotated_kernel_us(run_set: Callable[[int], None], n_sets: int, name: str) -> tuple[float, int]:
    """(median microseconds, launches timed) of the kernel named `name` while run_set(i) calls it
    on weight set i, the sets taken in turn so each call reads its weights from memory, not L2;
    device times from torch.profiler (CUPTI). Every set runs once untimed first."""
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    for i in range(n_sets):
        run_set(i)
    torch.cuda.synchronize()
    reps = 8 * n_sets if n_sets >= 4 else 24
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            run_set(i % n_sets)
        torch.cuda.synchronize()
    ts = [e.device_time for e in prof.events() if e.device_type.name == "CUDA" and name in e.name]
    return float(np.median(ts)), len(ts)
