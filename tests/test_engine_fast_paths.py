"""The engine's per-token fast paths give exactly what the general paths give (issue #16: decode
through the engine within 5% of the model step).

Each fast path is checked bit for bit against the general path it short-cuts, which the test
forces: a row nothing edits sampled like one a logits processor touches (the copy, the in-place
temperature, the maximum taken again, the logsumexp computed apart), top_p over the whole row
rather than over its first buckets, token ids uploaded through `upload` rather than the CPU slot,
the incremental detokenizer decoding both of its windows every time, a request's tokens sliced out
of all_ids. Same tokens, logprobs (==, not approx), ranks, top logprobs, text and Generator state.
"""
from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.sampling import host
from vtool.runtime.sampling.host import SequenceSampler, sample_batch
from vtool.runtime.sampling.params import SamplingParams

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                            HealthCheck.function_scoped_fixture])


@contextlib.contextmanager
def general_paths():
    """Every fast path off: rows always go through process_logits, top_p always over the
    whole row, token ids through CompiledModel.upload."""
    from vtool.runtime.artifact.library import CompiledModel

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SequenceSampler, "needs_processing", lambda self: True)
        mp.setattr(host, "_NUCLEUS_HEADS", ())
        mp.setattr(CompiledModel, "upload_ints",
                   lambda self, values, slot: self.upload(np.asarray(values, dtype=np.int32), slot=slot))
        yield


def results_of(results) -> list[tuple]:
    return [(r.token_id, r.logprob, r.rank, r.top_logprobs) for r in results]


KINDS = st.sampled_from(["plain", "ties", "masked", "peaked", "offset"])


def row(rng: np.random.Generator, vocab: int, scale: float, kind: str) -> np.ndarray:
    x = (rng.standard_normal(vocab) * scale).astype(np.float32)
    if kind == "ties":
        x = np.round(x, 1)
    elif kind == "masked":
        x[rng.integers(0, vocab, 40)] = -np.inf
    elif kind == "peaked":  # a few live tokens far above the rest, as a confident model's row
        x[rng.integers(0, vocab, 5)] += np.float32(25.0)
    elif kind == "offset":  # large logits: float32 spacing near the bucket width
        x += np.float32(rng.choice([1e4, -3e5, 2e9]))
    return x


PARAMS = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.3, 0.8, 1.0, 1.6]),
    "top_p": st.sampled_from([1.0, 0.5, 0.9, 0.95, 0.999, 0.99999]),
    "top_k": st.sampled_from([0, 0, 40]),
    "min_p": st.sampled_from([0.0, 0.0, 0.05]),
    "logprobs": st.sampled_from([None, None, 0, 3]),
})


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([3000, 20000, 49152, 50257]),
       scale=st.sampled_from([0.7, 3.0, 12.0]), kind=KINDS,
       kw=PARAMS, batch=st.integers(1, 3))
def test_sample_batch_fast_paths_equal_the_general_path(seed, vocab, scale, kind, kw, batch):
    rng = np.random.default_rng(seed)
    logits = np.stack([row(rng, vocab, scale, kind) for _ in range(batch)])
    params = SamplingParams(seed=seed % 1000, **kw)
    fast = [SequenceSampler(copy.deepcopy(params), [1, 2, 3], [0], vocab) for _ in range(batch)]
    general = [SequenceSampler(copy.deepcopy(params), [1, 2, 3], [0], vocab) for _ in range(batch)]
    for _ in range(3):
        got = results_of(sample_batch(logits, fast))
        with general_paths():
            want = results_of(sample_batch(logits, general))
        assert got == want
        logits = logits[:, ::-1].copy()  # another row, the same Generators moving on
    assert [s.output_token_ids for s in fast] == [s.output_token_ids for s in general]
    assert [s.rng.bit_generator.state for s in fast] == [s.rng.bit_generator.state for s in general]


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([100, 3000, 49152]),
       scale=st.sampled_from([0.7, 3.0, 12.0]), kind=KINDS,
       kw=PARAMS, temperature=st.floats(0.011, 2.0))
