"""The quantized weight formats vtool has kernels for, as compiled parameters.

A quantized [rows, cols] weight is compiled as two to five parameters ("parts"). Rows are
grouped in tiles of TILE_ROWS, block-major inside a tile, so a kernel working on one tile
of output rows reads each part as one sequential stream. Every part is
[rows/4, cols/group, 4] (one value per `group` weights of a row) or, for the quants,
[rows/4, cols/group, 4, bytes]:

  Q8_0  qweight  [rows/4, cols/32, 4, 32] int8     scale [rows/4, cols/32, 4] float16
  Q4_0  qweight  [rows/4, cols/32, 4, 16] uint8    scale as Q8_0
  Q4_1  as Q4_0, and min [rows/4, cols/32, 4] float16
  Q4_K  qweight as Q4_0; scale, min [rows/4, cols/256, 4] float16 (the super-block's d, dmin);
        sub_scale, sub_min [rows/4, cols/32, 4] uint8 (the 6-bit scale and min of each 32)
  Q6_K  qweight as Q4_0 (the low 4 bits); qhigh [rows/4, cols/64, 4, 16] uint8 (the high 2
        bits); sub_scale [rows/4, cols/16, 4] int8; scale [rows/4, cols/256, 4] float16 (d)

The runtime repacks GGUF blocks into exactly these arrays (vtool.runtime.weights.quant_blocks,
whose docstring gives the byte layout); the binder checks every part's shape and dtype
against the manifest, and a test holds the two tables equal.

Pure Python (no TVM): the build driver imports it before deciding to compile anything.
"""
from __future__ import annotations

BLOCK = 32  # weights per qweight block (and per scale in Q8_0/Q4_0/Q4_1)
SUPER_BLOCK = 256  # weights per GGUF block of the K-quants
TILE_ROWS = 4  # rows per tile; a weight kept in blocks needs rows % TILE_ROWS == 0

# GGML type -> (parts in parameter order, qweight dtype, qweight bytes per 32-weight block)
KERNEL_FORMATS: dict[str, tuple[tuple[str, ...], str, int]] = {
    "Q8_0": (("qweight", "scale"), "int8", 32),
    "Q4_0": (("qweight", "scale"), "uint8", 16),
    "Q4_1": (("qweight", "scale", "min"), "uint8", 16),
    "Q4_K": (("qweight", "scale", "min", "sub_scale", "sub_min"), "uint8", 16),
    "Q6_K": (("qweight", "qhigh", "scale", "sub_scale"), "uint8", 16),
}
QUANT_PARTS = ("qweight", "scale", "min", "qhigh", "sub_scale", "sub_min")

# Parts other than qweight whose layout is not "float16, one per 32 weights":
# (format, part) -> (dtype, weights per entry along a row, trailing bytes or 0 for none)
_OTHER_PARTS: dict[tuple[str, str], tuple[str, int, int]] = {
    ("Q4_K", "scale"): ("float16", SUPER_BLOCK, 0),
    ("Q4_K", "min"): ("float16", SUPER_BLOCK, 0),
    ("Q4_K", "sub_scale"): ("uint8", BLOCK, 0),
    ("Q4_K", "sub_min"): ("uint8", BLOCK, 0),
    ("Q6_K", "qhigh"): ("uint8", 64, 16),
    ("Q6_K", "sub_scale"): ("int8", 16, 0),
    ("Q6_K", "scale"): ("float16", SUPER_BLOCK, 0),
}


def parts(fmt: str) -> tuple[str, ...]:
    return KERNEL_FORMATS[fmt][0]


def block_cols(fmt: str) -> int:
    """Weights per GGUF block of `fmt`: a kept weight's columns are a multiple of it."""
    return SUPER_BLOCK if fmt.endswith("_K") else BLOCK


def _layout(fmt: str, part: str) -> tuple[str, int, int]:
    if part not in parts(fmt):
        raise KeyError(f"{fmt} has no part {part!r}")
    if part == "qweight":
        return KERNEL_FORMATS[fmt][1], BLOCK, KERNEL_FORMATS[fmt][2]
    return _OTHER_PARTS.get((fmt, part), ("float16", BLOCK, 0))  # GGUF's own scales


def part_shape(fmt: str, part: str, rows: int, cols: int) -> tuple[int, ...]:
    _, group, inner = _layout(fmt, part)
    tiled = (rows // TILE_ROWS, cols // group, TILE_ROWS)
    return (*tiled, inner) if inner else tiled


def part_dtype(fmt: str, part: str) -> str:
    return _layout(fmt, part)[0]


def keepable(fmt: str, rows: int, cols: int) -> bool:
    """Whether a [rows, cols] weight stored as `fmt` can stay in blocks."""
    return fmt in KERNEL_FORMATS and rows % TILE_ROWS == 0 and cols % block_cols(fmt) == 0


# The formats with Q8_0-activation integer-dot kernels (models/int8_gemv.py).
INT8_FORMATS = ("Q8_0", "Q4_0", "Q4_1")


def int8_isa(mcpu: str, mattr: list[str]) -> str | None:
    """The integer-dot ISA (models/int8_gemv.py) code for an x86 `mcpu` (LLVM's name) with
    `mattr` may use: "avx512vnni", "avx2", or None (the float kernels)."""
    vnni = {"cascadelake", "cooperlake", "icelake-server", "icelake-client", "tigerlake", "sapphirerapids",
            "emeraldrapids", "graniterapids", "znver4", "znver5"}
    avx2 = {"haswell", "broadwell", "skylake", "skylake-avx512", "znver1", "znver2", "znver3", "alderlake",
            "raptorlake", "meteorlake"}
    if mcpu in vnni or "+avx512vnni" in mattr:
        return "avx512vnni"
    if mcpu in avx2 or "+avx2" in mattr:
        return "avx2"
    return None
