"""Would a tensor-core matmul that dequantizes GGUF blocks as it loads them beat the prompt
path (dequantize every weight, then cuBLAS)? DLight's MatmulTensorization with vtool's bf16
WMMA intrinsics (schedules/cuda/bf16_tensorcore.py) over a Q4_1 dequantization prologue,
against torch's cuBLAS matmul on the same weight dequantized to bf16, on the 8B shapes at
n rows. (The nibble shift is computed in int32: as models/quantized_linear.py writes it, in
uint8, TVM's CUDA codegen fails on the vectorized shared-memory load.)

    python tests/bench/gpu_fused_dequant_matmul.py build OUT.so   # here
    python tests/bench/gpu_fused_dequant_matmul.py run OUT.so     # on the GPU machine

One JSON line per shape and row count: microseconds of each (CUDA events, 20 calls) and the
fused kernel's largest error relative to the float32 product of the same bf16 weights.
"""
from __future__ import annotations

import json
import sys

SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
FMT = "Q4_1"

def func(N, K):
    from tvm import te, tirx
    from vtool.runtime.weights.ggml_blocks import parts, part_shape, part_dtype
    qw, sc, mn = [te.placeholder(part_shape(FMT, p, N, K), part_dtype(FMT, p), name=p) for p in parts(FMT)]
    n = tirx.Var("n", "int32")
    x = te.placeholder((1, n, K), "bfloat16", name="x")
    def wexpr(r, c):
        t, rr, b, j = r // 4, r % 4, c // 32, c % 16
        q = tirx.bitwise_and(tirx.shift_right(qw[t, b, rr, j].astype("int32"), (c % 32 // 16) * 4), 15)
        return (q.astype("float32") * sc[t, b, rr].astype("float32") + mn[t, b, rr].astype("float32")).astype("bfloat16")
    w = te.compute((N, K), wexpr, name="vtool_dequantize")
    k = te.reduce_axis((0, K), name="k")
    y = te.compute((1, n, N), lambda b, i, j: te.sum(x[b, i, k].astype("float32") * w[j, k].astype("float32"), axis=k), name="matmul")
    return te.create_prim_func([x, qw, sc, mn, y])

def build(out):
    sys.modules.setdefault("torch", None)
    import tvm
    from vtool.schedules.cuda.bf16_tensorcore import schedule_bf16_matmul
    from vtool.targets import lookup
    from vtool.toolchain import cuda
    spec = lookup("sm_90a"); target = tvm.target.Target(spec.tvm)
    funcs = {}
    with target:
        for name, N, K in SHAPES:
            funcs[name] = schedule_bf16_matmul(func(N, K), target).mod["main"].with_attr("global_symbol", name)
    with cuda.fatbin_callback(spec.archs, spec.ptx, {}), target:
        lib = tvm.tirx.build(tvm.IRModule(funcs), target=target)
    lib.export_library(out); print("built", out)

def run(path):
    import torch
    from vtool.runtime.artifact.tvm_runtime import cuda_runtime, ffi
    cuda_runtime(); f = ffi(); mod = f.load_module(path)
    dev = "cuda"; g = torch.Generator(device=dev); g.manual_seed(0)
    for name, N, K in SHAPES:
        qw = torch.randint(0, 256, (N // 4, K // 32, 4, 16), device=dev, generator=g, dtype=torch.uint8)
        sc = (torch.rand((N // 4, K // 32, 4), device=dev, generator=g) * 0.01).half()
        mn = (-torch.rand((N // 4, K // 32, 4), device=dev, generator=g) * 0.08).half()
        lo, hi = (qw & 15).float(), (qw >> 4).float()
        q = torch.cat([lo, hi], dim=-1)  # [t, b, 4, 32]
        W = (q * sc.float()[..., None] + mn.float()[..., None]).to(torch.bfloat16)  # [t, b, 4, 32]
        W = W.permute(0, 2, 1, 3).reshape(N, K)
        for n in (8, 16, 32, 64, 128, 512, 2048):
            x = (torch.randn((1, n, K), device=dev, generator=g)).to(torch.bfloat16)
            y = torch.empty((1, n, N), device=dev, dtype=torch.float32)
            args = [f.from_dlpack(t) for t in (x, qw, sc, mn, y)]
            kern = mod[name]
            for _ in range(3): kern(*args)
            ref = (x.float()[0] @ W.float().T)
            err = float((y[0] - ref).abs().max() / ref.abs().max())
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20): kern(*args)
            e.record(); torch.cuda.synchronize(); fused = s.elapsed_time(e) * 1e3 / 20
            for _ in range(3): torch.matmul(x[0], W.T)
            s.record()
            for _ in range(20): torch.matmul(x[0], W.T)
            e.record(); torch.cuda.synchronize(); cub = s.elapsed_time(e) * 1e3 / 20
            print(json.dumps({"shape": name, "n": n, "fused_us": round(fused, 1), "cublas_bf16_us": round(cub, 1), "rel_err": err}), flush=True)

if __name__ == "__main__":
    from device_split import build_or_run  # beside this script

    build_or_run(__doc__, build, run)
