"""A decode step of n sequences over weights kept in GGUF blocks on the GPU, two ways:
batch_decode (the block GEMV up to 32 rows, DLight's matmul past it; and its CUDA graphs)
against batch_verify (and its CUDA graphs) with one token per sequence, the prompt path
(every weight dequantized, then the dense matmul): where the runtime's threshold
(runtime/engine/block_decode.py GEMV_MAX_ROWS) comes from.

    python tests/bench/gpu_block_rows.py ARTIFACT CHECKPOINT

One JSON line per batch size: milliseconds a step per entry point (20 steps queued back to
back after 4 warm-up steps, sequences starting empty).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

BATCHES = (2, 4, 6, 8, 12, 16, 32, 64, 128)
ENTRIES = ("batch_decode", "batch_decode_captured", "batch_verify", "batch_verify_captured")


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.artifact.tvm_runtime import global_func
    from vtool.runtime.engine.kv_cache import PagedKVCache
    from vtool.runtime.weights.checkpoint import open_checkpoint

    model = CompiledModel(Path(sys.argv[1]), open_checkpoint(Path(sys.argv[2])))
    sync = global_func("runtime.Device_StreamSync")
    view = global_func("runtime.TVMTensorCreateView")
    S = model.ffi.Shape
    for batch in BATCHES:
        row = {"batch": batch}
        for entry in ENTRIES:
            if entry == "batch_verify_captured" and batch > 64:  # past the build's captured token counts
                continue
            kv = PagedKVCache(model, num_blocks=batch * (200 // 16 + 1) + 8, block_size=16,
                              max_num_seqs=max(batch, 64), prefill_chunk=2048)
            for seq in range(batch):
                kv.add(seq)
            ids = model.upload(np.full(batch, 1234, dtype=np.int32))
            flat = model.function("embed")(ids, model.params)
            if entry.startswith("batch_decode"):
                embeds = view(flat, S([batch, 1, model.hidden_size]), model.dtype, 0)
                call = lambda: model.function(entry)(embeds, kv.tvm, model.params)
            else:
                embeds = view(flat, S([1, batch, model.hidden_size]), model.dtype, 0)
                pos = model.upload(np.arange(batch, dtype=np.int32))
                call = lambda: model.function(entry)(embeds, pos, kv.tvm, model.params)

            def one() -> None:
                kv.begin_forward(list(range(batch)), [1] * batch)
                call()
                kv.end_forward()
            for _ in range(4):
                one()
            sync(model.device, 0)
            t = time.perf_counter()
            for _ in range(20):
                one()
            sync(model.device, 0)
            row[entry] = round((time.perf_counter() - t) / 20 * 1e3, 2)
            del kv
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
