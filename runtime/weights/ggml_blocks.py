"""GGML block formats, defined once: the contract between the files, the runtime and the kernels.

Pure data (no TVM, no numpy), so both sides read the same numbers: the runtime's GGUF reader
and repacker (runtime/weights/gguf_reader.py, quant_blocks.py) and the compiler's quantized
modules, weight plan and kernels (models/quantized_linear.py, models/weights.py,
toolchain/quantize.py, schedules/cpu/int8_gemv.py). It is the one module of vtool.runtime
that vtool.models imports: the runtime never imports models/, so the layout lives here.

In the file, a GGUF block of `weights per block` weights takes `bytes per block` bytes
(GGML_TYPES; tests hold it to gguf.GGML_QUANT_SIZES). The 32-weight formats start with
float16 fields (Q8_0/Q4_0: d; Q4_1: d, m; Q5_0: d, then 4 bytes of 5th bits; Q5_1: d, m, then the 4 bytes)
before the quants; Q4_K starts with float16 d, dmin, then 12 bytes of packed 6-bit scales and mins, then
128 bytes of nibbles (Q5_K: 32 bytes of 5th bits before them); Q6_K holds
128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, then float16 d.

In memory, a weight [rows, cols] kept in blocks is two to five compiled parameters ("parts").
Rows are grouped in tiles of TILE_ROWS, block-major inside a tile ([tile, block, row in
tile, ...]), so a kernel computing one tile of output rows reads each part sequentially:

  format  part      dtype    shape                      holds, per (tile, block, row)
  Q8_0    qweight   int8     [rows/4, cols/32, 4, 32]   the block's 32 signed quants
          scale     float16  [rows/4, cols/32, 4]       d;  w = d * q
  Q4_0    qweight   uint8    [rows/4, cols/32, 4, 16]   GGUF's 16 bytes as they are: byte j =
                                                        element j (low nibble) | element j+16 (high)
          scale     float16  [rows/4, cols/32, 4]       d;  w = d * (q - 8)
  Q4_1    qweight   uint8    [rows/4, cols/32, 4, 16]   as Q4_0
          scale     float16  [rows/4, cols/32, 4]       d;  w = d * q + m
          min       float16  [rows/4, cols/32, 4]       m
  Q5_0    qweight   uint8    [rows/4, cols/32, 4, 16]   the low 4 bits, GGUF's 16 bytes as Q4_0's
          qhigh     uint8    [rows/4, cols/32, 4, 4]    GGUF's 4 bytes qh as they are: bit e of
                                                        the little-endian 32 = element e's 5th bit
          scale     float16  [rows/4, cols/32, 4]       d;  w = d * ((q | h << 4) - 16)
  Q5_1    qweight, qhigh  as Q5_0
          scale     float16  [rows/4, cols/32, 4]       d;  w = d * (q | h << 4) + m
          min       float16  [rows/4, cols/32, 4]       m
  Q4_K    qweight   uint8    [rows/4, cols/32, 4, 16]   the 4-bit quants of each 32 weights, in
                                                        Q4_0's order (GGUF pairs sub-blocks 2i and
                                                        2i+1 in one byte's nibbles; regrouped)
          scale     float16  [rows/4, cols/256, 4]      d of the 256-weight super-block
          min       float16  [rows/4, cols/256, 4]      dmin of the super-block
          sub_scale uint8    [rows/4, cols/32, 4]       sc, the 6-bit scale of each 32 (unpacked)
          sub_min   uint8    [rows/4, cols/32, 4]       m, the 6-bit min of each 32 (unpacked)
                                                        w = (d * sc) * q - dmin * m
  Q5_K    qweight   as Q4_K's
          qhigh     uint8    [rows/4, cols/32, 4, 4]    each 32 weights' 5th bits as Q5_0's qhigh
                                                        (GGUF's 32 bytes per 256: bit s of byte l =
                                                        element l of sub-block s; regrouped)
          scale, min, sub_scale, sub_min  as Q4_K's     w = (d * sc) * (q | h << 4) - dmin * m
  Q3_K    qweight   uint8    [rows/4, cols/64, 4, 16]   the low 2 bits of each quant, in Q6_K's qhigh
                                                        layout (byte j of 64 weights: element 16k + j
                                                        at bits 2k..2k+1)
          qhigh     uint8    [rows/4, cols/32, 4, 4]    the third bits (GGUF's hmask), as Q5_0's qhigh
          scale     float16  [rows/4, cols/256, 4]      d
          sub_scale int8     [rows/4, cols/16, 4]       sc - 32 (6-bit, unpacked)
                                                        w = (d * sc) * ((q | h << 2) - 4)
  Q2_K    qweight   uint8    [rows/4, cols/64, 4, 16]   the 2-bit quants, Q3_K's layout
          scale     float16  [rows/4, cols/256, 4]      d
          min       float16  [rows/4, cols/256, 4]      dmin
          sub_scale uint8    [rows/4, cols/16, 4]       GGUF's byte per 16 weights as it is:
                                                        sc (low 4 bits) | m << 4
                                                        w = (d * sc) * q - dmin * m
  IQ4_NL  qweight, scale  as Q4_0                       w = d * IQ4_VALUES[q]
  IQ4_XS  qweight   uint8    [rows/4, cols/32, 4, 16]   GGUF's 16 bytes per 32 as they are (Q4_0's order)
          scale     float16  [rows/4, cols/256, 4]      d
          sub_scale int8     [rows/4, cols/32, 4]       ls - 32 (6-bit, unpacked)
                                                        w = (d * (ls - 32)) * IQ4_VALUES[q]
  Q6_K    qweight   uint8    [rows/4, cols/32, 4, 16]   the low 4 bits of each quant, Q4_0's order
          qhigh     uint8    [rows/4, cols/64, 4, 16]   the high 2 bits: byte j of 64 weights holds
                                                        element 16k + j at bits 2k..2k+1 (k < 4)
          sub_scale int8     [rows/4, cols/16, 4]       sc, the scale of each 16 weights
          scale     float16  [rows/4, cols/256, 4]      d;  w = (d * sc) * (q - 32)

So one 16-byte load of qweight feeds two 16-lane vectors (low nibbles, then high nibbles),
one 16-byte load of qhigh four, and every quant of a chunk of 16 weights shares one scale.
Scales stay GGUF's float16, so Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q6_K bind exactly the file's bytes, Q4_K 148 per
144 and Q5_K 180 per 176 (their 6-bit scales and mins take a byte each), Q3_K 114 per 110 (its 6-bit
scales a byte each), Q2_K its 84, IQ4_NL its 18 per 32 and IQ4_XS 138 per 136.
runtime/weights/quant_blocks.py makes these arrays from GGUF blocks; the binder checks every part's
shape and dtype against the manifest.
"""
from __future__ import annotations

