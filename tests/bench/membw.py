"""Memory read bandwidth of this machine, with one thread and with N threads (numpy).

    python tests/bench/membw.py [--gib 1] [--threads 1 2] [--repeat 7] [--json out.json]

Why: batch-1 decode of a quantized LLM on a CPU streams every weight once per token, so its
ceiling ("roofline") is  read bandwidth / weight bytes per token. This gives the denominator
for tests/bench/llamacpp.py and for vtool's own decode figures.

How: a buffer much larger than the last-level cache (default 1 GiB against a 32 MiB L3) is
filled once with random data (so its pages are resident and distinct), then reduced with several numpy reductions that
read each byte once and whose arithmetic is cheaper than the memory traffic (SIMD-vectorized
sum / max over 8-byte integers and floats). With N threads each thread reduces its own
contiguous 1/N of the buffer (numpy releases the GIL inside reductions); the figure is
buffer bytes / wall time of the slowest thread. Each kernel is timed --repeat times and the
best run is kept (the machine may be shared); the reported bandwidth is the best kernel,
since a kernel slower than the others is compute-bound rather than memory-bound.
A copy (read + write) figure is printed for reference, counting bytes read plus written.
The machine may be shared: before each thread count it waits (bounded) for the other
processes to go quiet, and it records how many cores' worth of work they did meanwhile.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np


# ------------------------------------------------------------------ how busy the rest of the machine is
# The machine may be shared: every figure is recorded with the CPU time that *other* processes
# used while it was measured (system-wide busy time from /proc/stat minus this process' and
# its children's own CPU time), in cores; near 0 means the figure is clean.

def _proc_stat() -> tuple[float, float]:
    """(busy, total) seconds of all CPUs since boot (Linux /proc/stat); (0, 0) elsewhere."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks[:8]) - idle) / hz, sum(ticks[:8]) / hz


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherLoad:
    """Context manager: `.cores` = CPU cores' worth of work done by other processes meanwhile."""

    def __enter__(self) -> "OtherLoad":
        self._busy, _ = _proc_stat()
        self._own, self._t = _own_cpu(), time.perf_counter()
        self.cores = float("nan")
        return self

    def __exit__(self, *exc: object) -> None:
        busy, _ = _proc_stat()
        wall = time.perf_counter() - self._t
        if wall > 0 and busy:
            self.cores = round(max(0.0, (busy - self._busy) - (_own_cpu() - self._own)) / wall, 2)


def wait_quiet(max_cores: float, max_wait_s: float, sample_s: float = 2.0) -> float:
    """Waits (up to max_wait_s) until other processes use at most max_cores over a sample;
    returns the last sample's figure."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        with OtherLoad() as load:
            time.sleep(sample_s)
        if load.cores <= max_cores or time.perf_counter() >= deadline:
            return load.cores


def own_sched_group(nice: int) -> None:
    """A session of its own for this process (so, with the kernel's autogroup scheduling, a
    scheduling group of its own) at nice value `nice`, and the same nice for the process.
    With autogroup on, a plain `nice` only ranks a process within its session's group, which
    does not help against other sessions' processes. Negative values need root. Used as a
    subprocess preexec_fn by llamacpp.py, and by --nice here."""
    try:
        os.setsid()
    except OSError:
        pass  # already a session/group leader: the current group is re-niced
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroup: the process nice below is what counts
    os.nice(nice - os.nice(0))


KERNELS: dict[str, Callable[[np.ndarray], object]] = {
    "sum int64": lambda a: np.add.reduce(a.view(np.int64)),
    "max int64": lambda a: np.maximum.reduce(a.view(np.int64)),
    "sum float64": lambda a: np.add.reduce(a.view(np.float64)),
    "max float32": lambda a: np.maximum.reduce(a.view(np.float32)),
}


def read_bandwidth(buf: np.ndarray, kernel: Callable[[np.ndarray], object], threads: int,
                   repeat: int, pool: ThreadPoolExecutor) -> tuple[float, float]:
    """Best-of-`repeat` GB/s (1e9 bytes/s) of `kernel` over `buf`, split across `threads`, and
    the other processes' load (cores) during the best repetition."""
    parts = np.array_split(buf, threads)
    best, other = float("inf"), float("nan")
    for _ in range(repeat):
        with OtherLoad() as load:
            t0 = time.perf_counter()
            if threads == 1:
                kernel(buf)
            else:
                list(pool.map(kernel, parts))
            seconds = time.perf_counter() - t0
        if seconds < best:
            best, other = seconds, load.cores
    return buf.nbytes / best / 1e9, other


