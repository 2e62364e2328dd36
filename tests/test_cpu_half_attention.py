"""vtool's parallel CPU attention kernels over bfloat16 and float16 caches (schedules/cpu/attention.py,
rope_attention.py): a 16-bit build's q, k, v, pages and output are widened exactly on load and the
output rounded once on store, so a 16-bit kernel's output must equal the float32 kernel's output
on the widened inputs, rounded to the 16-bit type, and its lse (float32 in both) must be equal.
TVM's own kernel in the same dtype (what such builds ran before) is checked against the same
numbers within its own rounding."""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from vtool.schedules.cpu.attention import (DECODE_NAME, NAME, PAGED_PREFILL_NAME, rewrite_decode_paged,  # noqa: E402
                                           rewrite_prefill_paged, rewrite_prefill_ragged)
from vtool.targets import buildable  # noqa: E402

TARGET = tvm.target.Target(buildable("host").tvm)
H_KV, H_Q, D, PAGE = 3, 9, 64, 16  # SmolLM2-135M's heads
SCALE = 0.125
NUMPY = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@functools.cache
def _kernels(kind: str, dtype: str) -> dict[str, object]:
    """{"tvm": TVM's kernel at dtype, "vtool": vtool's in its place}, compiled."""
    from tvm.relax.frontend.nn.llm import kv_cache as K

    made = {"decode": (lambda: K._attention_decode_cpu(H_KV, H_Q, D, dtype, False, {}), DECODE_NAME,
                       rewrite_decode_paged),
            "prefill": (lambda: K._attention_prefill_cpu(H_KV, H_Q, D, dtype, False, {}), PAGED_PREFILL_NAME,
                        rewrite_prefill_paged),
            "ragged": (lambda: K._attention_prefill_ragged_cpu(H_KV, H_Q, D, D, dtype, {}), NAME,
                       rewrite_prefill_ragged)}
    make, name, rule = made[kind]
    theirs = make().with_attr("global_symbol", name)
    ours = rule(name, theirs)
    assert ours is not None, f"vtool's {kind} kernel does not take a {dtype} cache"
    return {who: tvm.compile(tvm.IRModule({"main": f}), target=TARGET)["main"]
            for who, f in (("tvm", theirs), ("vtool", ours))}


def _inputs(kind: str, rng: np.random.Generator) -> tuple[list[np.ndarray], int, tuple]:
    """float32 inputs (values already on the bfloat16 grid, so every dtype reads the same numbers
    up to float16's rounding), the number of output rows, and the scalar arguments."""
    def values(shape: tuple[int, ...]) -> np.ndarray:
        return (rng.standard_normal(shape) * 2).astype(ml_dtypes.bfloat16).astype(np.float32)

    if kind == "ragged":
        q_lens = [23, 1, 40]
        indptr = np.cumsum([0] + q_lens).astype("int32")
        n = int(indptr[-1])
        return ([values((n, H_Q, D)), indptr, values((n, H_KV, D)), values((n, H_KV, D)), indptr,
                 np.zeros(n, "int32"), np.zeros(len(q_lens), "int32")], n, (1, 0, 1.0, 10000.0, SCALE))
    kv_lens = [37, 1, 16, 70]
    n_pages = [(n + PAGE - 1) // PAGE for n in kv_lens]
    order = rng.permutation(sum(n_pages) + 2).astype("int32")[:sum(n_pages)]
    pages = values((sum(n_pages) + 2, 2, H_KV, PAGE, D))
    indptr = np.cumsum([0] + n_pages).astype("int32")
    last = np.array([n - (p - 1) * PAGE for n, p in zip(kv_lens, n_pages)], "int32")
    if kind == "decode":
        rows = len(kv_lens)
        zeros = np.zeros(rows, "int32")
        return [values((rows, H_Q, D)), pages, indptr, order, last, zeros, zeros], rows, (0, 1.0, 10000.0, SCALE)
    q_lens = [5, 1, 16, 3]
    rows = sum(q_lens)
    return ([values((rows, H_Q, D)), np.cumsum([0] + q_lens).astype("int32"), pages, indptr, order, last,
             np.zeros(len(kv_lens), "int32"), np.zeros(rows, "int32")], rows, (1, 0, 1.0, 10000.0, SCALE))


def _run(func, inputs: list[np.ndarray], rows: int, scalars: tuple, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    as_dtype = [a.astype(NUMPY[dtype]) if a.dtype == np.float32 else a for a in inputs]
    out = tvm.runtime.tensor(np.full((rows, H_Q, D), np.nan, NUMPY[dtype]))
    lse = tvm.runtime.tensor(np.full((rows, H_Q), np.nan, "float32"))
    func(*[tvm.runtime.tensor(a) for a in as_dtype], out, lse, *scalars)
    return out.numpy().astype(np.float32), lse.numpy()


@pytest.mark.parametrize("kind", ["ragged", "decode", "prefill"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_kernel_is_the_float32_kernel_rounded_once(kind, dtype):
    inputs, rows, scalars = _inputs(kind, np.random.default_rng(7))
    widened = [a.astype(NUMPY[dtype]).astype(np.float32) if a.dtype == np.float32 else a for a in inputs]
    want_out, want_lse = _run(_kernels(kind, "float32")["vtool"], widened, rows, scalars, "float32")
    got_out, got_lse = _run(_kernels(kind, dtype)["vtool"], inputs, rows, scalars, dtype)
    np.testing.assert_array_equal(got_lse, want_lse)
    np.testing.assert_array_equal(got_out, want_out.astype(NUMPY[dtype]).astype(np.float32))
    # TVM's own kernel at this dtype, which such builds ran before: the same up to its roundings
    tvm_out, tvm_lse = _run(_kernels(kind, dtype)["tvm"], inputs, rows, scalars, dtype)
    step = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10
    assert np.abs(tvm_out - got_out).max() <= 4 * step * max(1.0, np.abs(want_out).max())
    np.testing.assert_allclose(tvm_lse, got_lse, atol=5e-2)
