"""Quantized activation rows (llama.cpp's integer-dot scheme): which kept formats and targets take them.

Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL weights meet Q8_0 activation blocks, Q2_K..Q6_K and IQ4_XS weights Q8_K
ones, as in llama.cpp.

The build decides `--activations` with these before it compiles anything, so this module is
pure Python (no TVM). The kernels themselves are schedules/cpu/int8_gemv.py; the toolchain
hands them to the model (models/quantized_linear.py `use_int8_gemv`), and a test holds that
file's FORMATS equal to INT8_FORMATS.
"""
from __future__ import annotations

from typing import Any

# The kept formats with integer-dot kernels over Q8_0 activation blocks (schedules/cpu/int8_gemv.py) ...
INT8_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")
# ... and over Q8_K ones (256 values, float32 d: llama.cpp's K-quant dots, schedules/cpu/kquant_gemv.py)
Q8_K_FORMATS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
# Every kept format that takes quantized activations under --activations decode / q8_0 / auto
DOT_FORMATS = INT8_FORMATS + Q8_K_FORMATS

_VNNI_CPUS = {"cascadelake", "cooperlake", "icelake-server", "icelake-client", "tigerlake", "sapphirerapids",
              "emeraldrapids", "graniterapids", "znver4", "znver5"}
_AVX2_CPUS = {"haswell", "broadwell", "skylake", "skylake-avx512", "znver1", "znver2", "znver3", "alderlake",
              "raptorlake", "meteorlake"}


def int8_isa(mcpu: str, mattr: list[str]) -> str | None:
    """The integer-dot ISA an x86 `mcpu` (LLVM's name) with `mattr` may use: "avx512vnni",
    "avx2", or None (the float kernels)."""
    if mcpu in _VNNI_CPUS or "+avx512vnni" in mattr:
        return "avx512vnni"
    if mcpu in _AVX2_CPUS or "+avx2" in mattr:
        return "avx2"
    return None


def isa_for_target(target: Any) -> str | None:
    """int8_isa of a tvm.target.Target; None for other kinds and non-x86 triples."""
    if target.kind.name != "llvm" or not str(target.attrs.get("mtriple", "x86_64")).startswith("x86_64"):
        return None
    return int8_isa(str(target.attrs.get("mcpu", "")), [str(a) for a in target.attrs.get("mattr", [])])
