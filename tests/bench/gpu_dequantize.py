"""Whole-weight dequantization alone on the GPU (what a prompt over weights kept in GGUF
blocks does before its tensor-core matmul): schedules/cuda/dequantize.py against DLight's
Fallback schedule of the same expression, on the Llama-3-8B shapes in bf16. Both kernels
must write the same bits; each is timed with CUDA events, and the whole 8B forward's
dequantization (32 layers and the LM head) is summed from the per-shape times.

    # here (nvcc and the build-time driver stub)
    python tests/bench/gpu_dequantize.py build OUT.so
    # on the GPU machine (the runtime as for gpu_block_gemv.py)
    python tests/bench/gpu_dequantize.py run OUT.so

Prints one JSON line per format and shape: `same` false when the two kernels' outputs differ
in any bit; times in microseconds and the bytes moved per second.
"""
from __future__ import annotations

import json
import sys

FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
# (name, rows, cols, times per 8B forward): fused q|k|v, o, fused gate|up, down, LM head
SHAPES = (("qkv", 6144, 4096, 32), ("o", 4096, 4096, 32), ("gate_up", 28672, 4096, 32), ("down", 4096, 14336, 32),
          ("lm_head", 128256, 4096, 1))
DTYPE = "bfloat16"


def _kernel(fmt: str, rows: int, cols: int):  # noqa: ANN202 - a tvm PrimFunc
    from tvm import te

    from vtool.models.quantized_linear import dequantize_te
    from vtool.runtime.weights.ggml_blocks import part_dtype, part_shape, parts

    ws = [te.placeholder(part_shape(fmt, p, rows, cols), part_dtype(fmt, p), name=p) for p in parts(fmt)]
    return te.create_prim_func([*ws, dequantize_te(fmt, DTYPE, *ws)])


def build(out: str) -> None:
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    import tvm
    from tvm.s_tir import dlight as dl

    from vtool.schedules.cuda.dequantize import schedule_dequantize
    from vtool.targets import lookup
    from vtool.toolchain import cuda

    spec = lookup("sm_90a")
    target = tvm.target.Target(spec.tvm)
    funcs = {}
    for fmt in FORMATS:
        for name, rows, cols, _ in SHAPES:
            func = _kernel(fmt, rows, cols)
            funcs[f"new_{fmt}_{name}"] = schedule_dequantize(func)
            funcs[f"old_{fmt}_{name}"] = func
    mod = tvm.IRModule({k: v.with_attr("global_symbol", k) for k, v in funcs.items()})
    with target:
        mod = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(mod)  # the old kernels; the new ones arrive scheduled
    with cuda.fatbin_callback(spec.archs, spec.ptx, {}), target:
        lib = tvm.tirx.build(mod, target=target)
    lib.export_library(out)
    print("built", out)


def run(lib_path: str) -> None:
    import torch

    from vtool.runtime.artifact.tvm_runtime import cuda_runtime, ffi
    from vtool.runtime.weights.ggml_blocks import part_dtype, part_shape, parts

    cuda_runtime()
    tvm_ffi = ffi()
    mod = tvm_ffi.load_module(lib_path)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    totals: dict[tuple[str, str], float] = {}
    for fmt in FORMATS:
        for name, rows, cols, times in SHAPES:
            args = []
            for p in parts(fmt):
                shape, dtype = part_shape(fmt, p, rows, cols), part_dtype(fmt, p)
                if dtype == "float16":  # block scales: small and finite, as real files hold
                    args.append((torch.randn(shape, device=dev, generator=gen) * 0.01).half())
                elif dtype == "int8":  # Q8_0's quants
                    args.append(torch.randint(-128, 128, shape, device=dev, generator=gen, dtype=torch.int8))
                else:
                    args.append(torch.randint(0, 256, shape, device=dev, generator=gen, dtype=torch.uint8))
            read = sum(a.numel() * a.element_size() for a in args)
            outs = {}
            row = {"format": fmt, "shape": name, "rows": rows, "cols": cols}
            for kind in ("old", "new"):
                out = torch.empty((rows, cols), dtype=torch.bfloat16, device=dev)
                kernel = mod[f"{kind}_{fmt}_{name}"]
                call_args = [tvm_ffi.from_dlpack(t) for t in (*args, out)]
                for _ in range(3):
                    kernel(*call_args)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                reps = 20
                start.record()
                for _ in range(reps):
                    kernel(*call_args)
                end.record()
                torch.cuda.synchronize()
                us = start.elapsed_time(end) * 1e3 / reps
                outs[kind] = out
                row[f"{kind}_us"] = round(us, 1)
                row[f"{kind}_tb_s"] = round((read + out.numel() * 2) / us / 1e6, 2)
                totals[(fmt, kind)] = totals.get((fmt, kind), 0.0) + us * times
            row["same"] = bool(torch.equal(outs["old"].view(torch.int16), outs["new"].view(torch.int16)))
            row["speedup"] = round(row["old_us"] / row["new_us"], 2)
            print(json.dumps(row), flush=True)
    for fmt in FORMATS:
        print(json.dumps({"format": fmt, "forward_8b_ms_old": round(totals[(fmt, "old")] / 1e3, 2),
                          "forward_8b_ms_new": round(totals[(fmt, "new")] / 1e3, 2)}), flush=True)


def main() -> None:
    from device_split import build_or_run  # beside this script

    build_or_run(__doc__, build, run)


if __name__ == "__main__":
    main()
