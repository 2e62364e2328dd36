"""Paged decode attention alone on the GPU: the grouped kernel (schedules/cuda/
grouped_decode_attention.py) against the per-query-head split-KV kernel it replaces
(schedules/cuda/decode_attention.py), checked against torch in float32 and timed with
torch.profiler (CUPTI device times) over KV pools rotated past the H200's 60 MB of L2.

    # here (nvcc and the build-time driver stub)
    python tests/bench/gpu_decode_attention.py build OUT.so
    # on the GPU machine (the runtime as for gpu_block_gemv.py)
    python tests/bench/gpu_decode_attention.py run OUT.so

Prints one JSON line per check and per timing; a check line's `ok` is false when a kernel's
output or lse is off the float32 reference by more than the dtype allows.
"""
from __future__ import annotations

import json
import math
import sys

PAGE = 16
# (name, kv heads, query heads, head dim, dtype, soft-cap): the checks' shapes; "8b" is timed too
SHAPES = [
    ("8b", 8, 32, 128, "bfloat16", 0.0),
    ("smollm2", 3, 9, 64, "bfloat16", 0.0),
    ("gqa_f32", 2, 4, 64, "float32", 0.0),
    ("mqa_256", 1, 4, 256, "bfloat16", 0.0),
    ("capped_f16", 2, 8, 128, "float16", 50.0),
    ("mha_f32_128", 4, 4, 128, "float32", 0.0),
]


def build(out: str) -> None:
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    import tvm

    from vtool.schedules.cuda.decode_attention import split_kv_decode
    from vtool.schedules.cuda.grouped_decode_attention import grouped_decode
    from vtool.targets import lookup
    from vtool.toolchain import cuda

    funcs = {}
    for name, kv, qo, d, dtype, cap in SHAPES:
        funcs[f"grouped_{name}"] = grouped_decode(kv, qo, d, dtype, PAGE, cap, symbol=f"grouped_{name}")
        funcs[f"perhead_{name}"] = split_kv_decode(kv, qo, d, dtype, PAGE, cap).with_attr(
            "global_symbol", f"perhead_{name}")
    spec = lookup("sm_90a")
    target = tvm.target.Target(spec.tvm)
    with cuda.fatbin_callback(spec.archs, spec.ptx, {}), target:
        lib = tvm.tirx.build(tvm.IRModule(funcs), target=target)
    lib.export_library(out)
    print("built", out)


