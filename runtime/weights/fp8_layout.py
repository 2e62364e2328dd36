"""The FP8 weight layout, defined once: the contract between the binder and the compiled model.

Pure data (no numpy, no TVM), so the models room may import it as it imports ggml_blocks.py.
A linear weight W [rows, cols] kept in FP8 (`--quantization fp8`) is two compiled parameters:

  weight        float8_e4m3fn [rows, cols]   q = RNE(W / s), |q| <= 448
  weight_scale  float32       [rows]         s = max|W[row]| / 448   (1 where that is 0: a row of
                                                                       zeros, or of weights under 1e-42)

so W ~ q * s[:, None]. runtime/weights/fp8.py makes them; models/fp8_linear.py multiplies by them.
"""
from __future__ import annotations

FP8_FORMAT = "FP8_E4M3"  # the kept-format name in the build plan and the manifest
FP8_DTYPE = "float8_e4m3fn"  # TVM's and ml_dtypes' name
E4M3_MAX = 448.0  # the largest finite e4m3 value
PARTS = ("weight", "weight_scale")
SCALE_DTYPE = "float32"
# The matmuls' reduction runs over 16-column tiles (cuBLASLt's FP8 GEMM needs k % 16 == 0).
COLS_MULTIPLE = 16


def fits(rows: int, cols: int) -> bool:
    """Whether a [rows, cols] weight can be kept in FP8 (columns in whole 16-column tiles)."""
    return rows > 0 and cols > 0 and cols % COLS_MULTIPLE == 0
