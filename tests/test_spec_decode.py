"""Speculative decoding: --speculative-config is read as vLLM reads it, n-gram lookup finds
what a brute-force search finds, verification keeps greedy output identical and leaves the
sampling distribution unchanged (chi-square over many seeds), and the engine gives back every
KV block a rejected draft took, with the tiny model as target and as its own draft."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from vtool import VtoolError
from vtool.runtime.engine.decode_buckets import CAPTURED_VERIFY_ENTRY
from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.engine.ngram_proposer import NgramProposer, ngram_drafts
from vtool.runtime.engine.spec_config import (DEFAULT_DISABLE_BY_BATCH_SIZE, GPU_DRAFT_DISABLE_BY_BATCH_SIZE,
                                             batch_size_limit, parse_speculative_config)
from vtool.runtime.session import with_draft_built
from vtool.runtime.sampling.host import SequenceSampler
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.sampling.spec_verify import greedy_on_device, verify_drafts, verify_greedy_argmax


# -- --speculative-config ---------------------------------------------------------------------
def test_ngram_config_takes_vllms_defaults():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 5, 5)
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    assert c.disable_by_batch_size is None  # the device decides (batch_size_limit)


@pytest.mark.parametrize("raw,on_gpu,limit", [
    ({"method": "ngram", "num_speculative_tokens": 2}, False, DEFAULT_DISABLE_BY_BATCH_SIZE),
    ({"method": "ngram", "num_speculative_tokens": 2}, True, DEFAULT_DISABLE_BY_BATCH_SIZE),
    ({"model": "d", "num_speculative_tokens": 2}, False, DEFAULT_DISABLE_BY_BATCH_SIZE),
    ({"model": "d", "num_speculative_tokens": 2}, True, GPU_DRAFT_DISABLE_BY_BATCH_SIZE),
    ({"model": "d", "num_speculative_tokens": 2, "disable_by_batch_size": 6}, True, 6),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 3}, False, 3),
])
def test_the_batch_size_rule_depends_on_the_device_unless_given(raw, on_gpu, limit):
    # a draft model on a GPU pays for a request alone only (measured on an H100); the model's
    # device is all the rule reads (a real library answers on_gpu from its device)
    class Library:
        pass

    library = Library()
    library.on_gpu = on_gpu
    assert GPU_DRAFT_DISABLE_BY_BATCH_SIZE == 2 < DEFAULT_DISABLE_BY_BATCH_SIZE
    assert batch_size_limit(parse_speculative_config(raw), library) == limit


def test_a_model_alone_means_a_draft_model():
    c = parse_speculative_config({"model": "some/dir", "num_speculative_tokens": 4, "dtype": "float16"})
    assert (c.method, c.model, c.dtype, c.num_speculative_tokens) == ("draft_model", "some/dir", "float16", 4)


@pytest.mark.parametrize("raw, says", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key(s) lookahead"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "EAGLE draft head"),
    ({"method": "eagle3", "model": "x", "num_speculative_tokens": 2}, "EAGLE-3"),
    ({"method": "mtp", "num_speculative_tokens": 1}, "multi-token-prediction"),
    ({"method": "medusa", "num_speculative_tokens": 1}, "Medusa"),
    ({"method": "suffix", "num_speculative_tokens": 1}, "not one of ngram, draft_model"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be 1..16"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "above"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "belongs to a draft model"),
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "belongs to method \"ngram\""),
    ({"num_speculative_tokens": 2}, "needs \"method\""),
    ({"model": "x", "num_speculative_tokens": 2, "dtype": "int3"}, "dtype 'int3'"),
    ({"model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "must be 1"),
])
def test_bad_configs_are_refused_by_name(raw, says):
    with pytest.raises(VtoolError, match=None) as err:
        parse_speculative_config(raw)
    assert says in str(err.value)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["method", "model", "num_speculative_tokens", "prompt_lookup_max",
                                        "prompt_lookup_min", "disable_by_batch_size", "dtype", "bogus"]),
                       st.one_of(st.none(), st.integers(-3, 20), st.sampled_from(["ngram", "draft_model", "eagle",
                                                                                 "x", "auto", "float16"]))))
def test_any_config_is_taken_or_refused_with_a_vtool_error(raw):
    try:
        c = parse_speculative_config(json.dumps(raw))
    except VtoolError as err:
        assert "--speculative-config" in str(err)
        return
    assert c.method in ("ngram", "draft_model") and 1 <= c.num_speculative_tokens <= 16


def test_a_runtime_only_install_needs_the_drafts_artifact():
    c = parse_speculative_config({"model": "/nonexistent-draft", "num_speculative_tokens": 2})
    with pytest.raises(VtoolError):  # the hub resolver refuses a path that is not there, by name
        with_draft_built(c, "float32", None)


# -- n-gram lookup --------------------------------------------------------------------------------
def brute_force_ngram(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 6), st.integers(1, 4), st.integers(0, 3))
def test_ngram_lookup_equals_brute_force(tokens, k, lo, extra):
    hi = lo + extra
    assert ngram_drafts(np.asarray(tokens), k, lo, hi) == brute_force_ngram(tokens, k, lo, hi)


def test_ngram_proposes_the_continuation_of_repeated_text():
    text = [5, 6, 7, 8, 9, 10, 1, 2, 5, 6, 7]
    assert NgramProposer(3, 2, 3).propose(text, limit=8) == [8, 9, 10]
    assert NgramProposer(3, 2, 3).propose(text, limit=1) == [8]
    assert NgramProposer(3, 4, 4).propose(text, limit=8) == []


# -- verification ---------------------------------------------------------------------------------
def sampler(params: SamplingParams, vocab: int = 8) -> SequenceSampler:
    return SequenceSampler(params, [1, 2], eos_token_ids=None, vocab_size=vocab)


def test_greedy_keeps_the_longest_matching_prefix_then_the_targets_token():
    rows = np.full((4, 8), -5.0, np.float32)
    for j, best in enumerate([3, 4, 6, 7]):
        rows[j, best] = 5.0
    seq = sampler(SamplingParams(temperature=0, max_tokens=10))
    taken, accepted = verify_drafts(rows, [3, 4, 5], seq, room=4)
    assert [t.token_id for t in taken] == [3, 4, 6] and accepted == 2
    assert seq.output_token_ids == [3, 4, 6]
    seq = sampler(SamplingParams(temperature=0, max_tokens=10))
    taken, accepted = verify_drafts(rows, [3, 4, 6], seq, room=4)
    assert [t.token_id for t in taken] == [3, 4, 6, 7] and accepted == 3  # all kept: one more from the last row


def test_verification_stops_at_a_stop_token_and_at_the_room_left():
    rows = np.zeros((4, 8), np.float32)
    rows[:, 2] = 9.0
    seq = SequenceSampler(SamplingParams(temperature=0, max_tokens=10), [1], eos_token_ids=[2], vocab_size=8)
    taken, accepted = verify_drafts(rows, [2, 2, 2], seq, room=4)
    assert [t.token_id for t in taken] == [2] and accepted == 1
    seq = sampler(SamplingParams(temperature=0, max_tokens=10))
    taken, _ = verify_drafts(rows, [2, 2, 2], seq, room=2)
    assert len(taken) == 2


@settings(max_examples=200, deadline=None)
@given(data=st.data(), k=st.integers(0, 6), vocab=st.integers(2, 12), room=st.integers(1, 8),
       eos=st.one_of(st.none(), st.integers(0, 11)))
def test_verifying_from_the_devices_argmax_equals_verifying_the_rows(data, k, vocab, room, eos):
    """What a GPU verification does for a greedy request (the argmax and its raw logprob per
    row, drawn on the device) keeps exactly the tokens, logprobs and accepted count that
    verifying the whole rows on the host keeps, stop tokens and room included."""
    values = st.floats(-8, 8, allow_nan=False, width=32)
    rows = np.asarray(data.draw(st.lists(st.lists(values, min_size=vocab, max_size=vocab), min_size=k + 1,
                                         max_size=k + 1)), np.float32)
    best = rows.argmax(axis=1)
    # drafts mostly right, so long accepted runs are drawn too
    drafts = [int(best[j]) if data.draw(st.booleans()) or data.draw(st.booleans()) else
              data.draw(st.integers(0, vocab - 1)) for j in range(k)]
    stops = None if eos is None or eos >= vocab else [eos]
    params = SamplingParams(temperature=0, max_tokens=20)
    host = SequenceSampler(params, [1], eos_token_ids=stops, vocab_size=vocab)
    device = SequenceSampler(params, [1], eos_token_ids=stops, vocab_size=vocab)
    assert greedy_on_device(device)
    lse = np.log(np.exp(rows.astype(np.float64) - rows.max(axis=1, keepdims=True)).sum(axis=1)) + rows.max(axis=1)
    logprobs = rows[np.arange(k + 1), best] - lse
    want, want_kept = verify_drafts(rows, drafts, host, room)
    got, got_kept = verify_greedy_argmax(best.tolist(), logprobs.tolist(), drafts, device, room)
    assert [t.token_id for t in got] == [t.token_id for t in want] and got_kept == want_kept
    assert [t.logprob for t in got] == logprobs[:len(got)].tolist()
    assert all(t.logprob is None for t in want)  # the host computes none for a request without logprobs
    assert device.output_token_ids == host.output_token_ids


def test_only_plain_greedy_requests_verify_from_the_devices_argmax():
    assert greedy_on_device(sampler(SamplingParams(temperature=0)))
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=0, logprobs=2),
                   SamplingParams(temperature=0, repetition_penalty=1.2), SamplingParams(temperature=0, min_tokens=3),
                   SamplingParams(temperature=0, logit_bias={1: 2.0})):
        assert not greedy_on_device(sampler(params)), params
    with pytest.raises(VtoolError, match="3 argmax rows for 2 drafts"):
        verify_greedy_argmax([1, 2], [0.0, 0.0], [1, 2], sampler(SamplingParams(temperature=0)), room=3)


def test_penalties_see_the_drafts_kept_before_each_row():
    # Every row prefers token 3 a little; a repetition penalty of 4 makes token 3 lose once it
    # has been generated, so only the first draft 3 may be kept.
    rows = np.zeros((3, 8), np.float32)
    rows[:, 3], rows[:, 5] = 2.0, 1.0
    seq = sampler(SamplingParams(temperature=0, max_tokens=10, repetition_penalty=4.0))
    taken, accepted = verify_drafts(rows, [3, 3], seq, room=3)
    assert [t.token_id for t in taken] == [3, 5] and accepted == 1


VOCAB = 6
P_ROWS = np.log(np.array([[0.30, 0.25, 0.20, 0.15, 0.07, 0.03],
                          [0.05, 0.05, 0.50, 0.10, 0.20, 0.10],
                          [0.40, 0.10, 0.10, 0.10, 0.10, 0.20]], np.float32))
Q = np.array([[0.10, 0.50, 0.10, 0.10, 0.10, 0.10],
              [0.30, 0.10, 0.10, 0.30, 0.10, 0.10]])


def run_many(n: int, draft_from_q: bool, params: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First token counts, second-token counts when the first draft was kept, and the
    target distributions (after temperature/top-k) they must follow."""
    first = np.zeros(VOCAB)
    second = np.zeros(VOCAB)
    draw = np.random.default_rng(12345)
    for seed in range(n):
        seq = SequenceSampler(SamplingParams(seed=seed, max_tokens=10, **params), [0], vocab_size=VOCAB)
        if draft_from_q:
            drafts = [int(draw.choice(VOCAB, p=Q[0])), int(draw.choice(VOCAB, p=Q[1]))]
            taken, _ = verify_drafts(P_ROWS, drafts, seq, room=3, draft_probs=Q)
        else:
            drafts = [1, 2]  # an n-gram proposal: a point mass
            taken, _ = verify_drafts(P_ROWS, drafts, seq, room=3)
        first[taken[0].token_id] += 1
        if taken[0].token_id == drafts[0] and len(taken) > 1:
            second[taken[1].token_id] += 1
    from vtool.runtime.sampling.host import scratch_buffers, target_probs

    p = SamplingParams(max_tokens=10, **params)
    expect = [target_probs(P_ROWS[j].copy(), p, scratch_buffers(VOCAB)) for j in range(2)]
    return first, second, np.stack(expect)


