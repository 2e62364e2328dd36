"""GGUF quantized blocks, repacked at load into the arrays vtool's quantized kernels read.

A compiled quantized weight [rows, cols] is two or three parameters ("parts"). Rows are
grouped in tiles of TILE_ROWS = 4, block-major inside a tile ([tile, block, row in tile,
...]), so a kernel computing one tile of output rows reads each part sequentially:

  format  part    dtype    shape                      holds, per (tile, block, row)
  Q8_0    qweight int8     [rows/4, cols/32, 4, 32]   the block's 32 signed quants
          scale   float16  [rows/4, cols/32, 4]       d;  w = d * q
  Q4_0    qweight uint8    [rows/4, cols/32, 4, 16]   GGUF's 16 bytes as they are: byte j =
                                                      element j (low nibble) | element j+16 (high)
          scale   float16  [rows/4, cols/32, 4]       d;  w = d * (q - 8)
  Q4_1    qweight uint8    [rows/4, cols/32, 4, 16]   as Q4_0
          scale   float16  [rows/4, cols/32, 4]       d;  w = d * q + m
          min     float16  [rows/4, cols/32, 4]       m

GGUF's nibble order is kept, so one 16-byte load feeds two 16-lane vectors (low nibbles,
then high nibbles). Scales stay GGUF's float16 (the kernels widen them, exactly, to float32
once per block and row), so the bytes are exactly the file's: decode reads every weight
byte once per token, and fewer bytes is faster. No float copy of a weight is ever made.

Nothing here imports TVM: the runtime binds weights with it, following the manifest.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from vtool import VtoolError

BLOCK = 32  # weights per block in every format here
TILE_ROWS = 4


class QuantFormatError(VtoolError):
    """A quantized tensor vtool cannot repack (unknown format, wrong byte count)."""


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    name: str  # GGML type name: "Q8_0", "Q4_0", "Q4_1"
    block_bytes: int  # bytes per 32-weight block in the GGUF file
    parts: tuple[str, ...]  # compiled parameters, in this order
    qweight_dtype: str  # "int8" | "uint8"
    qweight_per_block: int  # qweight bytes per block (32 for int8, 16 for packed nibbles)
    header: int  # bytes of float16 d (and m) before the quants


FORMATS: dict[str, BlockFormat] = {
    "Q8_0": BlockFormat("Q8_0", 34, ("qweight", "scale"), "int8", 32, 2),
    "Q4_0": BlockFormat("Q4_0", 18, ("qweight", "scale"), "uint8", 16, 2),
    "Q4_1": BlockFormat("Q4_1", 20, ("qweight", "scale", "min"), "uint8", 16, 4),
}


def block_format(name: str) -> BlockFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise QuantFormatError(f"no quantized kernel for GGML type {name}; vtool keeps {', '.join(FORMATS)}") from None


def _tiled_blocks(fmt: BlockFormat, raw: np.ndarray, cols: int) -> np.ndarray:
    """raw bytes [rows, row_bytes] -> [rows/4, cols/32, 4, block_bytes], checking sizes."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2:
        raise QuantFormatError(f"{fmt.name} data must be uint8 [rows, bytes], got {raw.dtype} {list(raw.shape)}")
    rows = raw.shape[0]
    if cols % BLOCK or rows % TILE_ROWS:
        raise QuantFormatError(f"{fmt.name} weight [{rows}, {cols}]: kept blocks need rows divisible by "
                               f"{TILE_ROWS} and columns by {BLOCK}")
    want = cols // BLOCK * fmt.block_bytes
    if raw.shape[1] != want:
        raise QuantFormatError(f"{fmt.name} data of shape {list(raw.shape)}: expected [rows, {want}] bytes "
                               f"for {cols} weights per row")
    blocks = raw.reshape(rows // TILE_ROWS, TILE_ROWS, cols // BLOCK, fmt.block_bytes)
    return np.ascontiguousarray(blocks.transpose(0, 2, 1, 3))


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0])


def repack(format_name: str, raw: np.ndarray, cols: int) -> dict[str, np.ndarray]:
    """GGUF blocks of a [rows, cols] tensor (raw bytes [rows, cols/32 * block_bytes])
    -> the parts the kernels read (see the module docstring)."""
    fmt = block_format(format_name)
    blocks = _tiled_blocks(fmt, raw, cols)
    parts = {"scale": _f16(blocks, 0), "qweight": np.ascontiguousarray(blocks[..., fmt.header:])}
    if fmt.name == "Q8_0":
        parts["qweight"] = parts["qweight"].view(np.int8)
    if fmt.name == "Q4_1":
        parts["min"] = _f16(blocks, 2)
    return {p: parts[p] for p in fmt.parts}


def dequantize(format_name: str, parts: dict[str, np.ndarray]) -> np.ndarray:
    """float32 [rows, cols] from repacked parts: what the kernels compute, in numpy
    (tests hold it to gguf.quants.dequantize)."""
    fmt = block_format(format_name)
    q, d = parts["qweight"], parts["scale"][..., None].astype(np.float32)
    if fmt.name == "Q8_0":
        w = q.astype(np.float32) * d
    else:
        nib = np.concatenate([q & 15, q >> 4], axis=-1).astype(np.float32)
        w = (nib - 8) * d if fmt.name == "Q4_0" else nib * d + parts["min"][..., None].astype(np.float32)
    tiles, nblocks, rows_in_tile, _ = w.shape
    return w.transpose(0, 2, 1, 3).reshape(tiles * rows_in_tile, nblocks * BLOCK)
