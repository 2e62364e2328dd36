"""The batched sampler against vLLM's semantics, checked by property tests."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from vtool import VtoolError
from vtool.runtime.sampling.host import SequenceSampler, make_generator, prompt_logprobs, sample_batch
from vtool.runtime.sampling.params import SamplingParams, SamplingParamsError

FAST = settings(max_examples=60, deadline=None)


def rows(b: int | st.SearchStrategy = 1, v: int | st.SearchStrategy = 12):
    return st.tuples(_int(b), _int(v)).flatmap(
        lambda s: hnp.arrays(np.float32, s, elements=st.floats(-8, 8, width=32)))


def _int(x):
    return x if isinstance(x, st.SearchStrategy) else st.just(x)


def seq(prompt=(), eos=None, vocab=None, **kw) -> SequenceSampler:
    return SequenceSampler(SamplingParams(**kw), prompt, eos, vocab_size=vocab)


def one(logits: np.ndarray, s: SequenceSampler):
    return sample_batch(logits[None, :], [s])[0]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def unique_max(x: np.ndarray) -> bool:
    top = np.sort(x)[-2:]
    return x.size == 1 or top[1] - top[0] > 1e-3


# ---- greedy and its limits ------------------------------------------------------------


@FAST
@given(logits=rows(st.integers(1, 6), st.integers(1, 40)), t=st.sampled_from([0.0, 1e-6, 9.9e-6]),
       k=st.integers(-1, 5), p=st.floats(0.05, 1.0), min_p=st.floats(0, 1))
def test_greedy_is_exact_argmax(logits, t, k, p, min_p):
    # vLLM ignores top_k/top_p/min_p for greedy requests.
    seqs = [seq(temperature=t, top_k=k, top_p=p, min_p=min_p) for _ in logits]
    got = [r.token_id for r in sample_batch(logits, seqs)]
    assert got == [int(np.argmax(row)) for row in logits]


@FAST
@given(logits=rows(1, st.integers(2, 40)), t=st.floats(0.05, 2.0), seed=st.integers(0, 2**32))
def test_top_k_1_and_tiny_top_p_and_min_p_1_are_greedy(logits, t, seed):
    row = logits[0]
    assume(unique_max(row))
    want = int(np.argmax(row))
    for kw in ({"top_k": 1}, {"top_p": 1e-9}, {"min_p": 1.0}):
        s = seq(temperature=t, seed=seed, **kw)
        assert [one(row, s).token_id for _ in range(5)] == [want] * 5, kw


@FAST
@given(logits=rows(1, st.integers(2, 30)), t=st.floats(0.1, 2.0), min_p=st.floats(0.01, 0.99),
       seed=st.integers(0, 2**32))
def test_min_p_only_draws_tokens_above_the_threshold(logits, t, min_p, seed):
    row = logits[0]
    probs = np.exp(log_softmax(row / np.float32(t)))
    ratio = probs / probs.max()
    assume(np.all(np.abs(ratio - min_p) > 1e-4))  # stay off the float boundary
    s = seq(temperature=t, min_p=min_p, seed=seed)
    for _ in range(20):
        assert ratio[one(row, s).token_id] >= min_p


@FAST
@given(logits=rows(1, st.integers(2, 30)), k=st.integers(1, 30), p=st.floats(0.01, 1.0),
       seed=st.integers(0, 2**32))
def test_top_k_top_p_support(logits, k, p, seed):
    row = logits[0]
    kth = np.sort(row)[::-1][min(k, row.size) - 1]
    allowed_k = row >= kth  # ties at the cut stay, as in vLLM
    probs = np.exp(log_softmax(np.where(allowed_k, row, -np.inf)))
    order = np.argsort(-row, kind="stable")  # vLLM sorts logits (near-equal ones may share a prob)
    before = np.cumsum(probs[order]) - probs[order]
    assume(np.all(np.abs(before - p) > 1e-6))
    allowed = np.zeros(row.size, bool)
    allowed[order[before < p]] = True
    s = seq(temperature=1.0, top_k=k, top_p=p, seed=seed)
    for _ in range(20):
        assert allowed[one(row, s).token_id]


# ---- processing: bias, min_tokens, penalties ------------------------------------------


def reference_penalties(raw, prompt, output, rep, freq, pres):
    """vLLM's apply_penalties written out: repetition on prompt+output tokens (positive
    logits divided, others multiplied), then frequency * count and presence on output tokens."""
    x = raw.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t, c in Counter(output).items():
        x[t] -= freq * c
        x[t] -= pres
    return x


@settings(max_examples=150, deadline=None)
@given(logits=rows(1, 16), prompt=st.lists(st.integers(0, 15), max_size=8),
       output=st.lists(st.integers(0, 15), max_size=8), rep=st.floats(0.1, 3.0),
       freq=st.floats(-2, 2), pres=st.floats(-2, 2))
def test_penalties_match_reference(logits, prompt, output, rep, freq, pres):
    raw = logits[0]
    s = seq(prompt=prompt, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
            temperature=0.0)
    for t in output:
        s.append_token(t)
    want = reference_penalties(raw, prompt, output, rep, freq, pres)
    np.testing.assert_allclose(s.process_logits(raw), want, rtol=1e-5, atol=1e-5)
    if unique_max(want):
        assert one(raw, s).token_id == int(np.argmax(want))


def test_presence_and_frequency_ignore_the_prompt():
    raw = np.zeros(4, np.float32)
    s = seq(prompt=[1, 1, 2], frequency_penalty=1.0, presence_penalty=0.5, temperature=0)
    np.testing.assert_array_equal(s.process_logits(raw), raw)
    s.append_token(3)
    s.append_token(3)
    np.testing.assert_allclose(s.process_logits(raw), [0, 0, 0, -2.5])


@FAST
@given(logits=rows(1, st.integers(2, 30)), data=st.data(), t=st.sampled_from([0.0, 0.7, 1.0, 2.0]),
       seed=st.integers(0, 2**32))
def test_logit_bias_forces_and_forbids(logits, data, t, seed):
    row = logits[0]
    forced = data.draw(st.integers(0, row.size - 1))
    s = seq(logit_bias={forced: 100.0}, temperature=t, seed=seed, vocab=row.size)
    assert all(one(row, s).token_id == forced for _ in range(10))
    banned = data.draw(st.integers(0, row.size - 1))
    s = seq(logit_bias={banned: -100.0}, temperature=t, seed=seed)
    assert all(one(row, s).token_id != banned for _ in range(10))


@FAST
@given(min_tokens=st.integers(0, 6), eos=st.integers(0, 7), stop_id=st.integers(0, 7),
       t=st.sampled_from([0.0, 1.0]), ignore_eos=st.booleans())
def test_min_tokens_masks_eos_and_stop_ids(min_tokens, eos, stop_id, t, ignore_eos):
    row = np.zeros(8, np.float32)
    row[eos] = row[stop_id] = 50.0  # the model wants to stop at once
    s = seq(eos=eos, min_tokens=min_tokens, stop_token_ids=[stop_id], temperature=t, seed=1,
            ignore_eos=ignore_eos, max_tokens=None)
    for _ in range(min_tokens):
        token = one(row, s).token_id
        assert token not in (eos, stop_id)
        assert not s.is_stop_token(token)
    token = one(row, s).token_id
    assert token in (eos, stop_id)
    assert s.is_stop_token(token) == (token == stop_id or not ignore_eos)


# ---- reproducibility --------------------------------------------------------------------


request_params = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    "top_k": st.sampled_from([0, 3, 8]),
    "top_p": st.sampled_from([1.0, 0.9, 0.5]),
    "min_p": st.sampled_from([0.0, 0.05]),
    "repetition_penalty": st.sampled_from([1.0, 1.3]),
    "frequency_penalty": st.sampled_from([0.0, 0.5]),
    "presence_penalty": st.sampled_from([0.0, -0.5]),
    "seed": st.integers(0, 2**40),
    "min_tokens": st.integers(0, 3),
    "max_tokens": st.just(None),
})


@settings(max_examples=40, deadline=None)
@given(params=request_params, others=st.lists(request_params, max_size=5), data=st.data(),
       steps=st.integers(1, 6), prompt=st.lists(st.integers(0, 19), max_size=5))
def test_seeded_request_ignores_its_batch(params, others, data, steps, prompt):
    vocab = 20
    step_logits = [data.draw(rows(1, vocab))[0] for _ in range(steps)]
    alone = seq(prompt=prompt, eos=0, **params)
    want = [one(x, alone).token_id for x in step_logits]

    batched = seq(prompt=prompt, eos=0, **params)
    mates = [seq(prompt=prompt, eos=1, **o) for o in others]
    for o in data.draw(st.lists(st.sampled_from([None, 7]), min_size=1, max_size=3)):
        mates.append(seq(temperature=1.0, seed=o))  # unseeded mates too
    got = []
    for x in step_logits:
        present = data.draw(st.lists(st.sampled_from(mates), max_size=len(mates), unique_by=id))
        pos = data.draw(st.integers(0, len(present)))
        batch = present[:pos] + [batched] + present[pos:]
        logits = data.draw(rows(len(batch), vocab))
        logits[pos] = x
        got.append(sample_batch(logits, batch)[pos].token_id)
    assert got == want


def test_seeds_and_children():
    row = np.zeros(1000, np.float32)
    draw = lambda s: [one(row, s).token_id for _ in range(8)]  # noqa: E731
    assert draw(seq(seed=5)) == draw(seq(seed=5))
    assert draw(seq(seed=5)) != draw(seq(seed=6))
    assert draw(seq()) != draw(seq())  # unseeded requests get different streams
    parent = SamplingParams(n=3, seed=10)
    assert [parent.for_child(i).seed for i in range(3)] == [10, 11, 12]
    assert all(parent.for_child(i).n == 1 for i in range(3))
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"
    make_generator(-5).random()  # torch accepts negative seeds, so we do too


# ---- the sampled distribution ----------------------------------------------------------


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token of probability zero"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("kw, support", [
    ({"temperature": 1.0}, None),
    ({"temperature": 0.6, "top_k": 4}, 4),
    ({"temperature": 1.3, "top_p": 0.8}, "p"),
    ({"temperature": 1.0, "min_p": 0.2}, "min_p"),
])
def test_sampled_frequencies(kw, support):
    raw = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5], np.float32)
    t = kw["temperature"]
    probs = np.exp(log_softmax(raw / np.float32(t)))
    if support == 4:
        probs[4:] = 0
    elif support == "p":
        before = np.cumsum(probs) - probs  # raw is sorted descending
        probs[before >= kw["top_p"]] = 0
    elif support == "min_p":
        probs[probs < kw["min_p"] * probs.max()] = 0
    probs /= probs.sum()
    seqs = [seq(seed=1000 + i, **kw) for i in range(400)]
    counts = np.zeros(raw.size)
    batch = np.tile(raw, (len(seqs), 1))
    for _ in range(10):
        for r in sample_batch(batch, seqs):
            counts[r.token_id] += 1
    dof = int((probs > 0).sum()) - 1
    # 99.9th percentile of chi-square for dof 1..5; the seeds are fixed so this is deterministic.
    assert chi_square(counts, probs) < [10.83, 13.82, 16.27, 18.47, 20.52][dof - 1]


# ---- large vocabularies: the paths that avoid sorting 150k logits ------------------------


def large_row(seed: int, vocab: int, scale: float, ties: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(vocab) * scale).astype(np.float32)
    if ties:
        row = np.round(row, 1)  # many equal logits, ties at every cut
    row[rng.integers(0, vocab, 50)] = -np.inf  # masked tokens (e.g. padded vocabulary)
    return row


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), scale=st.sampled_from([0.5, 3.0, 15.0]), ties=st.booleans(),
       k=st.integers(1, 3000), top_p=st.floats(0.01, 0.999))
def test_large_vocab_filters_match_sorting(seed, scale, ties, k, top_p):
    from vtool.runtime.sampling.host import _nucleus_dense, _nucleus_sorted, _Scratch, _top_k_indices
    x = large_row(seed, 20000, scale, ties)
    m = x.max()
    s = _Scratch(x.size)
    kth = np.sort(x)[-k]
    np.testing.assert_array_equal(_top_k_indices(x, m, k, s), np.flatnonzero(x >= kth))
    e = np.exp(x - m)
    want = e * _nucleus_sorted(x, e, top_p)
    _nucleus_dense(x, m, e, top_p, s)
    np.testing.assert_array_equal(e, want)


@pytest.mark.parametrize("kw", [{}, {"top_k": 5}, {"top_p": 0.95}, {"min_p": 0.01}])
def test_large_vocab_frequencies(kw):
    # Six live tokens spread over the blocks of the inverse-CDF draw; the rest weigh e^-60.
    vocab, live = 40000, np.array([3, 1500, 9000, 17001, 30000, 39999])
    raw = np.full(vocab, -60.0, np.float32)
    raw[live] = [1.0, 0.5, 0.0, -0.5, -1.0, -1.5]
    probs = np.exp(log_softmax(raw[live]))
    seqs = [seq(seed=7000 + i, **kw) for i in range(100)]
    counts = np.zeros(live.size)
    batch = np.tile(raw, (len(seqs), 1))
    for _ in range(20):
        for r in sample_batch(batch, seqs):
            assert r.token_id in live
            counts[np.searchsorted(live, r.token_id)] += 1
    if "top_k" in kw:
        probs[5:] = 0
    if "top_p" in kw:
        probs[np.cumsum(probs) - probs >= kw["top_p"]] = 0  # the last token: 0.966 before it
    probs /= probs.sum()
    assert chi_square(counts, probs) < 20.52  # chi-square 99.9th percentile, dof <= 5


# ---- logprobs ------------------------------------------------------------------------------


@FAST
@given(logits=rows(st.integers(1, 4), st.integers(1, 30)), data=st.data())
def test_logprobs_are_raw_log_softmax(logits, data):
    vocab = logits.shape[1]
    n = data.draw(st.integers(-1, vocab))
    seqs = [seq(logprobs=n, temperature=data.draw(st.sampled_from([0.0, 0.5, 1.5])),
                logit_bias={0: 5.0}, repetition_penalty=1.5, prompt=[0, 1 % vocab],
                seed=data.draw(st.integers(0, 99))) for _ in logits]
    for row, r in zip(logits, sample_batch(logits, seqs)):
        ref = log_softmax(row)  # before bias, penalties and temperature
        assert r.logprob == pytest.approx(ref[r.token_id], abs=1e-5)
        # 1 + the tokens more likely (up to float32 ties).
        assert np.sum(ref > ref[r.token_id] + 1e-6) < r.rank <= np.sum(ref >= ref[r.token_id] - 1e-6)
        want = vocab if n == -1 else n
        assert len(r.top_logprobs) == want
        ids = [t for t, _ in r.top_logprobs]
        values = np.array([v for _, v in r.top_logprobs])
        assert len(set(ids)) == want
        assert np.all(np.diff(values) <= 0)
        np.testing.assert_allclose(values, ref[ids], atol=1e-5)
        assert np.all(values.min(initial=np.inf) >= np.delete(ref, ids).max(initial=-np.inf) - 1e-6)
        d = r.logprobs_dict()
        assert r.token_id in d and len(d) in (want, want + 1)


def test_logprobs_none_and_zero():
    row = np.array([0.0, 3.0, 1.0], np.float32)
    r = one(row, seq(temperature=0))
    # no logprobs asked: none computed (vLLM v1 reports cumulative_logprob None then)
    assert r.top_logprobs is None and r.logprobs_dict() is None and r.logprob is None
    r = one(row, seq(temperature=0, logprobs=0))
    assert r.top_logprobs == [] and r.rank == 1
    assert list(r.logprobs_dict()) == [1]


@FAST
@given(logits=rows(st.integers(1, 6), st.integers(2, 20)), k=st.integers(-1, 3), data=st.data(),
       drop_last=st.booleans())
def test_prompt_logprobs(logits, k, data, drop_last):
    n, vocab = logits.shape
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n + (1 if drop_last else 0),
                             max_size=n + (1 if drop_last else 0)))
    out = prompt_logprobs(logits, ids, k)
    assert len(out) == len(ids) and out[0] is None
    for pos in range(1, len(ids)):
        ref = log_softmax(logits[pos - 1])
        entry = out[pos]
        assert ids[pos] in entry
        assert entry[ids[pos]].logprob == pytest.approx(ref[ids[pos]], abs=1e-5)
        want = vocab if k == -1 else min(k, vocab)
        assert len(entry) in (want, want + 1)
        for token, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[token], abs=1e-5)


def test_bad_logits_are_refused():
    with pytest.raises(VtoolError, match="NaN"):
        one(np.array([0.0, np.nan], np.float32), seq())
    with pytest.raises(VtoolError, match="shape"):
        sample_batch(np.zeros((2, 4), np.float32), [seq()])
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        one(np.zeros(4, np.float32), seq(logit_bias={9: 1.0}))  # id outside this vocabulary
    with pytest.raises(VtoolError, match="masked"):
        one(np.zeros(2, np.float32), seq(eos=0, stop_token_ids=[1], min_tokens=1))


# ---- validation ----------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
INVALID = {
    "n": st.one_of(st.integers(max_value=0), st.integers(min_value=16385), st.just(1.5), st.just(True)),
    "best_of": st.sampled_from([0, 2, 5, -1]),
    "presence_penalty": st.one_of(st.floats(2.0001, 1e6), st.floats(-1e6, -2.0001), st.sampled_from([NAN, INF])),
    "frequency_penalty": st.one_of(st.floats(2.0001, 1e6), st.floats(-1e6, -2.0001), st.just(NAN)),
    "repetition_penalty": st.one_of(st.floats(-1e6, 0.0), st.sampled_from([NAN, INF])),
    "temperature": st.one_of(st.floats(-1e6, -1e-9), st.floats(2.0001, 1e6), st.sampled_from([NAN, INF])),
    "top_p": st.one_of(st.floats(-1e6, 0.0), st.floats(1.0001, 1e6), st.just(NAN)),
    "top_k": st.one_of(st.integers(max_value=-2), st.just(2.0)),
    "min_p": st.one_of(st.floats(-1e6, -1e-9), st.floats(1.0001, 1e6), st.just(NAN)),
    "seed": st.one_of(st.integers(min_value=2**64), st.just(1.5)),
    "max_tokens": st.sampled_from([1.5, "16"]),
    "min_tokens": st.one_of(st.integers(max_value=-1), st.integers(17, 1000)),  # max_tokens stays 16
    "logprobs": st.one_of(st.integers(max_value=-2), st.just(2.5)),
    "prompt_logprobs": st.integers(max_value=-2),
    "stop": st.sampled_from([[""], ["ok", ""], [1], 5]),
    "stop_token_ids": st.sampled_from([[-1], [1.5], 3, "3"]),
    "logit_bias": st.one_of(st.fixed_dictionaries({st.just(3): st.one_of(
        st.floats(100.0001, 1e6), st.floats(-1e6, -100.0001), st.just(NAN))}), st.just({-1: 1.0}),
        st.just({"x": 1.0})),
    "ignore_eos": st.sampled_from([None, 1, "yes"]),
}


@settings(max_examples=300, deadline=None)
@given(data=st.data(), field=st.sampled_from(sorted(INVALID)))
def test_invalid_values_name_the_field(data, field):
    value = data.draw(INVALID[field])
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.field.split("[")[0] == field
    assert field in str(info.value)
    assert "must be" in str(info.value)


@FAST
@given(temperature=st.floats(0, 2), top_p=st.floats(0, 1, exclude_min=True), top_k=st.integers(-1, 100),
       min_p=st.floats(0, 1), pen=st.floats(-2, 2), rep=st.floats(0, 10, exclude_min=True),
       seed=st.none() | st.integers(-(2**63), 2**64 - 1), logprobs=st.none() | st.integers(-1, 20))
def test_valid_values_are_accepted(temperature, top_p, top_k, min_p, pen, rep, seed, logprobs):
    SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, presence_penalty=pen,
                   frequency_penalty=pen, repetition_penalty=rep, seed=seed, logprobs=logprobs).validate(100)


def test_vocab_dependent_checks():
    p = SamplingParams(logit_bias={"7": 1.0}, stop_token_ids=[3, 3], logprobs=-1, stop="END")
    assert p.logit_bias == {7: 1.0} and p.stop_token_ids == [3] and p.stop == ["END"]
    p.validate(8)
    for field, kw in [("logit_bias", {"logit_bias": {8: 1.0}}), ("stop_token_ids", {"stop_token_ids": [8]}),
                      ("logprobs", {"logprobs": 9}), ("prompt_logprobs", {"prompt_logprobs": 9})]:
        with pytest.raises(SamplingParamsError, match=field):
            SamplingParams(**kw).validate(8)
    with pytest.raises(SamplingParamsError, match="max_logprobs=20"):
        SamplingParams(logprobs=-1).validate(1000, max_logprobs=20)
    SamplingParams(logprobs=20).validate(1000, max_logprobs=20)
    with pytest.raises(SamplingParamsError, match="greedy"):
        SamplingParams(n=2, temperature=0)
    SamplingParams(n=2, best_of=2, max_tokens=0, min_tokens=100)  # max_tokens <= 0: up to the context
    assert math.isclose(SamplingParams(temperature=1e-3).sampling_temperature, 0.01)


@settings(max_examples=60, deadline=None)
@given(params=request_params, plain=st.booleans(), logprobs=st.sampled_from([None, 2, -1]), data=st.data())
def test_the_logits_given_are_never_written(params, plain, logprobs, data):
    """A temperature-1 row nothing edits is filtered and drawn from in place of a copy
    (runtime/sampling/host.py _scaled_copy): nothing may write into it, since the caller's array
    holds other rows and logits a request may return. `plain`: such a request (T = 1, no
    penalties, no min_tokens), with its filters; else any request."""
    if plain:
        params = {**params, "temperature": 1.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
                  "presence_penalty": 0.0, "min_tokens": 0}
    logits = data.draw(rows(st.integers(1, 4), st.sampled_from([3, 40, 9000])))
    before = logits.copy()
    seqs = [seq(prompt=[1, 2], eos=0, vocab=logits.shape[1], logprobs=logprobs, **params) for _ in logits]
    sample_batch(logits, seqs)
    np.testing.assert_array_equal(logits, before)
