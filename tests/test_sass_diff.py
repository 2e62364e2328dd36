"""tests/bench/sass_diff.py's reading of `cuobjdump -sass` output: a kernel built from two
differently named sources (nvcc's anonymous-namespace name, its hash and its mangled length
differ) at other addresses is the same function with the same instructions; a changed
instruction is not. The text below has cuobjdump's layout (Function lines, instructions with
their offset comments)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from sass_diff import functions  # noqa: E402


def _sass(anon: str, base: int, second: str) -> str:
    name = f"_ZN{len(anon)}{anon}9BlockGemvI6__halfEEvPKT_ii"
    return "\n".join([
        "\tcode for sm_90a",
        f"\t\tFunction : {name}",
        "\t.headerflags\t@\"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\"",
        f"        /*{base:04x}*/                   LDC R1, c[0x0][0x28] ;                /* 0x00000a00ff017b82 */",
        f"        /*{base + 16:04x}*/                   {second} ;                /* 0x000fe20000000f00 */",
        "\t\t..........",
    ])


A = "_GLOBAL__N__d3bca25d_12_block_mma_cu_5b585b65"
B = "_GLOBAL__N__0a1b2c3d_19_renamed_kernels_cu_9f8e7d6c"


def test_a_kernel_from_another_file_name_and_address_is_the_same_function() -> None:
    old, new = functions(_sass(A, 0x0, "S2R R0, SR_TID.X")), functions(_sass(B, 0x100, "S2R R0, SR_TID.X"))
    assert list(old) == list(new) == ["_ZNANON9BlockGemvI6__halfEEvPKT_ii"]
    assert old == new


def test_a_changed_instruction_differs() -> None:
    old, new = functions(_sass(A, 0x0, "S2R R0, SR_TID.X")), functions(_sass(A, 0x0, "S2R R2, SR_TID.X"))
    assert list(old) == list(new) and old != new
