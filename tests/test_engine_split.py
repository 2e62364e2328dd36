"""The engine's rooms meet through named per-step types (engine/step_types.py): the
scheduler's output is what the runner computes, a sequence may carry several tokens with
logits at each, per-request logits processors constrain the draw, and every model-dependent
limit is checked in one place (engine/validation.py). transformers is the oracle for the
logits; the bitmask layout is checked against plain integer bit arithmetic."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from tiny_models import make_tiny_chat_model
from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.engine.step_types import ScheduledSequence, SchedulerOutput
from vtool.runtime.engine.validation import RequestError, RequestLimits
from vtool.runtime.sampling.logits_processors import (AllowedTokens, TokenBitmaskProcessor, apply_token_bitmask,
                                                      pack_allowed, unpack_allowed)
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.session import open_session
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.runtime.weights.default_model import default_model_path
from vtool.toolchain.build import build_artifact

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the woods."


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tinychat"), default_model_path())


@pytest.fixture(scope="module")
def session(folder):
    checkpoint = open_checkpoint(folder)
    return open_session(build_artifact(folder, "host", checkpoint=checkpoint), checkpoint, max_model_len=256)


@pytest.fixture(scope="module")
def hf_logits(folder, session):
    """transformers' float32 logits at every position of the prompt."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = session.tokenizer.encode(PROMPT)
    with torch.no_grad():
        return ids, model(torch.tensor([ids])).logits[0].numpy()


def _sequence(seq_id: int, tokens: list[int], computed: int, rows: int, **kw) -> ScheduledSequence:
    return ScheduledSequence(request_id=f"s{seq_id}", seq_id=seq_id, token_ids=tuple(tokens), num_computed=computed,
                             num_logit_rows=rows, sample=False, return_logits=rows > 0, **kw)


