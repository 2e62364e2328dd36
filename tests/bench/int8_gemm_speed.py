"""Kernel-only speed of the integer-dot GEMMs and GEMVs over GGUF blocks (schedules/cpu/int8_gemv.py):
GMAC/s for one weight shape, format, ISA and row count, best of several timed calls.

    python tests/bench/int8_gemm_speed.py --fmt Q8_0 --isa avx2 --shape 1536 576 --rows 512
    python tests/bench/int8_gemm_speed.py --fmt Q8_0 Q4_1 --isa avx2 avx512vnni --rows 1 512
    python tests/bench/int8_gemm_speed.py --fmt Q8_0 --rows 512 --chunk 3 4 6 8   # rows of x per pass

Run it from a tree (PYTHONPATH) to compare trees in one sitting; the weights and activations are
random (the speed does not depend on them). Threads: TVM_NUM_THREADS, default all cores.
Print the CPU's model and flags beside the figures (this script prints them first).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import tvm

from vtool.runtime.weights import quant_blocks
from vtool.schedules.cpu.int8_gemv import DEFAULT_CHUNK, gemm_func, gemv_func
from vtool.targets.host import host_cpu_features

MCPU = {"avx512vnni": "cascadelake", "avx2": "haswell"}


def _cpu_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown CPU")
    flags = sorted(f for f in host_cpu_features() if f.startswith(("avx", "amx", "fma")))
    return f"{model}; flags: {' '.join(flags)}"


def _random_blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    import gguf

    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    return gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, fmt))


def measure(fmt: str, isa: str, n: int, k: int, rows: int, repeat: int, chunk: int = DEFAULT_CHUNK) -> float:
    """GMAC/s of the best of `repeat` calls (`chunk`: the GEMM's rows of x per pass over a weight tile)."""
    lead = (1, 1) if rows == 1 else (1, tvm.tirx.Var("m", "int64"))
    func = gemv_func(fmt, isa, n, k, lead=2) if rows == 1 else gemm_func(fmt, isa, n, k, lead, rows_per_chunk=chunk)
    target = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": MCPU[isa]})
    kernel = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]
    rng = np.random.default_rng(0)
    parts = quant_blocks.repack(fmt, _random_blocks(fmt, n, k, rng), k)
    args = [tvm.runtime.tensor(rng.standard_normal((1, rows, k)).astype(np.float32))]
    args += [tvm.runtime.tensor(parts[p]) for p in quant_blocks.FORMATS[fmt].parts]
    args.append(tvm.runtime.tensor(np.zeros((1, rows, n), np.float32)))
    kernel(*args)  # warm-up: page faults, thread pool
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        kernel(*args)
        best = min(best, time.perf_counter() - start)
    return rows * n * k / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fmt", nargs="+", default=["Q8_0"])
    parser.add_argument("--isa", nargs="+", default=["avx2"], choices=sorted(MCPU))
    parser.add_argument("--shape", nargs=2, type=int, default=[1536, 576], metavar=("N", "K"))
    parser.add_argument("--rows", nargs="+", type=int, default=[512])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--chunk", nargs="+", type=int, default=[DEFAULT_CHUNK],
                        help="rows of x per pass over a weight tile (the GEMM's rows_per_chunk; the build uses "
                             f"{DEFAULT_CHUNK})")
    args = parser.parse_args()
    print(_cpu_line())
    n, k = args.shape
    for isa in args.isa:
        for fmt in args.fmt:
            for rows in args.rows:
                for chunk in (args.chunk if rows > 1 else [DEFAULT_CHUNK]):
                    gmacs = measure(fmt, isa, n, k, rows, args.repeat, chunk)
                    print(f"{fmt:7s} {isa:11s} [{n}, {k}] rows {rows:4d} chunk {chunk}: {gmacs:7.1f} GMAC/s")


if __name__ == "__main__":
    main()