@pytest.mark.parametrize("draft_from_q", [True, False], ids=["draft-model", "ngram"])
@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 4}],
                         ids=["t1", "t0.7-topk4"])
def test_speculative_sampling_leaves_the_distribution_unchanged(draft_from_q, params):
    first, second, expect = run_many(6000, draft_from_q, params)
    for counts, p in ((first, expect[0]), (second, expect[1])):
        support = p > 0
        assert counts[~support].sum() == 0, "a token outside top-k was emitted"
        stat = chisquare(counts[support], counts.sum() * p[support])
        assert stat.pvalue > 1e-3, (counts, p)


def test_a_wrong_distribution_is_caught_by_the_same_check():
    """The chi-square check above can fail: counts drawn from the draft itself are rejected."""
    draw = np.random.default_rng(0)
    counts = np.bincount(draw.choice(VOCAB, size=6000, p=Q[0]), minlength=VOCAB)
    p = np.exp(P_ROWS[0].astype(np.float64))
    assert chisquare(counts, 6000 * p / p.sum()).pvalue < 1e-3


def test_seeded_verification_is_reproducible():
    def once():
        seq = SequenceSampler(SamplingParams(seed=7, temperature=1.0, max_tokens=10), [0], vocab_size=VOCAB)
        return [t.token_id for t in verify_drafts(P_ROWS, [1, 2], seq, room=3, draft_probs=Q)[0]]
    assert once() == once()


