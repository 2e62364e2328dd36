"""The FP8 GEMM of W8A8 prompts and batches (toolchain/native/cublas_gemm.cc,
`vtool_cublaslt_fp8_gemm_nt`: e4m3 x e4m3 on cuBLASLt, float32 out) on the GPU: its error against
the exact sum of the same e4m3 products, and its time against torch's bf16 matmul and torch's
own FP8 GEMM (torch._scaled_mm) on the same operands, for the 8B shape's matrices.

    python tests/bench/gpu_fp8_gemm.py build OUT.so     # here: the shim linked on its own
    python tests/bench/gpu_fp8_gemm.py run OUT.so       # on the GPU machine: one JSON line a case

The error is the tensor cores' summation (an FP8 product is exact in float32; the hardware
adds them with fewer bits than float32 does): tests/test_gpu_fp8.py bounds W8A8 logits by it.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_split import build_or_run  # noqa: E402

SHAPES = [("qkv", 6144, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
ROWS = (1, 16, 64, 256, 2048)


def build(out: str) -> None:
    from vtool.toolchain.gemm_offload import compile_shim

    subprocess.run(["g++", "-shared", "-o", out, str(compile_shim())], check=True)
    print("built", out)


def _time(fn, reps: int = 20) -> float:  # noqa: ANN001 - a callable
    import torch

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def run(lib_path: str) -> None:
    import torch

    from vtool.runtime.artifact.tvm_runtime import cuda_runtime, ffi, global_func, load_cublas

    cuda_runtime()
    load_cublas()
    tvm_ffi = ffi()
    gemm = tvm_ffi.load_module(lib_path)["vtool_cublaslt_fp8_gemm_nt"]
    view = global_func("runtime.TVMTensorCreateView")

    def tv(t, dtype: str):  # noqa: ANN001, ANN202
        raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        return view(tvm_ffi.from_dlpack(raw), tvm_ffi.Shape(list(t.shape)), dtype, 0)

    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for name, n, k in SHAPES:
        w = (torch.randn(n, k, device="cuda", generator=gen) * 64).to(torch.float8_e4m3fn)
        wb = w.bfloat16()
        for m in ROWS:
            x = (torch.randn(m, k, device="cuda", generator=gen) * 64).to(torch.float8_e4m3fn)
            out = torch.empty(m, n, device="cuda")
            args = (tv(x, "float8_e4m3fn"), tv(w, "float8_e4m3fn"), tv(out, "float32"))
            us = _time(lambda: gemm(*args))
            exact = x.double() @ w.double().T
            err = float((out.double() - exact).abs().max() / exact.abs().max())
            xb = x.bfloat16()
            bf16_us = _time(lambda: xb @ wb.T)
            one = torch.ones((), device="cuda")
            try:
                torch_us = _time(lambda: torch._scaled_mm(x, w.T, scale_a=one, scale_b=one, out_dtype=torch.float32))
            except RuntimeError as e:  # shapes torch's FP8 GEMM refuses (m not a multiple of 16)
                torch_us = f"refused: {str(e).splitlines()[0][:80]}"
            flops = 2 * m * n * k
            print(json.dumps({"shape": name, "m": m, "n": n, "k": k, "vtool_us": round(us, 1),
                              "vtool_tflops": round(flops / us / 1e6, 1), "rel_err": float(f"{err:.2e}"),
                              "torch_bf16_us": round(bf16_us, 1), "torch_scaled_mm_us": torch_us
                              if isinstance(torch_us, str) else round(torch_us, 1)}), flush=True)


if __name__ == "__main__":
    build_or_run(__doc__, build, run)
