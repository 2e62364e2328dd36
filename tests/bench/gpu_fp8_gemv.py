"""The batch-1 FP8 decode GEMV (models/fp8_linear.py's `vtool_fp8_matmul`) alone, as a CUDA build
schedules it, on the Llama-3-8B shapes: a library built where the compiler is, timed on the GPU
machine with torch.profiler (CUPTI device times), the weights rotated over more than 4x the H200's
L2, the copy bandwidth measured in the same process.

    # here (nvcc and the build-time driver stub)
    python tests/bench/gpu_fp8_gemv.py build OUT.so
    # on the GPU machine (the runtime as for gpu_decode_8b.py), libraries timed in turn, twice
    python tests/bench/gpu_fp8_gemv.py run A.so [B.so ...]

Each kernel is the decode form of an FP8 linear: x [1, 1, K] bf16, weight e4m3 [N, K], a float32
scale per row, y = (x . w^T) * s cast to bf16 (three small shapes check the edges). rel_err: the
largest difference from torch's float32 product of the same e4m3 weights, over the largest output.
"""
from __future__ import annotations

import json
import os
import sys

SHAPES = {"gateup": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096),
          # guarded edges: 576 columns (a last chunk of 4 lanes' pieces), 30 rows (a partial block), 64 columns
          "smolqkv": (960, 576), "rows30": (30, 1536), "tiny": (96, 64)}


def build(out: str) -> None:
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    import tvm
    from tvm import te

    from vtool.models.fp8_linear import _matmul_te
    from vtool.schedules.cuda import cuda_schedule_pass
    from vtool.targets import lookup
    from vtool.toolchain import cuda

    spec = lookup("sm_90a")
    target = tvm.target.Target(spec.tvm)
    funcs = {}
    for name, (n, k) in SHAPES.items():
        x = te.placeholder((1, 1, k), "bfloat16", name="x")
        w = te.placeholder((n, k), "float8_e4m3fn", name="w")
        s = te.placeholder((n,), "float32", name="s")
        y = _matmul_te(x, w)
        scaled = te.compute(y.shape, lambda a, b, c: y[a, b, c] * s[c], name="T_multiply")
        cast = te.compute(y.shape, lambda *i: scaled(*i).astype("bfloat16"), name="T_cast")
        funcs[name] = te.create_prim_func([x, w, s, cast]).with_attr("global_symbol", name)
    with target:
        mod = cuda_schedule_pass()(tvm.IRModule(funcs))
    with cuda.fatbin_callback(spec.archs, spec.ptx, {}), target:
        lib = tvm.tirx.build(mod, target=target)
    lib.export_library(out)
    print("built", out)


def run(libs: list[str]) -> None:
    import numpy as np
    import torch

    from device_split import rotated_kernel_us  # beside this script
    from gpu_decode_8b import copy_bandwidth as copy_bw

    from vtool.runtime.artifact.tvm_runtime import cuda_runtime, ffi, global_func

    cuda_runtime()
    tvm_ffi = ffi()
    view = global_func("runtime.TVMTensorCreateView")
    dev = torch.device("cuda")

    def tv(t, dtype: str):  # noqa: ANN001, ANN202
        raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        return view(tvm_ffi.from_dlpack(raw), tvm_ffi.Shape(list(t.shape)), dtype, 0)

    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    data = {}
    for name, (n, k) in SHAPES.items():
        nbytes = n * k + 4 * n
        sets = []
        for _ in range(max(2, int(np.ceil(300e6 / nbytes)))):  # > 4x L2 (60 MB) in turn
            w = (torch.randn((n, k), device=dev, generator=gen) * 64).to(torch.float8_e4m3fn)
            s = torch.rand((n,), device=dev, generator=gen) * 0.01 + 0.001
            sets.append((w, s, tv(w, "float8_e4m3fn"), tv(s, "float32")))
        x = torch.randn((1, 1, k), device=dev, generator=gen).bfloat16()
        w, s = sets[0][0], sets[0][1]
        ref = (x.float().reshape(1, k) @ w.float().T) * s
        data[name] = (sets, x, tv(x, "bfloat16"), ref.reshape(-1).cpu(), nbytes)
    bw = copy_bw()
    print(json.dumps({"device": torch.cuda.get_device_name(), "copy_gb_s": round(bw, 1)}))
    for rnd in range(2):
        for lib in libs:
            mod = tvm_ffi.load_module(lib)
            for name, (sets, x, xt, ref, nbytes) in data.items():
                f = mod[name]
                yt = torch.empty((1, 1, SHAPES[name][0]), dtype=torch.bfloat16, device=dev)
                y = tv(yt, "bfloat16")
                f(xt, sets[0][2], sets[0][3], y)
                torch.cuda.synchronize()
                err = float((yt.float().reshape(-1).cpu() - ref).abs().max() / ref.abs().max())
                us, n = rotated_kernel_us(lambda i: f(xt, sets[i][2], sets[i][3], y), len(sets), name)  # noqa: B023
                print(json.dumps({"round": rnd, "lib": os.path.basename(lib), "kernel": name, "us": round(us, 2),
                                  "gb_s": round(nbytes / us / 1e3, 1), "pct_copy": round(100 * nbytes / us / 1e3 / bw, 1),
                                  "n": n, "rel_err": err}), flush=True)
    print(json.dumps({"copy_gb_s_end": round(copy_bw(), 1)}))


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["build"] and len(args) == 2:
        from device_split import rerun_with_driver_stub  # beside this script

        rerun_with_driver_stub()
        build(args[1])
    elif args[:1] == ["run"] and len(args) > 1:
        run(args[1:])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