# -- the engine -----------------------------------------------------------------------------------
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n", "Hi"]


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    guard = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        guard += 1
        assert guard < 5000
    return out


class OracleProposer:
    """Drafts from a known greedy continuation, wrong where `wrong(position)` says: exercises
    acceptance, rejection and KV rollback at chosen places."""

    def __init__(self, continuations: dict[str, list[int]], prompt_lens: dict[str, int], wrong, vocab: int):
        self.cont, self.lens, self.wrong, self.vocab = continuations, prompt_lens, wrong, vocab
        self.num_wrong = 0  # wrong drafts proposed

    def propose_batch(self, requests, limits) -> None:
        for request, limit in zip(requests, limits):
            done = len(request.all_ids) - self.lens[request.request_id]
            drafts = self.cont[request.request_id][done:done + limit]
            request.draft_ids = [(t + 1) % self.vocab if self.wrong(done + j) else t for j, t in enumerate(drafts)]
            self.num_wrong += sum(1 for j in range(len(drafts)) if self.wrong(done + j))

    def release(self, request) -> None:
        pass


@pytest.fixture(scope="module")
def prompts(tiny_session):
    return [tiny_session.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def baseline(tiny_session, prompts):
    return run(Engine(tiny_session, EngineConfig()), prompts, SamplingParams(temperature=0, max_tokens=24,
                                                                          ignore_eos=True))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(1, 6), wrong=st.frozensets(st.integers(0, 23), max_size=12), caching=st.booleans())
