"""The CPU paged prefill attention (schedules/cpu/attention.py `rewrite_prefill_paged`): a
chunk's queries over keys already in the paged KV cache (chunked prefill, prefix-cache hits,
speculative verification), held to a float64 numpy softmax over the same keys, and on a few
shapes to TVM's own serial kernel (`_attention_prefill_cpu`, which it replaces). Pages are
handed out in a shuffled order, as a KV cache's free list does; queries are causal (query i
of n sees kv_len - n + i + 1 keys) or see every key.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tvm = pytest.importorskip("tvm")

from vtool.schedules.cpu.attention import PAGED_PREFILL_NAME, rewrite_prefill_paged  # noqa: E402
from vtool.targets import buildable  # noqa: E402

TARGET = tvm.target.Target(buildable("host").tvm)
H_KV, H_Q, D, PAGE = 3, 9, 64, 16  # SmolLM2-135M's heads


@functools.lru_cache(maxsize=None)
def _kernels(page: int = PAGE):
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_cpu

    orig = _attention_prefill_cpu(H_KV, H_Q, D, "float32", False, {}, page_size=page).with_attr(
        "global_symbol", PAGED_PREFILL_NAME)
    new = rewrite_prefill_paged(PAGED_PREFILL_NAME, orig)
    return {f: tvm.compile(tvm.IRModule({"main": f}), target=TARGET)["main"] for f in (orig, new)}, orig, new


def _reference(q, pages, page_indptr, order, kv_lens, q_lens, causal, sm_scale):  # noqa: PLR0913
    out = np.zeros(q.shape, np.float64)
    lse = np.zeros(q.shape[:2], np.float64)
    row = 0
    for b, (n_q, n_kv) in enumerate(zip(q_lens, kv_lens)):
        ids = order[page_indptr[b]:page_indptr[b + 1]]
        keys = pages[ids, 0].transpose(1, 0, 2, 3).reshape(H_KV, -1, D)[:, :n_kv].astype(np.float64)
        vals = pages[ids, 1].transpose(1, 0, 2, 3).reshape(H_KV, -1, D)[:, :n_kv].astype(np.float64)
        assert np.isfinite(keys).all() and np.isfinite(vals).all()
        for i in range(n_q):
            visible = max(min(n_kv - n_q + i + 1, n_kv), 0) if causal else n_kv
            for h in range(H_Q):
                if visible == 0:
                    out[row, h], lse[row, h] = 0, -5e4
                    continue
                s = keys[h // (H_Q // H_KV), :visible] @ q[row, h].astype(np.float64) * sm_scale * np.log2(np.e)
                p = np.exp2(s - s.max())
                out[row, h] = p @ vals[h // (H_Q // H_KV), :visible] / p.sum()
                lse[row, h] = s.max() + np.log2(p.sum())
            row += 1
    return out, lse


def _check(q_lens, kv_lens, causal, seed, tvms_too=False, page=PAGE):
    compiled, orig, new = _kernels(page)
    rng = np.random.default_rng(seed)
    n_pages = [(n + page - 1) // page for n in kv_lens]
    total = sum(n_pages)
    order = rng.permutation(total + 3).astype("int32")[:total]  # some pages unused
    page_indptr = np.cumsum([0] + n_pages).astype("int32")
    last = np.array([n - (p - 1) * page if p else 0 for n, p in zip(kv_lens, n_pages)], "int32")
    tq = sum(q_lens)
    q = rng.standard_normal((tq, H_Q, D)).astype("float32")
    pages = rng.standard_normal((total + 3, 2, H_KV, page, D)).astype("float32") * 2
    pages[np.setdiff1d(np.arange(total + 3), order)] = np.nan  # unused pages, and below the slots past
    # each sequence's end: never read into a result
    for b, n in enumerate(kv_lens):
        if n_pages[b]:
            pages[order[page_indptr[b + 1] - 1], :, :, last[b]:] = np.nan
    inputs = [q, np.cumsum([0] + q_lens).astype("int32"), pages, page_indptr, order, last,
              np.zeros(len(q_lens), "int32"), np.zeros(tq, "int32")]
    want_out, want_lse = _reference(q, pages, page_indptr, order, kv_lens, q_lens, causal, 0.125)
    dev = tvm.cpu()
    for func in (new, orig) if tvms_too else (new,):
        out = tvm.runtime.tensor(np.full((tq, H_Q, D), np.nan, "float32"), dev)
        lse = tvm.runtime.tensor(np.full((tq, H_Q), np.nan, "float32"), dev)
        compiled[func](*[tvm.runtime.tensor(a, dev) for a in inputs], out, lse, causal, 0, 1.0, 10000.0, 0.125)
        np.testing.assert_allclose(out.numpy(), want_out, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(lse.numpy(), want_lse, atol=2e-5, rtol=1e-5)


def test_replaces_tvms_kernel_with_the_same_signature_only():
    _, orig, new = _kernels()
    assert new is not None and not new.same_as(orig)
    assert [str(p.ty) for p in new.params] == [str(p.ty) for p in orig.params]
    assert rewrite_prefill_paged("batch_prefill_paged_kv_cpu_sliding_window", orig) is None
    assert rewrite_prefill_paged("other_name", orig) is None
    assert "T.parallel" in new.script()


@pytest.mark.parametrize("q_lens,kv_lens,causal", [([5], [133], 0), ([5], [133], 1), ([1], [1], 1),
                                                   ([3, 5, 1], [16, 40, 17], 1), ([9], [4], 0)])
def test_verify_shapes_match_a_float64_softmax(q_lens, kv_lens, causal):
    _check(q_lens, kv_lens, causal, seed=sum(kv_lens))


@pytest.mark.parametrize("page", [PAGE, 8])
@pytest.mark.parametrize("q_lens,kv_lens,causal", [([5], [133], 1), ([3, 5, 1], [16, 40, 17], 1), ([4], [70], 0)])
def test_tvms_kernel_agrees(q_lens, kv_lens, causal, page):
    """TVM's serial kernel on the same inputs, and a page size other than the 16 lanes (the
    per-key path): both within float32 rounding of the reference."""
    _check(q_lens, kv_lens, causal, seed=len(q_lens), tvms_too=True, page=page)


@settings(max_examples=25, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 70)), min_size=1, max_size=4),
       causal=st.integers(0, 1), seed=st.integers(0, 2**16))
def test_any_lengths_match_a_float64_softmax(seqs, causal, seed):
    """Empty sequences (no keys: output 0, lse -5e4 as TVM's), queries with no visible key
    (causal, more queries than keys), keys ending mid-page (the rest of the page NaN)."""
    _check([n_q for n_q, _ in seqs], [n_kv for _, n_kv in seqs], causal, seed)


@pytest.mark.parametrize("kv_len", [1, 16, 37, 130])
def test_decode_kernel_ignores_slots_past_the_end(kv_len):
    """The decode kernel scores a page of 16 keys at once as well: slots past the sequence's end
    (NaN here) must be masked, never summed into a result."""
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode_cpu

    from vtool.schedules.cpu.attention import DECODE_NAME, rewrite_decode_paged

    orig = _attention_decode_cpu(H_KV, H_Q, D, "float32", False, {}).with_attr("global_symbol", DECODE_NAME)
    run = tvm.compile(tvm.IRModule({"main": rewrite_decode_paged(DECODE_NAME, orig)}), target=TARGET)["main"]
    rng = np.random.default_rng(kv_len)
    n_pages = (kv_len + PAGE - 1) // PAGE
    order = rng.permutation(n_pages + 2).astype("int32")[:n_pages]
    last = kv_len - (n_pages - 1) * PAGE
    pages = rng.standard_normal((n_pages + 2, 2, H_KV, PAGE, D)).astype("float32")
    pages[order[-1], :, :, last:] = np.nan
    q = rng.standard_normal((1, H_Q, D)).astype("float32")
    out = tvm.runtime.tensor(np.full((1, H_Q, D), np.nan, "float32"))
    lse = tvm.runtime.tensor(np.full((1, H_Q), np.nan, "float32"))
    run(*[tvm.runtime.tensor(a) for a in [q, pages, np.array([0, n_pages], "int32"), order, np.array([last], "int32"),
                                          np.zeros(1, "int32"), np.zeros(1, "int32")]], out, lse, 0, 1.0, 10000.0, 0.125)
    want_out, want_lse = _reference(q, pages, np.array([0, n_pages]), order, [kv_len], [1], 0, 0.125)
    np.testing.assert_allclose(out.numpy(), want_out, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=2e-5, rtol=1e-5)