def copy_bandwidth(buf: np.ndarray, threads: int, repeat: int, pool: ThreadPoolExecutor) -> float:
    """Best-of-`repeat` GB/s of np.copyto, counting bytes read + bytes written."""
    dst = np.empty_like(buf)
    dst.fill(0)
    srcs, dsts = np.array_split(buf, threads), np.array_split(dst, threads)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        list(pool.map(lambda p: np.copyto(p[0], p[1]), zip(dsts, srcs)))
        best = min(best, time.perf_counter() - t0)
    return 2 * buf.nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="buffer size in GiB (keep it >> L3)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--no-copy", action="store_true", help="skip the copy figure (needs a second buffer)")
    ap.add_argument("--json", type=str, help="write the results here as JSON")
    ap.add_argument("--quiet-cores", type=float, default=0.3,
                    help="before each thread count, wait until other processes use at most this many cores")
    ap.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for that, at most")
    ap.add_argument("--nice", type=int, default=0,
                    help="run at this nice value in a scheduling group of its own (negative needs root)")
    a = ap.parse_args()
    if a.nice:
        own_sched_group(a.nice)

    n = int(a.gib * (1 << 30)) // 64 * 64
    buf = np.empty(n, dtype=np.uint8)
    # Random contents: every page is touched and distinct (identical pages could be merged by
    # the host, e.g. KSM, and then be read from cache); uniform float32 in [0, 1) keeps both the
    # float32 and the float64 views finite.
    np.random.default_rng(0).random(n // 4, dtype=np.float32, out=buf.view(np.float32))
    result: dict[str, object] = {"buffer_bytes": n, "numpy": np.__version__, "cpus": os.cpu_count(), "nice": a.nice,
                                 "loadavg_before": [round(x, 2) for x in os.getloadavg()], "read_gbs": {}}
    with ThreadPoolExecutor(max(a.threads)) as pool:
        for threads in a.threads:
            quiet = wait_quiet(a.quiet_cores, a.max_wait)
            runs = {name: read_bandwidth(buf, k, threads, a.repeat, pool) for name, k in KERNELS.items()}
            per_kernel = {name: round(gbs, 2) for name, (gbs, _) in runs.items()}
            other = {name: o for name, (_, o) in runs.items()}
            best = max(per_kernel.values())
            result["read_gbs"][str(threads)] = {"best": best, "kernels": per_kernel,
                                                "other_load_cores": other, "other_load_before": quiet}
            print(f"read, {threads} thread(s): {best:6.2f} GB/s   "
                  + "  ".join(f"{k}={v:.2f}" for k, v in per_kernel.items())
                  + f"   (other processes: {quiet} cores before, "
                  + ", ".join(str(o) for o in other.values()) + " during)", flush=True)
            if not a.no_copy:
                c = round(copy_bandwidth(buf, threads, max(3, a.repeat // 2), pool), 2)
                result.setdefault("copy_gbs", {})[str(threads)] = c  # type: ignore[union-attr]
                print(f"copy, {threads} thread(s): {c:6.2f} GB/s (read + write)", flush=True)
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"buffer {n / (1 << 30):.2f} GiB, numpy {np.__version__}, load average before/after "
          f"{result['loadavg_before']} / {result['loadavg_after']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
