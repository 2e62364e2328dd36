"""The quantized weight formats vtool has kernels for, as compiled parameters.

A quantized [rows, cols] weight is compiled as two or three parameters ("parts"):
`qweight` (the quants), `scale` (float16, one per 32-weight block) and, for Q4_1, `min`.
Rows are grouped in tiles of TILE_ROWS, block-major inside a tile, so a kernel working
on one tile of output rows reads each part as one sequential stream:

  qweight [rows/4, cols/32, 4, 32] int8 (Q8_0) or [rows/4, cols/32, 4, 16] uint8 (Q4_*)
  scale, min [rows/4, cols/32, 4] float16 (as GGUF stores them; kernels widen to float32)

The runtime repacks GGUF blocks into exactly these arrays (vtool.runtime.quant_blocks,
whose docstring gives the byte layout); the binder checks every part's shape and dtype
against the manifest, and a test holds the two tables equal.

Pure Python (no TVM): the build driver imports it before deciding to compile anything.
"""
from __future__ import annotations

BLOCK = 32  # weights per scale
TILE_ROWS = 4  # rows per tile; a weight kept in blocks needs rows % TILE_ROWS == 0

# GGML type -> (parts in parameter order, qweight dtype, qweight bytes per block)
KERNEL_FORMATS: dict[str, tuple[tuple[str, ...], str, int]] = {
    "Q8_0": (("qweight", "scale"), "int8", 32),
    "Q4_0": (("qweight", "scale"), "uint8", 16),
    "Q4_1": (("qweight", "scale", "min"), "uint8", 16),
}
QUANT_PARTS = ("qweight", "scale", "min")


def parts(fmt: str) -> tuple[str, ...]:
    return KERNEL_FORMATS[fmt][0]


def part_shape(fmt: str, part: str, rows: int, cols: int) -> tuple[int, ...]:
    tiled = (rows // TILE_ROWS, cols // BLOCK, TILE_ROWS)
    return (*tiled, KERNEL_FORMATS[fmt][2]) if part == "qweight" else tiled


def part_dtype(fmt: str, part: str) -> str:
    return KERNEL_FORMATS[fmt][1] if part == "qweight" else "float16"  # GGUF's own scales


def keepable(fmt: str, rows: int, cols: int) -> bool:
    """Whether a [rows, cols] weight stored as `fmt` can stay in blocks."""
    return fmt in KERNEL_FORMATS and rows % TILE_ROWS == 0 and cols % BLOCK == 0
