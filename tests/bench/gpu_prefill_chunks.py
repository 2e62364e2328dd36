"""A 2048-token prompt through `vtool run`'s Generator at several prefill chunk sizes (the
runtime's GPU_PREFILL_CHUNK set for each), best of 3, on a GPU library and its checkpoint.

    python tests/bench/gpu_prefill_chunks.py ARTIFACT CHECKPOINT [--tokens 2048] [--chunks 2048,1024,512]

One JSON line per chunk size: milliseconds for the whole prompt.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", type=Path)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunks", default="2048,1024,512")
    a = ap.parse_args()
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.artifact.tvm_runtime import global_func
    from vtool.runtime.engine import generate
    from vtool.runtime.weights.checkpoint import open_checkpoint

    model = CompiledModel(a.artifact, open_checkpoint(a.checkpoint))
    sync = global_func("runtime.Device_StreamSync")
    ids = list(range(1000, 1000 + a.tokens))
    for chunk in (int(c) for c in a.chunks.split(",")):
        generate.GPU_PREFILL_CHUNK = chunk  # Generator.chunk reads it at each call
        gen = generate.Generator(model, max_model_len=a.tokens + 64)
        gen._fresh_sequence(a.tokens + 16)
        gen.prefill_logits(ids)  # warm
        best = float("inf")
        for _ in range(3):
            gen._fresh_sequence(a.tokens + 16)
            sync(model.device, 0)
            t0 = time.perf_counter()
            gen.prefill_logits(ids)
            sync(model.device, 0)
            best = min(best, time.perf_counter() - t0)
        print(json.dumps({"artifact": a.artifact.name, "chunk": chunk, "prompt": a.tokens, "ms": round(best * 1e3, 2)}),
              flush=True)
        del gen


if __name__ == "__main__":
    main()
