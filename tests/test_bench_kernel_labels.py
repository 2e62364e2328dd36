"""tests/bench/gpu_decode_8b.py's kernel labels: the profile's top list names each kernel so that
instances of one C++ template (block_mma.cu's BlockGemv per format and epilogue) stay apart; cut
to 80 characters they all read `void (anonymous namespace)::BlockGemv<__nv_bfloat16, ((anony`."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from gpu_decode_8b import kernel_label  # noqa: E402

# as CUPTI reports them (demangled)
GEMV = ("void (anonymous namespace)::BlockGemv<__nv_bfloat16, ((anonymous namespace)::Fmt){fmt}, "
        "((anonymous namespace)::Epilogue){epi}>(const T1 *, (anonymous namespace)::Parts, void *, const T1 *, int, int)")


def test_template_instances_keep_their_arguments_and_lose_the_rest() -> None:
    cast = kernel_label(GEMV.format(fmt=1, epi=1))
    add = kernel_label(GEMV.format(fmt=1, epi=2))
    assert cast == "BlockGemv<__nv_bfloat16, (Fmt)1, (Epilogue)1>" and add.endswith("(Epilogue)2>")
    assert "Parts" not in cast and "anonymous" not in cast


def test_generated_kernels_keep_their_names() -> None:
    for name in ("fused_rope_kernel", "rms_norm2_kernel", "Memcpy HtoD (Pinned -> Device)"):
        assert kernel_label(name) == name
    assert len(kernel_label("x" * 300)) == 120
