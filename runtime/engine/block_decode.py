"""Which decode steps of a GPU model whose weights stay in GGUF blocks run as a prompt does.

Such a library holds two ways through its matmuls: decode rows take the block GEMV, which
dequantizes in registers and reads the blocks once per row group (fast for a few rows, then
growing with every row: on the H200 an 8B-shape Q4_1 step took 2.6 ms at 1 row, 11 ms at 8,
30 ms at 32 and 67 ms at 64 through DLight's matmul past the GEMV's rows); prompt rows
dequantize every weight into a temporary (~6 ms a forward for the 8B shape) and take the
tensor-core matmul, whose cost hardly grows with the rows. So past a few sequences a decode
step is cheaper as `batch_verify` with one token per sequence: the same positions, the
prompt path's matmuls, decode's attention (and its CUDA graphs per token count where the
library has them).

Libraries built since the tensor-core matmul over blocks (manifest `quantized_weights.
batched_decode_mma`, toolchain/native/block_mma.cu) run batch_decode's matmuls over those
formats on the tensor cores: when that covers every kept format, every decode step stays on
batch_decode.

The rows differ only in the matmul's arithmetic: the prompt path rounds each dequantized
weight to the model's dtype (exact in float32), the GEMV keeps it in float32.
"""
from __future__ import annotations

import os
from typing import Any

# Decode steps of more sequences than this take the prompt path (measured on the H200 with
# the 8B shape: tests/bench/gpu_block_rows.py; docs/BENCHMARKS.md).
GEMV_MAX_ROWS = 8
ROWS_ENV = "VTOOL_BLOCK_GEMV_ROWS"  # another threshold (0: every batched decode step; -1: never)


def tensor_core_batches(model: Any) -> bool:
    """Whether `model`'s batch_decode multiplies some of its kept blocks on the tensor cores
    (manifest `quantized_weights.batched_decode_mma`): about 1.6x the block GEMV of `decode` for one
    sequence on the H200, so the runner gives a lone sequence `decode` even where batch_decode is
    captured in CUDA graphs."""
    manifest = getattr(model, "manifest", {})
    return bool((manifest.get("quantized_weights") or {}).get("batched_decode_mma"))


def prompt_path_rows(model: Any) -> int | None:
    """The most sequences a decode step of `model` runs through the block GEMV, or None when
    every decode step does (a CPU library, weights not kept in blocks, no batch_verify, or a
    library whose batch_decode multiplies every kept format on the tensor cores)."""
    manifest = getattr(model, "manifest", {})
    quantized = manifest.get("quantized_weights") or {}
    kept = quantized.get("kept")
    if (not kept or manifest.get("target", {}).get("family") != "cuda"
            or "batch_verify" not in manifest.get("entry_points", ())):
        return None
    raw = os.environ.get(ROWS_ENV, "").strip()
    if not raw:
        # batch_decode over blocks on the tensor cores (toolchain/native/block_mma.cu): a step's
        # cost hardly grows with its sequences, and it reads the blocks, not a bf16 temporary
        return None if set(kept) <= set(quantized.get("batched_decode_mma", ())) else GEMV_MAX_ROWS
    try:
        rows = int(raw)
    except ValueError:
        raise ValueError(f"{ROWS_ENV}={raw!r} is not an integer (rows; -1: never take the prompt path)") from None
    return None if rows < 0 else rows
