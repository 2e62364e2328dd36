"""The CPU NT matmul rule's two schedules against numpy's BLAS, same process, same threads:
C = A . W^T (+ bias) at static row counts, A [rows, k], W [n, k] float32.

    python tests/bench/cpu_gemm.py [--k 768] [--n 2304] [--rows 1,7,16,32,64,455] [--threads 2]
                                   [--tile auto|6x2|8x3]

--tile: the micro-kernel's tile (rows x vectors of outputs) forced, instead of the rule's choice
(`micro_tiles`: 8 x 3 on AVX-512 where n is a multiple of 48, else 6 x 2). --kb N: N inputs per
packed weight panel, instead of the first of the tile's `kb_choices` that divides k.

Prints one JSON line per row count: the row schedule, the micro-kernel (where it fits), numpy,
best of 30 calls each, GFLOP/s and the error against float64.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=768)
    ap.add_argument("--n", type=int, default=2304)
    ap.add_argument("--rows", default="1,7,16,32,64,455")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tile", default="auto", choices=["auto", "6x2", "8x3"])
    ap.add_argument("--kb", type=int, default=0, help="inputs per packed panel forced (0: the tile's kb_choices)")
    args = ap.parse_args()
    from vtool.runtime.artifact.tvm_runtime import apply_cpu_threads

    apply_cpu_threads(args.threads)  # before TVM's pool starts (unpinned threads, as the runtime runs)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    import tvm
    from tvm import te

    from vtool.schedules import cpu
    from vtool.schedules.cpu import matmul
    from vtool.schedules.cpu.matmul import _schedule_gemm, _schedule_rows

    if args.tile != "auto" or args.kb:
        tiles = [t for t in matmul.TILES_AVX512 + matmul.TILES if args.tile in ("auto", f"{t.rows}x{t.vectors}")]
        if args.kb:
            tiles = [dataclasses.replace(t, kb_choices=(args.kb,)) for t in tiles]
        chosen = matmul.micro_tiles
        matmul.micro_tiles = lambda lanes: tuple(t for t in tiles if args.tile != "auto" or t.rows in
                                                 {c.rows for c in chosen(lanes)})

    target = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512" if "avx512f" in open("/proc/cpuinfo").read()
                                else "haswell", "num-cores": args.threads})
    lanes = cpu.vector_lanes(target)
    k, n = args.k, args.n
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype("float32")
    for rows in (int(r) for r in args.rows.split(",")):
        a = rng.standard_normal((rows, k)).astype("float32")
        A = te.placeholder((rows, k), "float32", name="A")
        W = te.placeholder((n, k), "float32", name="W")
        r = te.reduce_axis((0, k), "k")
        C = te.compute((rows, n), lambda i, j: te.sum(A[i, r] * W[j, r], axis=r), name="NT_matmul")
        func = te.create_prim_func([A, W, C]).with_attr("global_symbol", "main")
        want = a.astype(np.float64) @ w.T.astype(np.float64)
        line = {"rows": rows, "n": n, "k": k, "threads": args.threads, "tile": args.tile, "kb": args.kb or "auto"}
        for name, schedule in (("rows", _schedule_rows), ("micro_kernel", _schedule_gemm)):
            scheduled = schedule(func, lanes)
            if scheduled is None:
                continue
            with target:
                lib = tvm.compile(tvm.IRModule({"main": scheduled}), target=target)
            out = tvm.runtime.tensor(np.zeros((rows, n), "float32"))
            ta, tw = tvm.runtime.tensor(a), tvm.runtime.tensor(w)
            best = float("inf")
            for _ in range(30):
                t0 = time.perf_counter()
                lib["main"](ta, tw, out)
                best = min(best, time.perf_counter() - t0)
            line[f"{name}_gflops"] = round(2 * rows * n * k / best / 1e9, 1)
            line[f"{name}_err"] = float(np.abs(out.numpy() - want).max())
        best = float("inf")
        for _ in range(30):
            t0 = time.perf_counter()
            a @ w.T
            best = min(best, time.perf_counter() - t0)
        line["numpy_gflops"] = round(2 * rows * n * k / best / 1e9, 1)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
