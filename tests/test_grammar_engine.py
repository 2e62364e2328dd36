"""The engine core's side of structured output (runtime/engine/grammar_stage.py,
runtime/sampling/reasoning_gate.py) on the tiny chat model (random weights, SmolLM2's real
tokenizer):

- a request whose grammar is not cached waits apart (vLLM's "deferred") while a worker compiles
  it, and the loop keeps generating the others; a cached grammar is admitted at once; an abort
  while it compiles ends it; a grammar that fails to compile ends its request with "abort";
- jump-forward gives the same text as one decode step per token, in fewer steps;
- a grammar that starts after the reasoning section: free text until the end marker, then JSON
  that validates against the schema.
"""
from __future__ import annotations

import json
from typing import Sequence

import jsonschema
import numpy as np
import pytest

from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.engine.grammar_stage import GrammarStage
from vtool.runtime.sampling.grammar import GrammarSpec, spec_fields
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.sampling.reasoning_gate import ReasoningGate

SCHEMA = {"type": "object", "properties": {
    "location": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["location", "unit", "days"], "additionalProperties": False}


def fields(schema=SCHEMA, **extra) -> dict:
    return {**spec_fields(GrammarSpec.json_schema(schema, any_whitespace=False)), **extra}


def run(engine: Engine) -> tuple[dict[str, list[int]], dict[str, str], int]:
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
        assert steps < 2000, "the engine did not finish"
    return tokens, finish, steps


@pytest.fixture
def prompt(tiny_session) -> list[int]:
    return tiny_session.tokenizer.encode("Weather as JSON:", add_special_tokens=True)


def test_jump_forward_gives_the_same_text_in_fewer_steps(tiny_session, prompt):
    texts, steps, jumped = {}, {}, {}
    for jump in (False, True):
        engine = Engine(tiny_session, EngineConfig(grammar_jump_forward=jump))
        engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=100, structured_outputs=fields()))
        tokens, finish, steps[jump] = run(engine)
        assert finish["r"] == "stop"
        texts[jump] = tiny_session.tokenizer.decode(tokens["r"])
        jumped[jump] = engine.stats()["grammar_jumped_tokens"]
    value = json.loads(texts[True])
    jsonschema.validate(value, SCHEMA)
    assert texts[True] == texts[False]
    # `{"location":"` and `","unit":"` are forced: several tokens each, no step each
    print(f"\n[jump-forward] {texts[True]!r}: steps {steps}, jumped tokens {jumped}")
    assert jumped[False] == 0 and jumped[True] >= 4, jumped
    assert steps[True] <= steps[False] - 3, steps


def test_jump_forward_is_off_for_a_request_with_logprobs(tiny_session, prompt):
    engine = Engine(tiny_session, EngineConfig())
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=100, logprobs=1,
                                                   structured_outputs=fields()))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert engine.stats()["grammar_jumped_tokens"] == 0
    assert all(len(o.new_token_ids) == len(o.new_logprobs) == 1 for o in outs)
    jsonschema.validate(json.loads(tiny_session.tokenizer.decode([t for o in outs for t in o.new_token_ids])), SCHEMA)


def test_an_uncached_grammar_waits_apart_while_the_others_run(tiny_session, prompt):
    engine = Engine(tiny_session, EngineConfig())
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()  # the free request is running
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "note": {"type": "string", "maxLength": 3}}}
    engine.add_request("json", prompt, SamplingParams(temperature=0, max_tokens=100,
                                                      structured_outputs=fields(schema)))
    stats = engine.stats()
    assert stats["num_waiting_deferred"] == 1 and stats["num_waiting"] == 1
    assert engine.requests["json"] not in engine.scheduler.waiting
    tokens, finish, _ = run(engine)
    assert finish == {"free": "length", "json": "stop"}
    jsonschema.validate(json.loads(tiny_session.tokenizer.decode(tokens["json"])), schema)
    # the same schema again is in the compile cache: admitted at once
    engine.add_request("again", prompt, SamplingParams(temperature=0, max_tokens=100,
                                                       structured_outputs=fields(schema)))
    assert engine.stats()["num_waiting_deferred"] == 0 and engine.requests["again"] in engine.scheduler.waiting
    tokens2, _, _ = run(engine)
    assert tokens2["again"] == tokens["json"]