def test_greedy_output_is_identical_whatever_is_accepted(tiny_session, prompts, baseline, k, wrong, caching):
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": k})
    engine = Engine(tiny_session, EngineConfig(speculative=config, enable_prefix_caching=caching))
    engine.speculator.proposer = OracleProposer(baseline, {f"r{i}": len(p) for i, p in enumerate(prompts)},
                                                lambda pos: pos in wrong, engine.vocab_size)
    got = run(engine, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert got == baseline
    stats = engine.stats()
    assert stats["spec_num_drafts"] > 0
    rejected = stats["spec_num_draft_tokens"] - stats["spec_num_accepted_tokens"]
    assert (rejected > 0) == (engine.speculator.proposer.num_wrong > 0)
    assert rejected >= engine.speculator.proposer.num_wrong
    # without speculation: one prompt step and 23 decode steps; every kept draft saves one
    assert stats["steps"] <= 24 - stats["spec_num_accepted_tokens"] // len(prompts)
    assert engine.kv.in_sync() and engine.kv_usage() == 0.0  # every rejected draft's block is back


def test_the_tiny_model_as_its_own_draft_accepts_everything_and_changes_nothing(tiny_session, tiny_model_dir,
                                                                                 tiny_artifact, prompts, baseline):
    config = parse_speculative_config({"model": str(tiny_model_dir), "num_speculative_tokens": 3})
    config = config.resolved(str(tiny_artifact), str(tiny_model_dir))
    engine = Engine(tiny_session, EngineConfig(speculative=config))
    got = run(engine, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert got == baseline
    s = engine.stats()
    assert s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"] > 0
    assert s["spec_accepted_per_pos"][0] == s["spec_num_drafts"]
    draft = engine.speculator.proposer
    # on the CPU a draft model keeps speculating up to 8 running sequences
    assert engine.speculator.config.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    assert engine.kv.in_sync() and draft.kv.in_sync() and engine.kv_usage() == 0.0
    assert draft.kv.blocks.num_free_blocks == draft.kv.blocks.num_blocks  # released with their requests
    # sampling with a seed: the same tokens twice
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    assert run(engine, prompts, params) == run(engine, prompts, params)


class GraphStandIn:
    """The model as a runner sees it, with `batch_verify_captured` answered by the library's own
    batch_verify (a CPU build captures no CUDA graph; the same entry point runs) and every entry
    point called counted: which one each step chose, checked without a GPU."""

    def __init__(self, model):
        self._model, self.calls = model, Counter()

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _real(self, name: str) -> str:
        return "batch_verify" if name == CAPTURED_VERIFY_ENTRY else name

    def has_function(self, name: str) -> bool:
        return self._model.has_function(self._real(name))

    def function(self, name: str):
        self.calls[name] += 1
        return self._model.function(self._real(name))


def test_short_verifications_take_the_captured_entry_on_target_and_draft(tiny_session, tiny_model_dir,
                                                                          tiny_artifact, prompts, baseline):
    config = parse_speculative_config({"model": str(tiny_model_dir), "num_speculative_tokens": 3})
    engine = Engine(tiny_session, EngineConfig(speculative=config.resolved(str(tiny_artifact), str(tiny_model_dir))))
    runners = {"target": engine.runner, "draft": engine.speculator.proposer.runner}
    for runner in runners.values():
        runner.model, runner.verify_graph_tokens = GraphStandIn(runner.model), 12
    assert run(engine, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) == baseline
    target, draft = (runners[k].model.calls for k in ("target", "draft"))
    # 3 sequences x (1 + 3 drafts) = 12 tokens: every verification captured, the prompts not
    assert target[CAPTURED_VERIFY_ENTRY] > 0 and target["batch_verify"] == 0 and target["batch_prefill"] >= 1
    # the draft's catch-up after each verification (at most 1 + k tokens, every row) is captured;
    # its first catch-up (the prompts) wants one row each and runs batch_verify uncaptured
    assert draft[CAPTURED_VERIFY_ENTRY] > 0 and draft["batch_verify"] >= 1 and draft["batch_prefill"] == 0
    assert engine.kv.in_sync() and engine.kv_usage() == 0.0


def test_the_runner_picks_the_multi_token_entry_by_what_the_step_holds(tiny_session):
    from vtool.runtime.engine.kv_cache import PagedKVCache
    from vtool.runtime.engine.runner import ModelRunner
    from vtool.runtime.engine.step_types import ScheduledSequence, SchedulerOutput

    kv = PagedKVCache(tiny_session.model, 8, 16, 4, 64)
    runner, follower = ModelRunner(tiny_session.model, kv), ModelRunner(tiny_session.model, kv, continuations=True)
    for r in (runner, follower):
        r.verify_graph_tokens = 8

    def seq(n: int, drafts: int = 0, rows: int | None = None) -> ScheduledSequence:
        tokens = tuple(range(1, n + 1))
        return ScheduledSequence(request_id=f"{n}-{drafts}", seq_id=0, token_ids=tokens, num_computed=4,
                                 num_logit_rows=n if rows is None else rows, sample=bool(drafts),
                                 sampler=SequenceSampler(SamplingParams(temperature=0), [0], vocab_size=64)
                                 if drafts else None, draft_ids=tokens[n - drafts:] if drafts else ())

    def entry(r, *seqs) -> str:
        step = SchedulerOutput(seqs)
        return r._multi_token_entry(step, sum(s.num_logit_rows for s in seqs))

    assert entry(runner, seq(4, 3), seq(1, 0, 1)) == CAPTURED_VERIFY_ENTRY  # 5 tokens, every row
    assert entry(runner, seq(5, 4), seq(5, 4)) == "batch_verify"  # 10 tokens: past the graphs' bound
    assert entry(runner, seq(6, 0, 1), seq(3, 2)) == "batch_prefill"  # a prompt chunk in the step
    assert entry(follower, seq(3, 0, 3)) == CAPTURED_VERIFY_ENTRY  # a draft's catch-up, every row
    assert entry(follower, seq(6, 0, 1)) == "batch_verify"  # one row of six: no graph for it
    runner.verify_graph_tokens = 0  # a library without the captured entry
    assert entry(runner, seq(4, 3)) == "batch_verify"


def test_speculation_stops_at_the_batch_size_rule(tiny_session, prompts):
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                       "disable_by_batch_size": 2})
    engine = Engine(tiny_session, EngineConfig(speculative=config))
    run(engine, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert engine.speculator.num_skipped_steps > 0


def test_no_draft_passes_the_length_limit(tiny_session, prompts, baseline):
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 6})
    engine = Engine(tiny_session, EngineConfig(speculative=config))
    engine.speculator.proposer = OracleProposer(baseline, {f"r{i}": len(p) for i, p in enumerate(prompts)},
                                                lambda pos: False, engine.vocab_size)
    got = run(engine, prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert got == {rid: ids[:5] for rid, ids in baseline.items()}
    assert engine.kv.in_sync() and engine.kv_usage() == 0.0


# -- the server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spec_server(tiny_model_dir, tmp_path_factory):
    from test_engine_core import Server  # the same `vtool serve` process fixture

    s = Server(tiny_model_dir, tmp_path_factory.mktemp("spec") / "server.log", "--speculative-config",
               json.dumps({"model": str(tiny_model_dir), "num_speculative_tokens": 3}))
    yield s
    s.stop()


def test_a_server_with_a_draft_model_answers_as_without_and_counts_as_vllm(spec_server, prompts, baseline,
                                                                            tiny_session):
    import openai

    from test_engine_core import MODEL

    client = openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="x", max_retries=0)
    for i, ids in enumerate(prompts):
        done = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert done.choices[0].text == tiny_session.tokenizer.decode(baseline[f"r{i}"])
        streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    drafts = spec_server.metric("vllm:spec_decode_num_draft_tokens_total")
    assert drafts > 0 and spec_server.metric("vllm:spec_decode_num_accepted_tokens_total") == drafts
    assert spec_server.metric("vllm:spec_decode_num_drafts_total") > 0
    assert spec_server.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert spec_server.metric("vllm:kv_cache_usage_perc") == 0.0


def test_serve_refuses_a_bad_speculative_config_before_loading(tiny_model_dir):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "vtool.toolchain.cli", "serve", "--model", str(tiny_model_dir),
                           "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2}'],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "eagle3" in done.stderr + done.stdout and "EAGLE-3" in done.stderr + done.stdout
