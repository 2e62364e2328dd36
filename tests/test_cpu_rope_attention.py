"""The inline-rope CPU attention kernels of the window-freeing KV cache (schedules/cpu/
rope_attention.py), which replace TVM's serial `batch_prefill_ragged_kv`,
`batch_prefill_paged_kv_cpu_sliding_window` (masked per query: models/window_cache.py) and
`batch_decode_paged_kv_cpu_sliding_window` under the cache's own names. Held to a float64 numpy
attention that rotates q and k at their absolute positions (query row i at q_rope_position[i],
key row r of sequence b at k_rope_pos_offset[b] + r; the kernels instead rotate the query by
the distance), and to TVM's own kernels called with rotary_mode 1. Pages come shuffled, slots
outside a sequence are NaN; hypothesis draws the sequences, offsets, sinks and rope bases.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tvm = pytest.importorskip("tvm")

from vtool.models.window_cache import _masked_prefill
from vtool.schedules.cpu import cpu_schedule_pass
from vtool.schedules.cpu.attention import NAME as RAGGED, SLIDING_DECODE_NAME, SLIDING_PREFILL_NAME
from vtool.schedules.cpu.rope_attention import FREEING_SUFFIX, rewrite_inline_rope, window_freeing_kernels
from vtool.schedules.cpu.sliding_attention import fix_sliding_prefill
from vtool.targets import buildable

TARGET = tvm.target.Target(buildable("host").tvm)
H_KV, H_Q, PAGE, W = 2, 6, 16, 24  # the table holds distances below 2 * W = 48
SCALE = 0.17


def _tvm_kernels(d: int) -> dict:
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode_cpu
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_cpu, _attention_prefill_ragged_cpu

    prefill = _attention_prefill_cpu(H_KV, H_Q, d, "float32", True, {}, page_size=PAGE, sliding_window_size=W)
    return {RAGGED: _attention_prefill_ragged_cpu(H_KV, H_Q, d, d, "float32", {}),
            SLIDING_PREFILL_NAME: _masked_prefill(prefill, SLIDING_PREFILL_NAME + FREEING_SUFFIX),
            SLIDING_DECODE_NAME: _attention_decode_cpu(H_KV, H_Q, d, "float32", True, {}, page_size=PAGE)}


@functools.cache
def _compiled(d: int) -> dict[str, tuple]:
    """(TVM's, ours) compiled, per kernel."""
    out = {}
    for name, func in _tvm_kernels(d).items():
        ours = rewrite_inline_rope(name + FREEING_SUFFIX, func, W)
        assert ours is not None, name
        theirs = fix_sliding_prefill(SLIDING_PREFILL_NAME, func) or func if name == SLIDING_PREFILL_NAME else func
        out[name] = tuple(tvm.compile(tvm.IRModule({"main": f}), target=TARGET)["main"] for f in (theirs, ours))
    return out


def _rotate(x: np.ndarray, pos: np.ndarray, theta: float, scale: float) -> np.ndarray:
    """NeoX rope of x [..., d] at positions pos [...] (TVM's rope_freq_default), float64."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(d // 2) * 2.0 / d)
    ang = (pos[..., None] * scale) * inv
    cos, sin = np.cos(ang), np.sin(ang)
    lo, hi = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], -1)


def _softmax_rows(q, keys, vals, q_pos, k_pos, theta, scale):
    """output [H_Q, d] and lse [H_Q] (log2) of one query over its visible keys, rope applied."""
    qr = _rotate(q.astype(np.float64), np.full(q.shape[0], q_pos, np.float64), theta, scale)
    kr = _rotate(keys.astype(np.float64), np.broadcast_to(k_pos[:, None], keys.shape[:2]).astype(np.float64),
                 theta, scale)
    out, lse = np.zeros(q.shape), np.full(q.shape[0], -5e4)
    for h in range(H_Q):
        if len(keys):
            s = kr[:, h // (H_Q // H_KV)] @ qr[h] * SCALE * np.log2(np.e)
            p = np.exp2(s - s.max())
            out[h] = p @ vals[:, h // (H_Q // H_KV)].astype(np.float64) / p.sum()
            lse[h] = s.max() + np.log2(p.sum())
    return out, lse


def _run(func, args, n_rows: int, d: int, scalars) -> tuple[np.ndarray, np.ndarray]:
    out = tvm.runtime.tensor(np.full((n_rows, H_Q, d), np.nan, "float32"))
    lse = tvm.runtime.tensor(np.full((n_rows, H_Q), np.nan, "float32"))
    func(*[tvm.runtime.tensor(a) for a in args], out, lse, *scalars)
    return out.numpy(), lse.numpy()


def _check_ragged(lens: list[int], offsets: list[int], d: int, theta: float, scale: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    tvms, ours = _compiled(d)[RAGGED]
    total = sum(lens)
    q, k, v = (rng.standard_normal((total, h, d)).astype("float32") for h in (H_Q, H_KV, H_KV))
    indptr = np.cumsum([0] + lens).astype("int32")
    k_off = np.asarray(offsets, "int32")
    q_pos = np.concatenate([k_off[b] + np.arange(n) for b, n in enumerate(lens)] + [np.zeros(0)]).astype("int32")
    want_out, want_lse = np.zeros((total, H_Q, d)), np.zeros((total, H_Q))
    for b, n in enumerate(lens):
        for i in range(n):
            row, keys = indptr[b] + i, slice(indptr[b], indptr[b] + i + 1)  # causal
            want_out[row], want_lse[row] = _softmax_rows(q[row], k[keys], v[keys], q_pos[row],
                                                         k_off[b] + np.arange(i + 1), theta, scale)
    args = [q, indptr, k, v, indptr, q_pos, k_off]
    for func in (ours, tvms):
        got_out, got_lse = _run(func, args, total, d, (1, 1, scale, theta, SCALE))
        np.testing.assert_allclose(got_out, want_out, atol=3e-5, rtol=1e-5)
        np.testing.assert_allclose(got_lse, want_lse, atol=3e-5, rtol=1e-5)


def _paged_case(rng, seqs, d):
    """seqs: (n_q, n_slots, offset, sink, k_off): n_slots slots written, the window from slot
    `offset`, the first `sink` slots a sink, the first key at position k_off."""
    n_pages = [(n + PAGE - 1) // PAGE for _, n, *_ in seqs]
    total = sum(n_pages)
    order = rng.permutation(total + 3).astype("int32")[:total]
    indptr = np.cumsum([0] + n_pages).astype("int32")
    info = np.zeros((3, len(seqs)), "int32")
    pages = rng.standard_normal((total + 3, 2, H_KV, PAGE, d)).astype("float32") * 2
    pages[np.setdiff1d(np.arange(total + 3), order)] = np.nan
    keys = []
    for b, (_, n, offset, sink, _) in enumerate(seqs):
        info[:, b] = (n - (n_pages[b] - 1) * PAGE if n_pages[b] else 0, offset, sink)
        for s in range(n_pages[b] * PAGE):
            if not (s < sink or offset <= s < n):
                pages[order[indptr[b] + s // PAGE], :, :, s % PAGE] = np.nan
        slots = list(range(min(sink, n))) + list(range(max(offset, sink), n)) if n_pages[b] else []
        keys.append(np.stack([pages[order[indptr[b] + s // PAGE], :, :, s % PAGE] for s in slots], 1) if slots
                    else np.zeros((2, 0, H_KV, d), "float32"))
    return pages, indptr, order, info, keys


def _check_paged(kind: str, seqs, d: int, theta: float, scale: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    tvms, ours = _compiled(d)[SLIDING_PREFILL_NAME if kind == "prefill" else SLIDING_DECODE_NAME]
    pages, indptr, order, info, keys = _paged_case(rng, seqs, d)
    q_lens = [s[0] for s in seqs] if kind == "prefill" else [1] * len(seqs)
    total = sum(q_lens)
    q = rng.standard_normal((total, H_Q, d)).astype("float32")
    k_off = np.asarray([s[4] for s in seqs], "int32")
    q_pos = np.concatenate([k_off[b] + keys[b].shape[1] + np.arange(n) for b, n in enumerate(q_lens)]).astype("int32")
    want_out, want_lse = np.zeros((total, H_Q, d)), np.zeros((total, H_Q))
    row = 0
    for b, n in enumerate(q_lens):
        n_kv = keys[b].shape[1]
        for i in range(n):
            lo = max(n_kv - max(W - i - 1, 0), 0) if kind == "prefill" else 0  # always masked per query
            want_out[row], want_lse[row] = _softmax_rows(q[row], keys[b][0, lo:], keys[b][1, lo:], q_pos[row],
                                                         k_off[b] + np.arange(lo, n_kv), theta, scale)
            row += 1
    head = [q, np.cumsum([0] + q_lens).astype("int32")] if kind == "prefill" else [q]
    args = head + [pages, indptr, order, info, k_off, q_pos]
    seen = want_lse > -4e4
    for func in (ours, tvms):
        scalars = (1, 1, scale, theta, SCALE) if kind == "prefill" else (1, scale, theta, SCALE)
        got_out, got_lse = _run(func, args, total, d, scalars)
        if func is ours:  # no key: output 0, lse -5e4
            np.testing.assert_allclose(got_out, want_out, atol=3e-5, rtol=1e-5)
            np.testing.assert_allclose(got_lse, want_lse, atol=3e-5, rtol=1e-5)
        else:  # TVM's: only where a key is seen
            np.testing.assert_allclose(got_out[seen], want_out[seen], atol=3e-5, rtol=1e-5)
            np.testing.assert_allclose(got_lse[seen], want_lse[seen], atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("d", [16, 32])
def test_ragged_prefill(d):
    _check_ragged([5, 24, 1], [3, 0, 40], d, 1e4, 1.0, seed=d)


@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("seqs", [
    [(5, 7, 0, 0, 0)],  # before the first slide: every key seen by the first queries
    [(3, 40, 17, 0, 0), (8, 23, 0, 0, 2), (1, 12, 3, 2, 0)],  # a window from mid-page; a key offset; a sink
    [(4, 0, 0, 0, 0), (24, 23, 0, 0, 0)]])  # no cached key; a whole window's chunk after 23 kept
def test_paged_prefill_and_decode(seqs, d):
    _check_paged("prefill", seqs, d, 1e4, 1.0, seed=len(seqs))
    _check_paged("decode", seqs, d, 1e4, 1.0, seed=len(seqs) + 1)


@settings(max_examples=15, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(1, W), st.integers(0, 40), st.integers(0, 40), st.integers(0, 3),
                               st.integers(0, 4)), min_size=1, max_size=3),
       theta=st.sampled_from([1e4, 5e5, 1e6]), scale=st.sampled_from([1.0, 0.5]), seed=st.integers(0, 2**16))
def test_any_window_matches(seqs, theta, scale, seed):
    """Offsets, sinks, key offsets and rope bases anywhere the table reaches (distances below 2W)."""
    fitted = []
    for n_q, n, off, sink, k_off in seqs:
        off, sink = min(off, n), min(sink, off, n)
        n_kv = n - off + sink if n else 0
        fitted.append((min(n_q, 2 * W - n_kv), n, off, sink, k_off))
    _check_paged("prefill", fitted, 32, theta, scale, seed)
    _check_paged("decode", fitted, 32, theta, scale, seed)
    _check_ragged([s[0] for s in fitted], [s[4] for s in fitted], 16, theta, scale, seed)


def test_a_distance_past_the_table_is_refused():
    """A query 2W or more from a key it reads fails loudly, never reads past the table."""
    _, ours = _compiled(16)[SLIDING_DECODE_NAME]
    rng = np.random.default_rng(0)
    pages, indptr, order, info, _ = _paged_case(rng, [(1, 10, 0, 0, 0)], 16)
    q = rng.standard_normal((1, H_Q, 16)).astype("float32")
    with pytest.raises(Exception, match="distances below 48"):
        _run(ours, [q, pages, indptr, order, info, np.zeros(1, "int32"), np.array([2 * W], "int32")], 1, 16,
             (1, 1.0, 1e4, SCALE))
    with pytest.raises(Exception, match="rotary_mode 1"):
        _run(ours, [q, pages, indptr, order, info, np.zeros(1, "int32"), np.array([10], "int32")], 1, 16,
             (0, 1.0, 1e4, SCALE))


def test_the_cpu_pass_takes_the_freeing_kernels_only():
    """The schedule pass gives the freeing cache's kernels (window read from its prefill's mask)
    the parallel inline-rope ones at head dims of 16s, leaves them TVM's otherwise, and the
    manifest's record says which."""
    for d, parallel in ((32, True), (12, False)):
        mod = tvm.IRModule({name + FREEING_SUFFIX: func for name, func in _tvm_kernels(d).items()})
        with tvm.target.Target("llvm"):
            out = cpu_schedule_pass()(mod)
        for name in (RAGGED, SLIDING_PREFILL_NAME, SLIDING_DECODE_NAME):
            text = out[name + FREEING_SUFFIX].script()
            assert ("applies rope inline" in text) is parallel, (d, name)
            assert ("T.parallel" in text) is parallel, (d, name)
        assert window_freeing_kernels(d) == ("parallel" if parallel else "serial")
    # the same kernels under TVM's own names are the per-layer cache's: never given inline rope
    assert rewrite_inline_rope(RAGGED, _tvm_kernels(32)[RAGGED], W) is None