def test_prescaled_row_gives_the_general_weights(seed, vocab, scale, kind, kw, temperature):
    # the temperature applied in the copy, and the maximum taken from the raw row: the same w
    rng = np.random.default_rng(seed)
    raw = row(rng, vocab, scale, kind)
    p = SamplingParams(**{**kw, "temperature": temperature})
    x, m = host._scaled_copy(raw, raw.max(), p, host._Scratch(vocab))
    copied = raw.copy()
    copied /= np.float32(p.sampling_temperature)  # what filtered_weights does to process_logits' copy
    np.testing.assert_array_equal(x, copied)
    assert m == copied.max() and m.dtype == copied.max().dtype
    fast = host._filtered(x, p, host._Scratch(vocab), scaled_max=m)
    general = host._filtered(raw.copy(), p, host._Scratch(vocab))
    for a, b in zip(fast, general):
        if a is None or b is None:
            assert a is None and b is None
        else:
            np.testing.assert_array_equal(a, b)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([8193, 32000, 49152, 151936]),
       scale=st.sampled_from([0.5, 2.0, 6.0, 20.0]), kind=KINDS,
       top_p=st.floats(0.01, 0.99999), temperature=st.sampled_from([0.5, 1.0, 1.5]))
def test_nucleus_head_equals_the_whole_row(seed, vocab, scale, kind, top_p, temperature):
    rng = np.random.default_rng(seed)
    x = row(rng, vocab, scale, kind) / np.float32(temperature)
    m = x.max()
    e_fast, s_fast = np.exp(x - m), host._Scratch(vocab)
    e_full, s_full = e_fast.copy(), host._Scratch(vocab)
    total = host._nucleus_dense(x, m, e_fast, top_p, s_fast)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host, "_NUCLEUS_HEADS", ())
        total_full = host._nucleus_dense(x, m, e_full, top_p, s_full)
    np.testing.assert_array_equal(e_fast, e_full)
    assert total == total_full == np.exp(x - m).sum(dtype=np.float64)
    # and the sorted definition it stands for
    np.testing.assert_array_equal(e_fast, np.exp(x - m) * host._nucleus_sorted(x, np.exp(x - m), top_p))


def test_nucleus_falls_back_when_the_head_does_not_hold_the_crossing():
    # logits near 2e9: float32 spacing (128) exceeds the head's threshold, which proves nothing there
    x = np.full(20000, np.float32(2e9), np.float32)
    x[::7] -= np.float32(128)
    x[::13] -= np.float32(256)
    m, s = x.max(), host._Scratch(x.size)
    threshold = m - np.float32(1025 / host._NUCLEUS_SCALE)
    assert host._buckets(m, np.asarray([threshold], np.float32))[0] < 1024  # the head refuses this row
    e = np.exp(x - m)
    assert not host._nucleus_head(x, m, e.copy(), 0.5 * e.sum(dtype=np.float64), 1024, s)
    host._nucleus_dense(x, m, e, 0.5, s)
    np.testing.assert_array_equal(e, np.exp(x - m) * host._nucleus_sorted(x, np.exp(x - m), 0.5))


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_shared_logsumexp_is_the_one_raw_logprobs_computes(top_p):
    # temperature 1: the sampling weights' sum gives the chosen token's logprob
    rng = np.random.default_rng(3)
    raw = (rng.standard_normal((1, 49152)) * 3).astype(np.float32)
    seq = SequenceSampler(SamplingParams(temperature=1.0, top_p=top_p, seed=5, logprobs=0), [1], [0], 49152)
    (result,) = sample_batch(raw, [seq])
    r = raw[0]
    lse = float(r.max()) + float(np.log(np.exp(r - r.max()).sum(dtype=np.float64)))
    assert result.logprob == float(r[result.token_id]) - lse


def test_penalty_state_is_kept_only_for_requests_with_penalties():
    plain = SequenceSampler(SamplingParams(temperature=0.0), [5, 6, 7], [0], 100)
    for t in (1, 5, 1):
        plain.append_token(t)
    assert plain._seen == set() and plain._counts == {} and not plain.needs_processing()
    penalised = SequenceSampler(SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
                                [5, 6, 7], [0], 100)
    for t in (1, 5, 1):
        penalised.append_token(t)
    assert penalised._seen == {1, 5, 6, 7} and sorted(penalised._seen_ids.tolist()) == [1, 5, 6, 7]
    assert penalised._counts == {1: 2, 5: 1} and penalised.needs_processing()


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, 9), min_size=1, max_size=6), output=st.lists(st.integers(10, 19), max_size=6),
       data=st.data())
def test_token_slice_equals_slicing_all_ids(prompt, output, data):
    from vtool.runtime.engine.request import Request

    request = Request("r", prompt, SamplingParams(), 16, SequenceSampler(SamplingParams(), prompt, None, 32),
                      output_ids=output)
    total = len(prompt) + len(output)
    start = data.draw(st.integers(0, total - 1))
    n = data.draw(st.integers(1, total - start + 2))
    assert request.token_slice(start, n) == tuple(request.all_ids[start:start + n])


# -- the detokenizer: its cached window text against decoding both windows every time ---------------