def test_runner_scores_several_tokens_of_one_sequence_as_transformers_does(session, hf_logits):
    """A prefix, then k tokens in one call with logits at each (the shape speculative
    verification needs), beside another sequence decoding one token in the same batch."""
    ids, expected = hf_logits
    k = 5
    engine = Engine(session, EngineConfig(enable_prefix_caching=False))
    kv, runner = engine.kv, engine.runner
    kv.add(0)
    kv.add(1)
    head = len(ids) - k
    first = runner.execute(SchedulerOutput((_sequence(0, ids[:head], 0, 0), _sequence(1, ids[:3], 0, 0))))
    assert [r.logits for r in first.results] == [None, None]
    ran = runner.execute(SchedulerOutput((_sequence(0, ids[head:], head, k), _sequence(1, ids[3:4], 3, 1))))
    several, single = ran.results
    assert several.logits.shape == (k, session.model.vocab_size)
    np.testing.assert_allclose(several.logits, expected[head:], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(single.logits[0], expected[3], rtol=1e-4, atol=1e-4)
    assert kv.in_sync()


def test_scheduler_output_is_what_the_requests_need(session):
    """Every step's SchedulerOutput, under a small token budget (chunked prefill): the tokens
    are the request's next ones, the budget and sequence limit hold, and a sequence samples
    exactly when it is complete after the step."""
    config = EngineConfig(max_num_seqs=3, max_num_batched_tokens=7, enable_prefix_caching=False)
    engine = Engine(session, config)
    prompts = [PROMPT, "Hi", "def add(a, b):\n    return a + b\n", "Un deux trois"]
    for i, text in enumerate(prompts):
        engine.add_request(f"r{i}", session.tokenizer.encode(text),
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        scheduled = engine.scheduler.schedule()
        assert scheduled.num_tokens <= config.max_num_batched_tokens
        assert len(scheduled.sequences) <= config.max_num_seqs
        prompt_chunks = [engine.requests[s.request_id].num_computed < len(engine.requests[s.request_id].prompt_ids)
                         and (s.num_tokens > 1 or s.num_computed == 0) for s in scheduled.sequences]
        assert scheduled.kind == ("decode" if not any(prompt_chunks) else "prefill" if all(prompt_chunks)
                                  else "mixed")  # a 1-token last chunk over a cached prefix costs as a decode
        for s in scheduled.sequences:
            request = engine.requests[s.request_id]
            assert s.token_ids == tuple(request.all_ids[request.num_computed: request.num_computed + s.num_tokens])
            assert s.num_computed == request.num_computed and s.seq_id == request.seq_id
            assert s.sample == (request.num_computed + s.num_tokens == request.num_tokens)
            assert s.num_logit_rows == int(s.sample)
        ran = engine.runner.execute(scheduled)
        for s, result in zip(scheduled.sequences, ran.results):
            request = engine.requests[s.request_id]
            request.num_computed += s.num_tokens
            if result.sampled is not None:
                out = engine.output_processor.process(request, result.sampled)
                if out.finish_reason is not None:
                    engine._finish(request, out.finish_reason, out.stop_reason)
        steps += 1
        assert steps < 500
    assert engine.kv.in_sync()


def test_step_kind_tells_decodes_from_prompt_chunks():
    decode = _sequence(0, [5], 10, 1)
    verify = ScheduledSequence("s1", 1, (5, 6, 7), 10, 3, True, sampler=object(), draft_ids=(6, 7))
    fresh = _sequence(2, [1, 2, 3], 0, 1)
    one_token_prompt = _sequence(3, [9], 0, 1)
    later_chunk = _sequence(4, [1, 2], 3, 0)
    assert SchedulerOutput((decode, verify)).kind == "decode"
    assert SchedulerOutput((fresh,)).kind == SchedulerOutput((one_token_prompt, later_chunk)).kind == "prefill"
    assert SchedulerOutput((decode, fresh)).kind == SchedulerOutput((verify, later_chunk)).kind == "mixed"


def test_grammar_mask_seam_constrains_greedy_to_the_allowed_tokens(session, folder):
    """A bitmask logits processor: every token drawn is allowed, greedy picks the best allowed
    token by transformers' logits, and the processor is told each accepted token."""
    vocab = session.model.vocab_size
    rng = np.random.default_rng(3)
    allowed = sorted(rng.choice(vocab, size=40, replace=False).tolist())
    source = AllowedTokens(allowed, vocab)
    engine = Engine(session, EngineConfig())
    prompt = session.tokenizer.encode(PROMPT)
    engine.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       logits_processors=[TokenBitmaskProcessor(source)])
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    assert len(tokens) == 6 and set(tokens) <= set(allowed)
    assert source.accepted == tokens
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    expected, context = [], list(prompt)
    with torch.no_grad():
        for _ in range(6):
            logits = model(torch.tensor([context])).logits[0, -1].numpy()
            best = allowed[int(np.argmax(logits[allowed]))]
            expected.append(best)
            context.append(best)
    assert tokens == expected


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300).flatmap(lambda v: st.tuples(st.just(v), st.lists(st.booleans(), min_size=v, max_size=v))))
def test_bitmask_packs_bit_j_of_word_i_as_token_32i_plus_j(case):
    vocab, bits = case
    allowed = np.array(bits, dtype=bool)
    words = pack_allowed(allowed)
    assert words.dtype == np.int32 and words.size == (vocab + 31) // 32
    for token in range(vocab):
        assert ((int(words[token // 32]) & 0xFFFFFFFF) >> (token % 32)) & 1 == int(allowed[token])
    assert (unpack_allowed(words, vocab) == allowed).all()
    logits = np.zeros(vocab, np.float32)
    apply_token_bitmask(logits, words)
    assert (np.isneginf(logits) == ~allowed).all()


limits_cases = st.builds(
    lambda vocab, model_len, capacity, prompt, max_tokens, ceiling: (vocab, model_len, capacity, prompt, max_tokens,
                                                                     ceiling),
    st.integers(2, 50), st.integers(2, 64), st.one_of(st.none(), st.integers(1, 80)),
    st.lists(st.integers(-3, 55), max_size=70), st.one_of(st.none(), st.integers(-2, 80)),
    st.one_of(st.none(), st.integers(1, 40)))


@settings(max_examples=300, deadline=None)
@given(limits_cases)
def test_request_limits_refuse_exactly_what_breaks_a_limit(case):
    vocab, model_len, capacity, prompt, max_tokens, ceiling = case
    limits = RequestLimits(vocab, model_len, capacity, ceiling)
    params = SamplingParams(max_tokens=max_tokens)
    n = len(prompt)
    room = model_len - n
    breaks = (n == 0 or any(not 0 <= t < vocab for t in prompt) or n >= model_len
              or (capacity is not None and n >= capacity))
    if breaks:
        with pytest.raises(RequestError):
            limits.check_request(prompt, params)
        return
    if max_tokens is not None and max_tokens > room:
        with pytest.raises(RequestError, match="maximum context length"):
            limits.check_request(prompt, params)
        assert limits.check_request(prompt, params, strict=False) == room
        return
    got = limits.check_request(prompt, params)
    if max_tokens is None or max_tokens <= 0:
        assert got == (min(room, ceiling) if ceiling else room)
    else:
        assert got == max_tokens


@pytest.mark.parametrize("prompt, message", [
    ([], "the prompt is empty"),
    ([5, 10**6], "prompt token id 1000000 is outside the vocabulary"),
    ([-1], "prompt token id -1 is outside the vocabulary"),
    (list(range(1, 257)), "the prompt has 256 tokens, at or past max_model_len=256"),
])
def test_engine_and_generator_refuse_a_prompt_with_the_same_words(session, prompt, message):
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(RequestError, match=message):
        Engine(session, EngineConfig()).add_request("x", prompt, params)
    with pytest.raises(RequestError, match=message):
        session.generator.generate(prompt, params)


def test_a_scheduled_sequence_refuses_an_impossible_shape():
    with pytest.raises(ValueError, match="at least one token"):
        ScheduledSequence("r", 0, (), 0, 0, sample=False)
    with pytest.raises(ValueError, match="num_logit_rows 3 is outside 0..2"):
        ScheduledSequence("r", 0, (1, 2), 0, 3, sample=False)
    with pytest.raises(ValueError, match="sampling needs"):
        ScheduledSequence("r", 0, (1,), 0, 0, sample=True)
