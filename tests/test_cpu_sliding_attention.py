"""The CPU sliding-window attention kernels (schedules/cpu/attention.py
`rewrite_prefill_paged_sliding`, `rewrite_decode_paged_sliding`), which replace TVM's serial
`batch_prefill_paged_kv_cpu_sliding_window` and `batch_decode_paged_kv_cpu_sliding_window`:
held to a float64 numpy softmax that follows TVM's semantics (length_info [3, B] =
last_page_len, window offset, sink; logical position pos at slot pos < sink ? pos : pos - sink
+ offset; the prefill's causal mask: query i sees the last max(W - i - 1, 0) cached keys), and
to TVM's own kernels (the prefill one with schedules/cpu/sliding_attention.py's fix) on the
rows that see a key. Pages come in a shuffled order, slots outside a sequence are NaN.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tvm = pytest.importorskip("tvm")

from vtool.schedules.cpu.attention import (
    SLIDING_DECODE_NAME,
    SLIDING_PREFILL_NAME,
    rewrite_decode_paged_sliding,
    rewrite_prefill_paged_sliding,
)
from vtool.schedules.cpu.sliding_attention import fix_sliding_prefill
from vtool.targets import buildable

TARGET = tvm.target.Target(buildable("host").tvm)
H_KV, H_Q, D, PAGE, W = 2, 6, 32, 16, 8
SCALE = 0.17


@functools.cache
def _kernels(page: int = PAGE):
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode_cpu
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_cpu

    prefill = _attention_prefill_cpu(H_KV, H_Q, D, "float32", True, {}, page_size=page, sliding_window_size=W)
    decode = _attention_decode_cpu(H_KV, H_Q, D, "float32", True, {}, page_size=page)
    funcs = {"prefill": (fix_sliding_prefill(SLIDING_PREFILL_NAME, prefill),
                         rewrite_prefill_paged_sliding(SLIDING_PREFILL_NAME, prefill)),
             "decode": (decode, rewrite_decode_paged_sliding(SLIDING_DECODE_NAME, decode))}
    return {kind: tuple(tvm.compile(tvm.IRModule({"main": f}), target=TARGET)["main"] for f in pair)
            for kind, pair in funcs.items()}


def _case(rng, seqs, page):
    """seqs: (n_q, n_slots, offset, sink) per sequence: n_slots slots written in its pages, the
    window from slot `offset`, the first `sink` slots a sink."""
    n_pages = [(n + page - 1) // page for _, n, _, _ in seqs]
    total = sum(n_pages)
    order = rng.permutation(total + 3).astype("int32")[:total]
    page_indptr = np.cumsum([0] + n_pages).astype("int32")
    info = np.zeros((3, len(seqs)), "int32")
    pages = rng.standard_normal((total + 3, 2, H_KV, page, D)).astype("float32") * 2
    pages[np.setdiff1d(np.arange(total + 3), order)] = np.nan
    for b, (_, n, offset, sink) in enumerate(seqs):
        info[:, b] = (n - (n_pages[b] - 1) * page if n_pages[b] else 0, offset, sink)
        for s in range(n_pages[b] * page):
            if not (s < sink or offset <= s < n):  # neither sink nor window: never read
                pages[order[page_indptr[b] + s // page], :, :, s % page] = np.nan
    q = rng.standard_normal((sum(n_q for n_q, *_ in seqs), H_Q, D)).astype("float32")
    return q, pages, page_indptr, order, info


def _reference(q, pages, page_indptr, order, info, q_lens, causal, page):
    out = np.zeros(q.shape, np.float64)
    lse = np.full(q.shape[:2], -5e4, np.float64)
    row = 0
    for b, n_q in enumerate(q_lens):
        n_pages = page_indptr[b + 1] - page_indptr[b]
        last, offset, sink = info[:, b]
        n_kv = (n_pages - 1) * page + last - offset + sink if n_pages else 0
        slots = [pos if pos < sink else pos - sink + offset for pos in range(n_kv)]
        kv = np.stack([pages[order[page_indptr[b] + s // page], :, :, s % page] for s in slots], 1) if slots else \
            np.zeros((2, 0, H_KV, D))
        kv = kv.astype(np.float64)
        for i in range(n_q):
            lo = max(n_kv - max(W - i - 1, 0), 0) if causal else 0
            for h in range(H_Q):
                if lo < n_kv:
                    keys, vals = kv[0, lo:, h // (H_Q // H_KV)], kv[1, lo:, h // (H_Q // H_KV)]
                    assert np.isfinite(keys).all() and np.isfinite(vals).all()
                    s = keys @ q[row, h].astype(np.float64) * SCALE * np.log2(np.e)
                    p = np.exp2(s - s.max())
                    out[row, h] = p @ vals / p.sum()
                    lse[row, h] = s.max() + np.log2(p.sum())
            row += 1
    return out, lse


def _check(seqs, causal, seed, kind="prefill", page=PAGE):
    rng = np.random.default_rng(seed)
    tvms, ours = _kernels(page)[kind]
    q_lens = [n_q for n_q, *_ in seqs] if kind == "prefill" else [1] * len(seqs)
    q, pages, page_indptr, order, info = _case(rng, seqs, page)
    q = q[:sum(q_lens)]
    tq = q.shape[0]
    args = ([q, np.cumsum([0] + q_lens).astype("int32")] if kind == "prefill" else [q]) + \
        [pages, page_indptr, order, info, np.zeros(len(seqs), "int32"), np.zeros(tq, "int32")]
    want_out, want_lse = _reference(q, pages, page_indptr, order, info, q_lens, causal if kind == "prefill" else 0,
                                    page)
    seen = want_lse > -4e4  # rows with a visible key
    for func in (ours, tvms):
        out = tvm.runtime.tensor(np.full((tq, H_Q, D), np.nan, "float32"))
        lse = tvm.runtime.tensor(np.full((tq, H_Q), np.nan, "float32"))
        scalars = (causal, 0, 1.0, 10000.0, SCALE) if kind == "prefill" else (0, 1.0, 10000.0, SCALE)
        func(*[tvm.runtime.tensor(a) for a in args], out, lse, *scalars)
        got_out, got_lse = out.numpy(), lse.numpy()
        if func is ours:  # no key: output 0, lse -5e4
            np.testing.assert_allclose(got_out, want_out, atol=2e-5, rtol=1e-5)
            np.testing.assert_allclose(got_lse, want_lse, atol=2e-5, rtol=1e-5)
        else:  # TVM's: only where a key is seen (elsewhere another output, lse about -5e4)
            np.testing.assert_allclose(got_out[seen], want_out[seen], atol=2e-5, rtol=1e-5)
            np.testing.assert_allclose(got_lse[seen], want_lse[seen], atol=2e-5, rtol=1e-5)
            assert (got_lse[~seen] < -4e4).all()


def test_replaces_tvms_kernels_with_the_same_signatures():
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode_cpu
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_cpu
    from vtool.schedules.cpu.attention import (
        rewrite_decode_paged,
        rewrite_prefill_paged,
    )

    prefill = _attention_prefill_cpu(H_KV, H_Q, D, "float32", True, {}, sliding_window_size=W)
    decode = _attention_decode_cpu(H_KV, H_Q, D, "float32", True, {})
    for orig, new in ((prefill, rewrite_prefill_paged_sliding(SLIDING_PREFILL_NAME, prefill)),
                      (decode, rewrite_decode_paged_sliding(SLIDING_DECODE_NAME, decode))):
        assert new is not None and "T.parallel" in new.script()
        assert [str(p.ty) for p in new.params] == [str(p.ty) for p in orig.params]
    assert "T.max(8 - q_idx - 1, 0)" in rewrite_prefill_paged_sliding(SLIDING_PREFILL_NAME, prefill).script()
    # the full-attention rules leave them alone, and these leave the full-attention kernels alone
    assert rewrite_prefill_paged(SLIDING_PREFILL_NAME, prefill) is None
    assert rewrite_decode_paged(SLIDING_DECODE_NAME, decode) is None
    full = _attention_prefill_cpu(H_KV, H_Q, D, "float32", False, {})
    assert rewrite_prefill_paged_sliding(SLIDING_PREFILL_NAME, full) is None


@pytest.mark.parametrize("seqs,causal", [
    ([(5, 40, 0, 0)], 1),  # window 8, query i sees the last 7 - i cached keys
    ([(5, 40, 0, 0)], 0),
    ([(3, 50, 21, 0), (8, 17, 0, 0), (1, 9, 3, 2)], 1),  # a window offset mid-page; a sink
    ([(4, 70, 37, 4)], 1), ([(2, 0, 0, 0), (6, 5, 0, 0)], 1)])  # no pages; fewer keys than the window
@pytest.mark.parametrize("page", [PAGE, 8])
def test_prefill_matches_numpy_and_tvm(seqs, causal, page):
    _check(seqs, causal, seed=len(seqs) + causal, page=page)


@pytest.mark.parametrize("seqs", [[(1, 40, 0, 0)], [(1, 50, 37, 0), (1, 9, 1, 0), (1, 70, 40, 4)],
                                  [(1, 0, 0, 0), (1, 1, 0, 0)]])
@pytest.mark.parametrize("page", [PAGE, 8])
def test_decode_matches_numpy_and_tvm(seqs, page):
    _check(seqs, 0, seed=len(seqs), kind="decode", page=page)


@settings(max_examples=20, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 60), st.integers(0, 40), st.integers(0, 3)),
                     min_size=1, max_size=3),
       causal=st.integers(0, 1), seed=st.integers(0, 2**16))
def test_any_windows_match(seqs, causal, seed):
    """Offsets and sinks anywhere (the window's slots [offset, n) with the sink's below them)."""
    seqs = [(n_q, n, min(off, n), min(sink, off, n)) for n_q, n, off, sink in seqs]
    _check(seqs, causal, seed)
    _check(seqs, 0, seed, kind="decode")