def reference_stream(tok, ids: list[int], prompt: list[int], skip: bool) -> list[str]:
    """IncrementalDetokenizer's algorithm without the cache (as it was before it)."""
    decode = lambda xs: tok.decode(xs, skip_special_tokens=skip)
    all_ids, prefix, read, out = list(prompt), max(len(prompt) - 5, 0), len(prompt), []
    for token in ids:
        all_ids.append(token)
        before, now = decode(all_ids[prefix:read]), decode(all_ids[prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            out.append("")
            continue
        prefix, read = read, len(all_ids)
        out.append(now[len(before):])
    before, now = decode(all_ids[prefix:read]), decode(all_ids[prefix:])
    return out + [now[len(before):]]


@SETTINGS
@given(ids=st.lists(st.one_of(st.integers(0, 49151), st.sampled_from([0, 1, 2, 28, 216, 9159, 124, 216])),
                    max_size=40),
       prompt=st.lists(st.integers(0, 49151), max_size=8), skip=st.booleans(), text=st.text(max_size=20))
def test_incremental_detokenizer_equals_decoding_both_windows(tiny_session, ids, prompt, skip, text):
    tok = tiny_session.tokenizer
    ids = tok.encode(text, add_special_tokens=False) + ids  # real multi-byte characters too
    detok = tok.incremental(skip, prompt)
    got = [detok.push(t) for t in ids] + [detok.flush()]
    assert got == reference_stream(tok, ids, prompt, skip)


def test_text_stage_hides_a_stop_token_among_several(tiny_session):
    from vtool.runtime.engine.request import CoreOutput
    from vtool.runtime.engine.text_stage import TextStage

    tok = tiny_session.tokenizer
    ids = tok.encode(" one two three", add_special_tokens=False)
    stage = TextStage(tok, [1, 2], SamplingParams())
    out = stage.process(CoreOutput("r", ids + [tok.eos_id], [], "stop", None, 2, len(ids) + 1, 0, -1.0,
                                   stop_token=True))
    assert out.new_text == " one two three" and out.finished and stage.num_output_tokens == len(ids) + 1


# -- the engine end to end: fast paths against general ones ----------------------------------------

def run_engine(session, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple]:
    engine = Engine(session, EngineConfig(max_num_seqs=4, enable_prefix_caching=False))
    for i, (ids, params) in enumerate(requests):
        engine.add_request(f"r{i}", ids, copy.deepcopy(params))
    got: dict[str, list] = {f"r{i}": [] for i in range(len(requests))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append((out.new_token_ids, out.new_text, out.new_logprobs, out.cumulative_logprob,
                                        out.finish_reason))
    assert engine.kv.in_sync()
    return [got[f"r{i}"] for i in range(len(requests))]


ENGINE_PARAMS = st.sampled_from([
    {"temperature": 0.0}, {"temperature": 0.0, "logprobs": 2}, {"temperature": 1.0},
    {"temperature": 1.0, "top_p": 0.9}, {"temperature": 0.8, "top_p": 0.95}, {"temperature": 0.7, "top_k": 20},
    {"temperature": 1.0, "top_p": 0.8, "logprobs": 1}, {"temperature": 0.9, "min_p": 0.1, "top_p": 0.9},
    {"temperature": 0.0, "repetition_penalty": 1.2},
])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=3),
       kws=st.lists(ENGINE_PARAMS, min_size=3, max_size=3), seed=st.integers(0, 10_000))
def test_engine_fast_paths_give_the_general_paths_outputs(tiny_session, prompts, kws, seed):
    tok = tiny_session.tokenizer
    encoded = [tok.encode(p) for p in prompts]
    assume(all(encoded))  # text of control characters only encodes to nothing (transformers' too): refused
    requests = [(ids, SamplingParams(max_tokens=12, ignore_eos=True, seed=seed + i, **kws[i]))
                for i, ids in enumerate(encoded)]
    fast = run_engine(tiny_session, requests)
    with general_paths():
        general = run_engine(tiny_session, requests)
    assert fast == general


def test_upload_ints_equals_upload(tiny_session):
    m = tiny_session.model
    embed = m.function("embed")
    for ids in ([5], [7], [1, 2, 3], [9], [4, 4, 4, 4, 4], [3]):  # lengths change and come back
        got = m.to_numpy(embed(m.upload_ints(ids, "test-ids"), m.params)).copy()
        want = m.to_numpy(embed(m.upload(np.asarray(ids, dtype=np.int32)), m.params)).copy()
        np.testing.assert_array_equal(got, want)
    tensor = m.upload_ints([11, 12], "test-ids")
    assert np.from_dlpack(tensor).tolist() == [11, 12] and str(tensor.dtype) == "int32"