def test_abort_while_its_grammar_compiles(tiny_session, prompt):
    engine = Engine(tiny_session, EngineConfig())
    engine.add_request("json", prompt, SamplingParams(max_tokens=10, structured_outputs=fields(
        {"type": "object", "properties": {"aborted": {"type": "boolean"}}, "required": ["aborted"]})))
    assert engine.grammar.num_pending == 1
    assert engine.abort("json")
    assert engine.grammar.num_pending == 0 and not engine.has_unfinished()
    assert engine.step() == []


class _NoVocabulary:
    """A tokenizer the grammar engine cannot read (no `backend`): compiling fails for real."""

    eos_id = 0
    vocab_size = 10

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1]


def test_a_grammar_that_fails_to_compile_ends_its_request(tiny_session, prompt, caplog):
    engine = Engine(tiny_session, EngineConfig())
    engine.grammar = GrammarStage(_NoVocabulary(), engine.vocab_size, [0])
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=5))
    engine.add_request("json", prompt, SamplingParams(max_tokens=10, structured_outputs=fields()))
    tokens, finish, _ = run(engine)
    assert finish == {"free": "length", "json": "abort"} and tokens.get("json", []) == []
    assert "its grammar failed to compile" in caplog.text


class Script:
    """A logits processor that makes the model write `ids` first (only the next one allowed),
    then leaves it free: the 'thinking' a real reasoning model would write."""

    def __init__(self, ids: Sequence[int]):
        self.ids, self.pos = list(ids), 0

    def apply(self, logits: np.ndarray, output_ids: Sequence[int] = ()) -> None:
        if self.pos < len(self.ids):
            keep = logits[self.ids[self.pos]]
            logits[:] = -np.inf
            logits[self.ids[self.pos]] = keep if np.isfinite(keep) else 0.0

    def accept(self, token_id: int) -> None:
        self.pos += 1


@pytest.mark.parametrize("ended", [False, True])
def test_the_grammar_starts_after_the_reasoning_section(tiny_session, prompt, ended):
    tok = tiny_session.tokenizer
    thinking = "<think>\nLet me think {not json] at all.\n</think>" if not ended else ""
    script = Script(tok.encode(thinking, add_special_tokens=False))
    engine = Engine(tiny_session, EngineConfig())
    params = SamplingParams(temperature=0, max_tokens=150,
                            structured_outputs=fields(starts_after="</think>", reasoning_ended=ended))
    engine.add_request("r", prompt, params, logits_processors=[script])
    tokens, finish, _ = run(engine)
    text = tok.decode(tokens["r"])
    assert finish["r"] == "stop" and text.startswith(thinking)
    jsonschema.validate(json.loads(text[len(thinking):]), SCHEMA)


def test_reasoning_gate_masks_nothing_until_the_marker(tiny_session):
    from vtool.runtime.sampling.grammar import GrammarCompiler
    from vtool.runtime.sampling.logits_processors import bitmask_words, unpack_allowed

    tok = tiny_session.tokenizer
    compiler = GrammarCompiler(tok, vocab_size=tiny_session.model.vocab_size)
    end_ids = tok.encode("</think>", add_special_tokens=False)
    assert len(end_ids) > 1  # SmolLM2 spells it in pieces: the gate must match the sequence
    gate = ReasoningGate(compiler.processor(GrammarSpec.json_schema(SCHEMA, any_whitespace=False)), end_ids)
    words = np.zeros(bitmask_words(compiler.vocab_size), np.int32)
    for token in tok.encode("x</think", add_special_tokens=False) + end_ids[:-1]:
        gate.fill_bitmask(words)
        assert unpack_allowed(words, compiler.vocab_size).all()
        gate.accept_token(token)
        assert gate.active_grammar is None and not gate.is_terminated() and gate.forced_tokens() == []
    gate.accept_token(end_ids[-1])
    assert gate.active_grammar is not None
    gate.fill_bitmask(words)
    allowed = np.flatnonzero(unpack_allowed(words, compiler.vocab_size))
    assert 0 < allowed.size < 50 and all(tok.decode([int(t)]).startswith("{") for t in allowed)
    logits = np.zeros(compiler.vocab_size, np.float32)
    gate.apply(logits)
    assert set(np.flatnonzero(np.isfinite(logits))) == set(allowed.tolist())