class Harness:
    """The kernels of a library built by `build`, with random paged KV pools and a float32
    torch reference (on the GPU machine: torch with CUDA and the TVM runtime)."""

    def __init__(self, lib_path: str, seed: int = 0):
        import torch

        from vtool.runtime.artifact.tvm_runtime import cuda_runtime, ffi

        cuda_runtime()
        self.torch, self.ffi = torch, ffi()
        self.dev = torch.device("cuda")
        self.mod = self.ffi.load_module(lib_path)
        self.gen = torch.Generator(device=self.dev)
        self.gen.manual_seed(seed)
        self.dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

    def pool(self, lengths: list[int], kv: int, d: int, dtype: str):
        """Pages for sequences of `lengths` tokens, in shuffled order, and their tables:
        (pages, page_indptr, page_values, last_page_len)."""
        import numpy as np

        torch = self.torch
        counts = [max(1, -(-n // PAGE)) for n in lengths]
        total = sum(counts)
        pages = torch.randn((total, 2, kv, PAGE, d), device=self.dev, generator=self.gen).to(self.dtypes[dtype])
        order = torch.randperm(total, device=self.dev, generator=self.gen).to(torch.int32)
        indptr = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32, device=self.dev)
        last = torch.tensor([n - (c - 1) * PAGE for n, c in zip(lengths, counts)], dtype=torch.int32,
                            device=self.dev)
        return pages, indptr, order, last

    def call(self, kernel: str, q, pages, indptr, values, last, out, lse, sm_scale: float) -> None:
        zeros = self.torch.zeros(q.shape[0], dtype=self.torch.int32, device=self.dev)
        args = [self.ffi.from_dlpack(t) for t in (q, pages, indptr, values, last, zeros, zeros, out, lse)]
        self.mod[kernel](*args, 0, 1.0, 1e4, sm_scale)

    def reference(self, q, pages, indptr, values, last, sm_scale: float, cap: float, group: int):
        """Output and lse (log2 units, as the kernels write it) in float32."""
        torch = self.torch
        outs, lses = [], []
        for i in range(q.shape[0]):
            ids = values[indptr[i]:indptr[i + 1]].long()
            n = int((len(ids) - 1) * PAGE + last[i])
            k = pages[ids, 0].float().permute(0, 2, 1, 3).reshape(-1, pages.shape[2], pages.shape[4])[:n]
            v = pages[ids, 1].float().permute(0, 2, 1, 3).reshape(-1, pages.shape[2], pages.shape[4])[:n]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            s = torch.einsum("hd,nhd->hn", q[i].float(), k) * sm_scale
            if cap:
                s = cap * torch.tanh(s / cap)
            outs.append(torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v))
            lses.append(torch.logsumexp(s, dim=-1) / math.log(2))
        return torch.stack(outs), torch.stack(lses)

    def check(self, kind: str, shape: tuple, lengths: list[int]) -> dict:
        """One kernel (`kind`: grouped or perhead) of a SHAPES row on sequences of `lengths`
        tokens against the reference; `ok` within the dtype's bound."""
        torch = self.torch
        name, kv, qo, d, dtype, cap = shape
        pages, indptr, values, last = self.pool(lengths, kv, d, dtype)
        q = torch.randn((len(lengths), qo, d), device=self.dev, generator=self.gen).to(self.dtypes[dtype])
        sm_scale = 1 / math.sqrt(d)
        ref_o, ref_lse = self.reference(q, pages, indptr, values, last, sm_scale, cap, qo // kv)
        out = torch.empty((len(lengths), qo, d), dtype=self.dtypes[dtype], device=self.dev)
        lse = torch.empty((len(lengths), qo), dtype=torch.float32, device=self.dev)
        self.call(f"{kind}_{name}", q, pages, indptr, values, last, out, lse, sm_scale)
        torch.cuda.synchronize()
        err_o = float((out.float() - ref_o).abs().max())
        err_lse = float((lse - ref_lse).abs().max())
        bound = 2e-5 if dtype == "float32" else 2e-2
        return {"check": name, "kernel": kind, "batch": len(lengths), "err_out": err_o, "err_lse": err_lse,
                "ok": err_o <= bound and err_lse <= 1e-3}


def run(lib_path: str) -> None:
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    h = Harness(lib_path)
    base = [1, 7, 16, 17, 33, 190, 257, 1000, 4111]
    for shape in SHAPES:
        for kind in ("grouped", "perhead"):
            # 9 lengths at once, the longest alone (the most splits), 192 sequences (one split)
            for lengths in (base, base[-1:], [base[i % 9] if i % 9 != 8 else 300 for i in range(192)]):
                print(json.dumps(h.check(kind, shape, lengths)), flush=True)

    # timing: the 8B shape, batches and contexts as served, KV pools rotated past L2
    name, kv, qo, d, dtype, _cap = SHAPES[0]
    sm_scale = 1 / math.sqrt(d)
    for batch, context in ((1, 190), (1, 2048), (8, 190), (32, 190), (64, 190), (64, 1024), (128, 190)):
        kv_bytes = batch * context * 2 * kv * d * 2
        sets = [h.pool([context] * batch, kv, d, dtype) for _ in range(max(2, math.ceil(300e6 / kv_bytes)))]
        q = torch.randn((batch, qo, d), device=h.dev, generator=h.gen).to(h.dtypes[dtype])
        out = torch.empty((batch, qo, d), dtype=h.dtypes[dtype], device=h.dev)
        lse = torch.empty((batch, qo), dtype=torch.float32, device=h.dev)
        row = {"batch": batch, "context": context, "kv_mb": round(kv_bytes / 1e6, 1)}
        for kind in ("perhead", "grouped"):
            kernel = f"{kind}_{name}"
            for pool in sets:
                h.call(kernel, q, *pool, out, lse, sm_scale)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(max(24, 4 * len(sets))):
                    h.call(kernel, q, *sets[i % len(sets)], out, lse, sm_scale)
                torch.cuda.synchronize()
            per_kernel: dict[str, list[float]] = {}  # the partial kernel and the merge, by name
            for e in prof.events():
                if e.device_type.name == "CUDA" and kernel in e.name:
                    per_kernel.setdefault(e.name, []).append(e.device_time)
            us = sum(float(np.median(v)) for v in per_kernel.values())
            row[f"{kind}_us"] = round(us, 2)
            row[f"{kind}_kernels"] = len(per_kernel)
            row[f"{kind}_tb_s"] = round(kv_bytes / us / 1e6, 2)
        row["speedup"] = round(row["perhead_us"] / row["grouped_us"], 2)
        print(json.dumps(row), flush=True)


def main() -> None:
    from device_split import build_or_run  # beside this script (the tests load this module alone)

    build_or_run(__doc__, build, run)


if __name__ == "__main__":
    main()
