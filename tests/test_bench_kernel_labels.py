"""tests/bench/gpu_decode_8b.py's kernel labels: the profile's top list names each kernel so that
instances of one C++ template (block_mma.cu's BlockGemv per format and epilogue) stay apart; cut
to 80 characters they all read `void (anonymous namespace)::BlockGemv<__nv_bfloat16, ((anony`."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from gpu_decode_8b import kernel_label  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

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


def test_idle_between_sums_the_stretches_with_no_kernel_by_the_pair_around_them() -> None:
    from gpu_decode_8b import idle_between

    # two steps of a -> b -> c; b overlaps a (no idle there), c starts 3 us after b ends
    timeline = [(0, 10, "a"), (8, 12, "b"), (15, 20, "c"), (30, 40, "a"), (38, 42, "b"), (45, 50, "c")]
    total, pairs = idle_between(timeline, steps=2)
    assert total == (3 + 10 + 3) / 2
    # largest first: the 10 us between the steps (5 a step, half a stretch a step), then b -> c
    assert pairs == [("c", "a", 5.0, 0.5), ("b", "c", 3.0, 1.0)]
    assert idle_between([], 1) == (0.0, [])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 50)), min_size=1, max_size=40))
def test_idle_plus_busy_is_the_whole_span(spans) -> None:  # noqa: ANN001
    from gpu_decode_8b import idle_between

    timeline = [(float(s), float(s + d), f"k{i % 3}") for i, (s, d) in enumerate(spans)]
    busy = set()
    for s, d in spans:
        busy.update(range(s, s + d))  # unit cells covered by some kernel
    first, last = min(s for s, _ in spans), max(s + d for s, d in spans)
    total, _ = idle_between(timeline, steps=1, top=1000)
    assert total == (last - first) - len(busy)