import dataclasses

# GGML type id -> (name, weights per block, bytes per block), as gguf.GGMLQuantizationType and
# gguf.GGML_QUANT_SIZES (a test holds them equal).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}
# IQ4_NL's and IQ4_XS's 16 non-linear levels (ggml's kvalues_iq4nl; a test holds them to gguf-py's)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_SIZES = {name: (block, size) for name, block, size in GGML_TYPES.values()}

BLOCK = 32  # weights per qweight block in every kept format (and per scale in Q8_0/Q4_0/Q4_1)
SUPER_BLOCK = 256  # weights per GGUF block of the K-quants
TILE_ROWS = 4  # rows per tile; a weight kept in blocks needs rows % TILE_ROWS == 0


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A GGML format vtool keeps in blocks (has kernels for)."""

    name: str  # GGML type name: "Q8_0", "Q4_0", ..., "Q6_K", "IQ4_NL", "IQ4_XS"
    parts: tuple[str, ...]  # compiled parameters, in this order
    qweight_dtype: str  # "int8" | "uint8"
    qweight_per_block: int  # qweight bytes per qweight_group weights (32 for int8, 16 for packed nibbles)
    header: int  # bytes of float16 d (and m) before the quants (32-weight formats; 0 for K-quants)
    qweight_group: int = BLOCK  # weights per qweight entry along a row (64 for the 2-bit Q2_K/Q3_K)

    @property
    def block_weights(self) -> int:
        """Weights per GGUF block: 32, or 256 for the K-quants."""
        return _SIZES[self.name][0]

    @property
    def block_bytes(self) -> int:
        """Bytes per GGUF block in the file."""
        return _SIZES[self.name][1]


FORMATS: dict[str, BlockFormat] = {
    "Q8_0": BlockFormat("Q8_0", ("qweight", "scale"), "int8", 32, 2),
    "Q4_0": BlockFormat("Q4_0", ("qweight", "scale"), "uint8", 16, 2),
    "Q4_1": BlockFormat("Q4_1", ("qweight", "scale", "min"), "uint8", 16, 4),
    "Q5_0": BlockFormat("Q5_0", ("qweight", "qhigh", "scale"), "uint8", 16, 6),
    "Q5_1": BlockFormat("Q5_1", ("qweight", "qhigh", "scale", "min"), "uint8", 16, 8),
    "Q2_K": BlockFormat("Q2_K", ("qweight", "scale", "min", "sub_scale"), "uint8", 16, 0, 64),
    "Q3_K": BlockFormat("Q3_K", ("qweight", "qhigh", "scale", "sub_scale"), "uint8", 16, 0, 64),
    "Q4_K": BlockFormat("Q4_K", ("qweight", "scale", "min", "sub_scale", "sub_min"), "uint8", 16, 0),
    "Q5_K": BlockFormat("Q5_K", ("qweight", "qhigh", "scale", "min", "sub_scale", "sub_min"), "uint8", 16, 0),
    "Q6_K": BlockFormat("Q6_K", ("qweight", "qhigh", "scale", "sub_scale"), "uint8", 16, 0),
    "IQ4_NL": BlockFormat("IQ4_NL", ("qweight", "scale"), "uint8", 16, 2),
    "IQ4_XS": BlockFormat("IQ4_XS", ("qweight", "scale", "sub_scale"), "uint8", 16, 0),
}
QUANT_PARTS = ("qweight", "scale", "min", "qhigh", "sub_scale", "sub_min")

# Parts other than qweight whose layout is not "float16, one per 32 weights":
# (format, part) -> (dtype, weights per entry along a row, trailing bytes or 0 for none)
_OTHER_PARTS: dict[tuple[str, str], tuple[str, int, int]] = {
    ("Q5_0", "qhigh"): ("uint8", BLOCK, 4),
    ("Q5_1", "qhigh"): ("uint8", BLOCK, 4),
    ("Q5_K", "qhigh"): ("uint8", BLOCK, 4),
    ("Q5_K", "scale"): ("float16", SUPER_BLOCK, 0),
    ("Q5_K", "min"): ("float16", SUPER_BLOCK, 0),
    ("Q5_K", "sub_scale"): ("uint8", BLOCK, 0),
    ("Q5_K", "sub_min"): ("uint8", BLOCK, 0),
    ("Q4_K", "scale"): ("float16", SUPER_BLOCK, 0),
    ("Q4_K", "min"): ("float16", SUPER_BLOCK, 0),
    ("Q4_K", "sub_scale"): ("uint8", BLOCK, 0),
    ("Q4_K", "sub_min"): ("uint8", BLOCK, 0),
    ("Q6_K", "qhigh"): ("uint8", 64, 16),
    ("Q6_K", "sub_scale"): ("int8", 16, 0),
    ("Q6_K", "scale"): ("float16", SUPER_BLOCK, 0),
    ("Q3_K", "qhigh"): ("uint8", BLOCK, 4),
    ("Q3_K", "scale"): ("float16", SUPER_BLOCK, 0),
    ("Q3_K", "sub_scale"): ("int8", 16, 0),
    ("Q2_K", "scale"): ("float16", SUPER_BLOCK, 0),
    ("Q2_K", "min"): ("float16", SUPER_BLOCK, 0),
    ("Q2_K", "sub_scale"): ("uint8", 16, 0),
    ("IQ4_XS", "scale"): ("float16", SUPER_BLOCK, 0),
    ("IQ4_XS", "sub_scale"): ("int8", BLOCK, 0),
}


def parts(fmt: str) -> tuple[str, ...]:
    return FORMATS[fmt].parts


def block_cols(fmt: str) -> int:
    """Weights per GGUF block of `fmt`: a kept weight's columns are a multiple of it."""
    return FORMATS[fmt].block_weights


def _layout(fmt: str, part: str) -> tuple[str, int, int]:
    if part not in parts(fmt):
        raise KeyError(f"{fmt} has no part {part!r}")
    if part == "qweight":
        return FORMATS[fmt].qweight_dtype, FORMATS[fmt].qweight_group, FORMATS[fmt].qweight_per_block
    return _OTHER_PARTS.get((fmt, part), ("float16", BLOCK, 0))  # GGUF's own scales


def part_shape(fmt: str, part: str, rows: int, cols: int) -> tuple[int, ...]:
    _, group, inner = _layout(fmt, part)
    tiled = (rows // TILE_ROWS, cols // group, TILE_ROWS)
    return (*tiled, inner) if inner else tiled


def part_dtype(fmt: str, part: str) -> str:
    return _layout(fmt, part)[0]


def keepable(fmt: str, rows: int, cols: int) -> bool:
    """Whether a [rows, cols] weight stored as `fmt` can stay in blocks."""
    return fmt in FORMATS and rows % TILE_ROWS == 0 and cols % block_cols(fmt) == 0
