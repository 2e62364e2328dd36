"""The block GEMV (schedules/cuda/quantized_gemv.py) alone, at batch 1, on the Llama-3-8B
shapes: a library of four kernels built where the compiler is, timed on the GPU machine (no
compiler there) with torch.profiler (CUPTI device times), the weights rotated over more than
4x the H200's L2, and the copy bandwidth measured in the same process. Ten seconds of GPU
time where the whole decode step takes a minute and more.

    # here (nvcc and the build-time driver stub; THREADS / TARGET_WARPS: the module's constants)
    python tests/bench/gpu_block_gemv.py build OUT.so [--fmt Q4_1] [--set THREADS=256 ...]
    # on the GPU machine (the runtime as for gpu_decode_8b.py), libraries timed in turn, twice
    python tests/bench/gpu_block_gemv.py run A.so B.so ...

Each kernel reads x [1, 1, K] bf16 and writes y [1, 1, N] bf16 (the cast epilogue of the
model's matmuls). rel_err compares each library's output with the first one's on the same
random blocks.

A library built by `python tests/test_gpu_block_mma.py prebuild OUT.so` (the native kernels of
toolchain/native/block_mma.cu) is timed the same way through its `vtool_block_mma_q4_1_cast`
function, which takes one row of x through its SIMT GEMV; for gate/up also through
`..._silu_mul` (the gated MLP finished in the same launch, where the generated GEMV needs a
kernel more), reported as `gateup_silu`.
"""
from __future__ import annotations

import json
import os
import sys

SHAPES = {"gateup": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096)}


def build(out: str, fmt: str, settings: dict[str, int]) -> None:
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    import tvm
    from tvm import te

    from vtool.models.quantized_linear import matmul_te
    from vtool.runtime.weights.ggml_blocks import part_dtype, part_shape, parts
    from vtool.schedules.cuda import quantized_gemv as qg
    from vtool.targets import lookup
    from vtool.toolchain import cuda

    for name, value in settings.items():
        if not hasattr(qg, name):
            raise SystemExit(f"quantized_gemv has no {name}")
        setattr(qg, name, value)
    funcs = {}
    for name, (n, k) in SHAPES.items():
        x = te.placeholder((1, 1, k), "bfloat16", name="x")
        ws = [te.placeholder(part_shape(fmt, p, n, k), part_dtype(fmt, p), name=f"w_{p}") for p in parts(fmt)]
        y = matmul_te(fmt, x, *ws)
        c = te.compute(y.shape, lambda *i: y(*i).astype("bfloat16"), name="T_cast")
        func = te.create_prim_func([x, *ws, c])
        funcs[name] = func.with_body(qg.gemv(func, 1).body).with_attr("global_symbol", name)
    spec = lookup("sm_90a")
    target = tvm.target.Target(spec.tvm)
    with cuda.fatbin_callback(spec.archs, spec.ptx, {}), target:
        lib = tvm.tirx.build(tvm.IRModule(funcs), target=target)
    lib.export_library(out)
    print("built", out)


def run(libs: list[str], fmt: str) -> None:
    import numpy as np
    import torch

    from device_split import rotated_kernel_us  # beside this script

    from vtool.runtime.artifact.tvm_runtime import cuda_runtime, ffi

    cuda_runtime()
    tvm_ffi = ffi()
    dev = torch.device("cuda")

    def copy_bw() -> float:
        a = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        return 2 * a.numel() / (start.elapsed_time(end) / 10 / 1e3) / 1e9

    if fmt != "Q4_1":
        raise SystemExit("run: Q4_1 blocks only (qweight, scale, min)")
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    data = {}
    for name, (n, k) in SHAPES.items():
        tiles, nb = n // 4, k // 32
        nbytes = tiles * nb * 4 * (16 + 4)  # the quants, a float16 scale and min per block
        sets = []
        for _ in range(max(2, int(np.ceil(300e6 / nbytes)))):  # > 4x L2 (60 MB) in turn
            qw = torch.randint(0, 256, (tiles, nb, 4, 16), dtype=torch.uint8, device=dev, generator=gen)
            sc = (torch.rand((tiles, nb, 4), device=dev, generator=gen) * 0.01).half()
            mn = (torch.rand((tiles, nb, 4), device=dev, generator=gen) * -0.05).half()
            sets.append(tuple(tvm_ffi.from_dlpack(t) for t in (qw, sc, mn)))
        x = torch.randn((1, 1, k), device=dev, generator=gen).bfloat16()
        data[name] = (sets, tvm_ffi.from_dlpack(x), nbytes)
    bw = copy_bw()
    print(json.dumps({"copy_gb_s": round(bw, 1)}))
    ref = {}
    for rnd in range(2):
        for lib in libs:
            mod = tvm_ffi.load_module(lib)
            native = _native_functions(mod)
            cases = [(name, name) for name in data] + ([("gateup_silu", "gateup")] if native else [])
            for case, name in cases:
                sets, x, nbytes = data[name]
                rows = SHAPES[name][0] // (2 if case == "gateup_silu" else 1)
                yt = torch.empty((1, 1, rows), dtype=torch.bfloat16, device=dev)
                y = tvm_ffi.from_dlpack(yt)
                if native:  # partial [splits, 1, 1, N]: unused by one row, but the signature's
                    part = tvm_ffi.from_dlpack(torch.empty((1, 1, 1, SHAPES[name][0]), device=dev))
                    fn = native["_silu_mul" if case == "gateup_silu" else "_cast"]
                    f = lambda x, *w, fn=fn, part=part: fn(x, *w[:-1], part, w[-1])  # noqa: E731
                    kernel_name = "BlockGemv"
                else:
                    f, kernel_name = mod[name], name
                f(x, *sets[0], y)
                torch.cuda.synchronize()
                out = yt.float().cpu()
                ref.setdefault(case, out)
                err = float((out - ref[case]).abs().max() / ref[case].abs().max())
                us, n = rotated_kernel_us(lambda i: f(x, *sets[i], y), len(sets), kernel_name)  # noqa: B023
                print(json.dumps({"round": rnd, "lib": os.path.basename(lib), "kernel": case, "us": round(us, 2),
                                  "gb_s": round(nbytes / us / 1e3, 1), "pct_copy": round(100 * nbytes / us / 1e3 / bw, 1),
                                  "n": n, "rel_err": err}), flush=True)
    print(json.dumps({"copy_gb_s_end": round(copy_bw(), 1)}))


def _native_functions(mod) -> dict:  # noqa: ANN001 - a TVM module
    """The Q4_1 functions of a native block-kernel library by epilogue suffix, or {} for a
    library of generated GEMVs."""
    try:
        return {e: mod["vtool_block_mma_q4_1" + e] for e in ("_cast", "_silu_mul")}
    except Exception:  # noqa: BLE001 - TVM raises its own error for a missing function
        return {}


def main() -> None:
    args = sys.argv[1:]
    fmt = "Q4_1"
    if "--fmt" in args:
        i = args.index("--fmt")
        fmt = args[i + 1]
        del args[i:i + 2]
    settings = {}
    while "--set" in args:
        i = args.index("--set")
        name, value = args[i + 1].split("=")
        settings[name] = int(value)
        del args[i:i + 2]
    if args[:1] == ["build"] and len(args) == 2:
        from device_split import rerun_with_driver_stub  # beside this script

        rerun_with_driver_stub()
        build(args[1], fmt, settings)
    elif args[:1] == ["run"] and len(args) > 1:
        run(args[1:], fmt)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
