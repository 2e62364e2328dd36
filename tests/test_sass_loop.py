"""tests/bench/sass_loop.py's reading of `cuobjdump -sass` output: the loop is the span from the
last backward branch's target to that branch, predicated instructions count, forward branches and
the code around the loop do not; a function without a backward branch has no loop."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from sass_diff import functions  # noqa: E402
from sass_loop import loop_opcodes  # noqa: E402


def _line(at: int, text: str) -> str:
    return f"        /*{at:04x}*/                   {text} ;                /* 0x000fe20000000f00 */"


SASS = "\n".join([
    "\tcode for sm_90a",
    "\t\tFunction : _Z4stepPf",
    "\t.headerflags\t@\"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\"",
    _line(0x00, "LDC R1, c[0x0][0x28]"),
    _line(0x10, "@!P0 BRA 0x60"),               # forward: not a loop
    _line(0x20, "IMAD.MOV.U32 R2, RZ, RZ, RZ"),
    _line(0x30, "HMMA.16816.F32.BF16 R4, R8, R12, R4"),   # the loop: 0x30 .. 0x60
    _line(0x40, "@P1 LOP3.LUT R2, R2, 0xf000f, R3, 0xea, !PT"),
    _line(0x50, "HFMA2.BF16_V2 R5, R6, R7, R8"),
    _line(0x60, "@!P2 BRA 0x30"),
    _line(0x70, "EXIT"),
    "\t\tFunction : _Z4flatv",
    _line(0x00, "MOV R1, R2"),
    _line(0x10, "EXIT"),
])


def test_the_loop_is_the_last_backward_branch_span() -> None:
    funcs = functions(SASS, keep_offsets=True)
    assert list(funcs) == ["_Z4stepPf", "_Z4flatv"]
    assert loop_opcodes(funcs["_Z4stepPf"]) == ["HMMA", "LOP3", "HFMA2", "BRA"]


def test_a_function_without_a_backward_branch_has_no_loop() -> None:
    assert loop_opcodes(functions(SASS, keep_offsets=True)["_Z4flatv"]) == []
