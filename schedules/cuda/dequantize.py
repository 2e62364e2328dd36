"""CUDA schedule for whole-weight dequantization (models/quantized_linear.py's
`vtool_dequantize` block): a prompt over a weight kept in GGUF blocks dequantizes it into a
temporary of the compute dtype and takes the tensor-core matmul, so every prompt forward
reads the model's blocks and writes its weights as floats once.

DLight's Fallback gave each thread one weight: a byte load, two scale loads and a 2-byte
store per weight, ~0.8 TB/s for the 8B shape (~26 ms a forward on the H200). Here a thread
writes 8 consecutive weights of one row (bf16; 4 in float32) as one 16-byte store, reading
their quants in one 8-byte load; threads go through the weight in its block order: a tile's
TILE_ROWS rows of one 32-weight block lie side by side, so a warp reads contiguous block bytes
and writes 64-byte runs of each of the tile's rows (3-3.9 TB/s there, ~6 ms a forward).

The 8 weights are computed one by one into registers, then stored together: computed as a
vector, TVM's CUDA codegen wrote an invalid broadcast of the 4-bit formats' uint8 shift
(`make_uint2` of 8 bytes) and has no type for the IQ4 level tables' boolean vectors.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from vtool.runtime.weights.ggml_blocks import BLOCK as BLOCK_COLS  # weights per block of the 32-weight formats
from vtool.runtime.weights.ggml_blocks import TILE_ROWS  # rows whose blocks lie side by side
from vtool.schedules.cuda.quantized_gemv import find_block

DEQUANT_WHOLE_BLOCK = "vtool_dequantize"  # models/quantized_linear.py's name (schedules/ does not import models/)
VECTOR_BYTES = 16  # a thread writes its weights in one 16-byte store: 8 bf16 / f16, 4 f32
THREADS = 256


def _cols_per_group(qweight: tirx.Buffer, cols: int) -> int | None:
    groups = qweight.shape[1] if len(qweight.shape) == 4 else None
    return cols // int(groups) if isinstance(groups, (int, tirx.IntImm)) else None


def schedule_dequantize(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """`func` scheduled when it is a lone whole-weight dequantization of static shape, else
    None (left to the other rules)."""
    if func.attrs is not None and func.attrs.get("tirx.is_scheduled", False):
        return None
    sch = s_tir.Schedule(func)
    block = find_block(sch, DEQUANT_WHOLE_BLOCK)
    if block is None or len(sch.get_child_blocks(sch.get_sblock("root"))) != 1:
        return None
    out = sch.get(block).writes[0].source
    rows, cols = (int(d) if isinstance(d, (int, tirx.IntImm)) else None for d in out.shape)
    lanes = VECTOR_BYTES // tvm.runtime.DataType(str(out.dtype)).itemsize  # 8 bf16 / f16, 4 f32
    if rows is None or cols is None or rows % TILE_ROWS or cols % BLOCK_COLS:
        return None
    compute = block
    block = sch.cache_write(compute, 0, "local")  # the copy to the output, laid out below
    r, col = sch.get_loops(block)
    tile, row = sch.split(r, [None, TILE_ROWS])
    group, half, part, lane = sch.split(col, [None, 2, BLOCK_COLS // 2 // lanes, lanes])
    sch.reorder(tile, group, row, half, part, lane)
    fused = sch.fuse(tile, group, row, half, part)
    bx, tx = sch.split(fused, [None, THREADS])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(lane)
    sch.compute_at(compute, tx)
    sch.unroll(sch.get_loops(compute)[-1])
    # the thread's quant bytes in one load (8 bytes: 4-bit quants and Q8_0's), where a block
    # of 32 weights holds them ([tiles, blocks, TILE_ROWS, bytes]; Q2_K's and Q3_K's 2-bit
    # quants keep 64 weights to a group: read byte by byte). The parameters are named after
    # the model's weights (`..._qweight1`).
    quant_reads = [i for i, region in enumerate(sch.get(compute).reads) if "qweight" in region.source.name]
    if len(quant_reads) == 1 and _cols_per_group(sch.get(compute).reads[quant_reads[0]].source, cols) == BLOCK_COLS:
        quants = sch.cache_read(compute, quant_reads[0], "local")
        sch.compute_at(quants, tx)
        inner = sch.get_loops(quants)[2:]
        sch.vectorize(inner[0] if len(inner) == 1 else sch.fuse(*inner))
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
