"""What crosses between an API server and the engine core process (serving/core_wire.py):
every valid request and every output comes back exactly as sent (hypothesis), and a
refusal keeps its kind, so a bad request is still a 400 on the other side."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtool import VtoolError
from vtool.runtime.engine.request import CoreOutput
from vtool.runtime.engine.validation import RequestError
from vtool.runtime.sampling.host import Logprob
from vtool.runtime.sampling.params import SamplingParams, SamplingParamsError
from vtool.runtime.serving import core_wire as wire

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def sampling_params(draw) -> SamplingParams:
    greedy = draw(st.booleans())
    max_tokens = draw(st.one_of(st.none(), st.integers(1, 1 << 20)))
    return SamplingParams(
        n=1 if greedy else draw(st.integers(1, 8)),
        temperature=0.0 if greedy else draw(st.floats(0.01, 2.0)),
        top_p=draw(st.floats(0.01, 1.0)), top_k=draw(st.sampled_from([-1, 0, 1, 50, 10_000])),
        min_p=draw(st.floats(0.0, 1.0)), presence_penalty=draw(st.floats(-2.0, 2.0)),
        frequency_penalty=draw(st.floats(-2.0, 2.0)), repetition_penalty=draw(st.floats(0.1, 2.0)),
        seed=draw(st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1))),
        stop=draw(st.lists(st.text(min_size=1, max_size=8), max_size=3)),
        stop_token_ids=draw(st.lists(st.integers(0, 50_000), max_size=4, unique=True)),
        include_stop_str_in_output=draw(st.booleans()), ignore_eos=draw(st.booleans()),
        max_tokens=max_tokens, min_tokens=draw(st.integers(0, max_tokens or 16)),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
        prompt_logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
        logit_bias=draw(st.one_of(st.none(), st.dictionaries(st.integers(0, 50_000), st.floats(-100, 100),
                                                             max_size=4))),
        skip_special_tokens=draw(st.booleans()), spaces_between_special_tokens=draw(st.booleans()))


logprob = st.builds(Logprob, logprob=st.one_of(finite, st.just(-math.inf)),
                    rank=st.one_of(st.none(), st.integers(1, 200_000)),
                    decoded_token=st.one_of(st.none(), st.text(max_size=4)))
position = st.dictionaries(st.integers(0, 200_000), logprob, min_size=1, max_size=4)


@st.composite
def core_outputs(draw) -> CoreOutput:
    n = draw(st.integers(1, 4))
    return CoreOutput(
        request_id=draw(st.text(min_size=1, max_size=40)),
        new_token_ids=draw(st.lists(st.integers(0, 200_000), min_size=n, max_size=n)),
        new_logprobs=draw(st.one_of(st.just([]), st.lists(st.one_of(st.none(), position), min_size=n, max_size=n))),
        finish_reason=draw(st.sampled_from([None, "stop", "length"])),
        stop_reason=draw(st.one_of(st.none(), st.integers(0, 200_000))),
        num_prompt_tokens=draw(st.integers(1, 1 << 20)), num_output_tokens=draw(st.integers(1, 1 << 20)),
        num_cached_tokens=draw(st.integers(0, 1 << 20)), cumulative_logprob=draw(st.one_of(st.none(), finite, st.just(-math.inf))),
        prompt_logprobs=draw(st.one_of(st.none(), st.lists(st.one_of(st.none(), position), max_size=4))),
        stop_token=draw(st.booleans()))


@settings(max_examples=300, deadline=None)
@given(params=sampling_params(), prompt=st.lists(st.integers(0, 200_000), min_size=1, max_size=64),
       priority=st.integers(-(2**31), 2**31), arrival=finite,
       parent=st.one_of(st.none(), st.tuples(st.text(max_size=40), st.integers(2, 16384))))
def test_an_add_comes_back_as_sent(params, prompt, priority, arrival, parent):
    """parent: (id, n) of a parallel-sampling child (the metrics count its parent once), or None."""
    message = (7, "cmpl-1-0-0", prompt, params, priority, arrival, parent)
    assert wire.add_decoder.decode(wire.encoder.encode(message)) == message


@settings(max_examples=300, deadline=None)
@given(outputs=st.lists(core_outputs(), max_size=8))
def test_a_step_of_outputs_comes_back_as_sent(outputs):
    assert wire.output_decoder.decode(wire.encoder.encode(outputs)) == outputs


@pytest.mark.parametrize("error, kind", [
    (RequestError("prompt too long"), RequestError),
    (SamplingParamsError("temperature", 7, "at most 2"), RequestError),
    (VtoolError("stop strings must be non-empty"), VtoolError),
    (ValueError("bad value"), ValueError),
    (KeyError("bug"), RuntimeError),
])
def test_a_refusal_keeps_its_kind(error, kind):
    payload = wire.reply_decoder.decode(wire.encoder.encode((3, False, wire.error_payload(error))))[2]
    back = wire.error_from_payload(payload)
    assert type(back) is kind and str(error).strip("'") in str(back)
