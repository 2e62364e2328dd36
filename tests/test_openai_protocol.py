"""The OpenAI request/response layer: request validation, the mapping onto SamplingParams keyword
arguments, and the OpenAI error bodies a FastAPI app answers with (driven in-process and through
the real `openai` client against a uvicorn server)."""
from __future__ import annotations

import dataclasses
import json
import keyword
import logging
import socket
import threading
import time

import pytest
from fastapi import Request as HTTPRequest  # the fake-engine routes' annotation, resolved from here
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from vtool import VtoolError
from vtool.runtime.serving.errors import (NotFoundError, OpenAIError, error_json, install_error_handlers,
                                         validation_message)
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.serving.protocol import (MAX_LOGPROBS, ChatCompletionRequest, ChatCompletionResponse,
                                           ChatCompletionStreamResponse, CompletionRequest,
                                           CompletionResponse, CompletionStreamResponse, DetokenizeRequest,
                                           ErrorResponse, ModelCard, ModelList, TokenizeRequest,
                                           TokenizeResponse, sse_event)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SAMPLING_KEYS = {
    "n", "best_of", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "logprobs", "prompt_logprobs", "skip_special_tokens",
    "spaces_between_special_tokens", "structured_outputs",
}

USER = [{"role": "user", "content": "hi"}]


def refusal(model, body: dict) -> tuple[str, str | None]:
    """The (message, param) a request body is refused with; fails if it is accepted."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_message(info.value.errors(include_url=False))


# ============================================================================ valid requests

finite = dict(allow_nan=False, allow_infinity=False)
text = st.text(min_size=1, max_size=8)
token_ids = st.lists(st.integers(0, 50_000), min_size=1, max_size=5)

common_fields = {
    "model": st.text(max_size=10),
    "temperature": st.floats(0, 2, **finite),
    "top_p": st.floats(0, 1, exclude_min=True, **finite),
    "top_k": st.integers(-1, 1000),
    "min_p": st.floats(0, 1, **finite),
    "presence_penalty": st.floats(-2, 2, **finite),
    "frequency_penalty": st.floats(-2, 2, **finite),
    "repetition_penalty": st.floats(0, 10, exclude_min=True, **finite),
    "n": st.integers(1, 4),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "max_tokens": st.one_of(st.none(), st.integers(1, 4096)),
    "min_tokens": st.integers(0, 3),
    "stop": st.one_of(text, st.lists(text, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 50_000), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, 50_000).map(str), st.floats(-300, 300, **finite), max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "user": st.text(max_size=5),
    "priority": st.integers(-5, 5),
    "request_id": st.text(max_size=8),
    "response_format": st.just({"type": "text"}),
    "use_beam_search": st.just(False),  # a vLLM field at its no-op value is accepted
    "return_token_ids": st.one_of(st.none(), st.booleans()),
}

completion_fields = {
    **common_fields,
    "prompt": st.one_of(text, st.lists(text, min_size=1, max_size=3), token_ids,
                        st.lists(token_ids, min_size=1, max_size=3)),
    "max_tokens": st.one_of(st.none(), st.integers(0, 4096)),  # 0: made echo's scoring idiom below
    "echo": st.booleans(),
    "logprobs": st.integers(0, MAX_LOGPROBS),
    "prompt_logprobs": st.integers(0, MAX_LOGPROBS),
    "add_special_tokens": st.booleans(),
    "suffix": st.just(""),
}

content = st.one_of(text, st.lists(st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=5)),
                                   max_size=3))
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
                                 "content": content})
chat_fields = {
    **common_fields,
    "messages": st.lists(message, min_size=1, max_size=4),
    "max_completion_tokens": st.one_of(st.none(), st.integers(1, 4096)),
    "logprobs": st.booleans(),
    "prompt_logprobs": st.integers(0, MAX_LOGPROBS),
    "echo": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    "add_special_tokens": st.booleans(),
    "tool_choice": st.just("none"),
    "tools": st.just([]),
    "parallel_tool_calls": st.booleans(),
}


@st.composite
def request_body(draw, fields: dict, required: tuple[str, ...]) -> dict:
    names = draw(st.lists(st.sampled_from(sorted(set(fields) - set(required))), unique=True))
    body = {name: draw(fields[name]) for name in (*required, *names)}
    if body.get("stream_options") is not None:
        body["stream"] = True
    return body


def _fix_consistency(body: dict, chat: bool) -> dict:
    """Drop combinations vLLM refuses on purpose (tested separately below)."""
    body = dict(body)
    if not chat and body.get("max_tokens") == 0:
        body["echo"] = True  # max_tokens=0 is only valid as echo's prompt-scoring idiom
    limit = _expected_max_tokens(body, chat)
    if limit is not None and body.get("min_tokens", 0) > limit:
        body.pop("min_tokens")
    if chat and body.get("top_logprobs") and not body.get("logprobs"):
        body.pop("top_logprobs")
    return body


def _expected_max_tokens(body: dict, chat: bool):
    """The limit vLLM runs a valid body with, before generation_config's default."""
    if chat:
        if body.get("max_completion_tokens") is not None:
            return body["max_completion_tokens"]
        return body.get("max_tokens")
    if "max_tokens" not in body:
        return 16  # vLLM's CompletionRequest default
    if body.get("echo") and body["max_tokens"] == 0:
        return 1  # echo without generation runs one token
    return body["max_tokens"]


def _check_mapping(body: dict, kwargs: dict, chat: bool, defaults: dict) -> None:
    assert set(kwargs) == SAMPLING_KEYS
    fallbacks = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    for name, fallback in fallbacks.items():
        want = body[name] if name in body else defaults.get(name, fallback)
        assert kwargs[name] == want, name
    for name in ("n", "seed", "min_tokens", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                 "spaces_between_special_tokens"):
        if name in body:
            assert kwargs[name] == body[name], name
    for name in ("presence_penalty", "frequency_penalty"):
        assert kwargs[name] == body.get(name, 0.0)
    stop = body.get("stop")
    assert kwargs["stop"] == ([] if stop is None else [stop] if isinstance(stop, str) else stop)
    assert kwargs["stop_token_ids"] == body.get("stop_token_ids", [])
    assert kwargs["structured_outputs"] is None  # free text unless a grammar is asked for
    if "logit_bias" in body:
        assert kwargs["logit_bias"] == {int(k): max(-100.0, min(100.0, v)) for k, v in body["logit_bias"].items()}
        assert all(type(k) is int for k in kwargs["logit_bias"])
    else:
        assert kwargs["logit_bias"] is None
    want_max = _expected_max_tokens(body, chat)
    if want_max is None:  # generation_config's default is a fallback, never a cap (vLLM's get_max_tokens)
        want_max = defaults.get("max_tokens")
    assert kwargs["max_tokens"] == want_max
    if chat:
        want_lp = body.get("top_logprobs", 0) if body.get("logprobs") else None
        assert kwargs["logprobs"] == want_lp
        want_plp = body.get("prompt_logprobs")
        if want_plp is None and body.get("echo") and not body.get("stream"):
            want_plp = body.get("top_logprobs") or 0  # vLLM: echo asks for the prompt's logprobs
        assert kwargs["prompt_logprobs"] == want_plp
    else:
        assert kwargs["logprobs"] == body.get("logprobs")
        want_plp = body.get("prompt_logprobs")
        if want_plp is None and body.get("echo"):
            want_plp = body.get("logprobs")
        assert kwargs["prompt_logprobs"] == want_plp


defaults_strategy = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(0, 2, **finite), "top_p": st.floats(0.1, 1, **finite),
    "top_k": st.integers(0, 100), "min_p": st.floats(0, 1, **finite),
    "repetition_penalty": st.floats(0.5, 2, **finite), "max_tokens": st.integers(1, 100)})


@SETTINGS
@given(request_body(completion_fields, ("prompt",)), defaults_strategy)
def test_valid_completion_requests_parse_and_map(body, defaults):
    body = _fix_consistency(body, chat=False)
    req = CompletionRequest.model_validate(body)
    assert req.effective_max_tokens == _expected_max_tokens(body, chat=False)
    assert req.echo_without_generation == (body.get("echo") is True and body.get("max_tokens") == 0)
    _check_mapping(body, req.to_sampling_kwargs(defaults), chat=False, defaults=defaults)
    # the same body through JSON (what a server receives) parses to the same request
    again = CompletionRequest.model_validate_json(json.dumps(body))
    assert again.to_sampling_kwargs(defaults) == req.to_sampling_kwargs(defaults)
    assert all(isinstance(p, (str, list)) for p in req.prompts) and req.prompts


@SETTINGS
@given(request_body(chat_fields, ("messages",)), defaults_strategy)
def test_valid_chat_requests_parse_and_map(body, defaults):
    body = _fix_consistency(body, chat=True)
    if body.get("logprobs"):
        body["top_logprobs"] = min(5, MAX_LOGPROBS)
    req = ChatCompletionRequest.model_validate(body)
    _check_mapping(body, req.to_sampling_kwargs(defaults), chat=True, defaults=defaults)
    rendered = req.template_messages()
    assert [m["role"] for m in rendered] == [m["role"] for m in body["messages"]]
    for got, sent in zip(rendered, body["messages"]):
        want = sent["content"] if isinstance(sent["content"], str) else "\n".join(p["text"] for p in sent["content"])
        assert got["content"] == want


def test_sampling_kwargs_are_sampling_params_fields():
    sampling_params = pytest.importorskip("vtool.runtime.sampling.params")
    fields = {f.name for f in dataclasses.fields(sampling_params.SamplingParams)}
    assert SAMPLING_KEYS <= fields
    for req in (CompletionRequest(prompt="x", max_tokens=None, stop="\n", logit_bias={"5": 1000.0}, logprobs=2),
                ChatCompletionRequest(messages=USER, max_completion_tokens=7, logprobs=True, top_logprobs=3,
                                      temperature=0.0, seed=3)):
        params = sampling_params.SamplingParams(**req.to_sampling_kwargs())
        assert params.logit_bias in (None, {5: 100.0})


# ============================================================================ max_tokens


@SETTINGS
@given(st.integers(-(2**40), 0), st.booleans(), st.sampled_from(["max_tokens", "max_completion_tokens"]))
def test_nonpositive_max_tokens_is_refused(value, chat, field):
    """vLLM's SamplingParams refuses max_tokens < 1 and its serving code hands it the request's
    value: a 400 naming the field, never "unset"."""
    if chat:
        message, param = refusal(ChatCompletionRequest, {"messages": USER, field: value})
    else:
        field = "max_tokens"
        message, param = refusal(CompletionRequest, {"prompt": "x", field: value})
    assert param == field
    assert message == f"{field}: must be at least 1, got {value}"


@SETTINGS
@given(st.integers(-(2**40), 0), st.one_of(st.none(), st.integers(1, 100)))
def test_max_completion_tokens_refused_whatever_max_tokens_says(value, max_tokens):
    """vLLM uses max_completion_tokens whenever it is not null, so a non-positive one is refused
    even next to a valid max_tokens."""
    body = {"messages": USER, "max_completion_tokens": value}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    _, param = refusal(ChatCompletionRequest, body)
    assert param == "max_completion_tokens"


def test_absent_and_null_max_tokens():
    # /v1/completions: absent is vLLM's default 16; /v1/chat/completions: absent is unset
    assert CompletionRequest(prompt="x").max_tokens == 16
    assert CompletionRequest(prompt="x").to_sampling_kwargs()["max_tokens"] == 16
    assert ChatCompletionRequest(messages=USER).to_sampling_kwargs()["max_tokens"] is None
    # null is unset on both (up to the context)
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).to_sampling_kwargs()[
        "max_tokens"] is None
    assert ChatCompletionRequest.model_validate({"messages": USER, "max_tokens": None,
                                                 "max_completion_tokens": None}).effective_max_tokens is None
    # generation_config's max_new_tokens is the fallback for an unset limit, not a cap (vLLM's get_max_tokens)
    assert CompletionRequest(prompt="x", max_tokens=None).to_sampling_kwargs({"max_new_tokens": 9})["max_tokens"] == 9
    assert ChatCompletionRequest(messages=USER).to_sampling_kwargs({"max_tokens": 9})["max_tokens"] == 9
    assert CompletionRequest(prompt="x").to_sampling_kwargs({"max_tokens": 9})["max_tokens"] == 16
    assert CompletionRequest(prompt="x", max_tokens=50).to_sampling_kwargs({"max_tokens": 9})["max_tokens"] == 50


@SETTINGS
@given(st.one_of(st.none(), st.integers(-3, 100)), st.one_of(st.none(), st.integers(-3, 100)))
def test_max_completion_tokens_takes_precedence(max_tokens, max_completion_tokens):
    body = {"messages": USER}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if max_completion_tokens is not None:
        body["max_completion_tokens"] = max_completion_tokens
    want = max_completion_tokens if max_completion_tokens is not None else max_tokens
    if want is not None and want < 1:
        _, param = refusal(ChatCompletionRequest, body)
        assert param == ("max_completion_tokens" if max_completion_tokens is not None else "max_tokens")
        return
    req = ChatCompletionRequest.model_validate(body)
    assert req.effective_max_tokens == want == req.to_sampling_kwargs()["max_tokens"]


def test_echo_with_zero_max_tokens_scores_the_prompt():
    req = CompletionRequest.model_validate({"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 1})
    assert req.echo_without_generation
    kw = req.to_sampling_kwargs()
    assert kw["max_tokens"] == 1 and kw["prompt_logprobs"] == 1
    # only echo=true with exactly 0 is the idiom
    for body in ({"prompt": "x", "echo": True, "max_tokens": -1}, {"prompt": "x", "max_tokens": 0},
                 {"prompt": "x", "echo": False, "max_tokens": 0}):
        _, param = refusal(CompletionRequest, body)
        assert param == "max_tokens"
    req = CompletionRequest.model_validate({"prompt": "x", "echo": True})
    assert not req.echo_without_generation and req.to_sampling_kwargs()["max_tokens"] == 16
    # the idiom runs one token: min_tokens is held to it as vLLM's SamplingParams(max_tokens=1) holds it
    assert CompletionRequest.model_validate({"prompt": "x", "echo": True, "max_tokens": 0,
                                             "min_tokens": 1}).to_sampling_kwargs()["min_tokens"] == 1
    _, param = refusal(CompletionRequest, {"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 2})
    assert param == "min_tokens"


def test_min_tokens_above_max_tokens_refused():
    message, param = refusal(CompletionRequest, {"prompt": "x", "max_tokens": 3, "min_tokens": 4})
    assert param == "min_tokens" and "max_tokens=3" in message
    message, param = refusal(ChatCompletionRequest, {"messages": USER, "max_tokens": 50,
                                                     "max_completion_tokens": 3, "min_tokens": 4})
    assert param == "min_tokens"
    message, param = refusal(CompletionRequest, {"prompt": "x", "min_tokens": 17})  # the default 16 bounds it
    assert param == "min_tokens" and "max_tokens=16" in message
    CompletionRequest(prompt="x", max_tokens=None, min_tokens=4)  # unset max: no bound


# ============================================================================ invalid values


not_a_number = st.one_of(st.text(max_size=3), st.booleans(), st.lists(st.integers(), max_size=1))
not_an_int = st.one_of(not_a_number, st.floats(allow_nan=False).filter(lambda f: True))
not_a_bool = st.one_of(st.integers(), st.text(max_size=3), st.floats(allow_nan=False))

invalid_common = {
    "temperature": st.one_of(st.floats(max_value=0, exclude_max=True), st.floats(min_value=2, exclude_min=True),
                             not_a_number, st.just(float("nan"))),
    "top_p": st.one_of(st.floats(max_value=0), st.floats(min_value=1, exclude_min=True), not_a_number),
    "top_k": st.one_of(st.integers(max_value=-2), not_an_int),
    "min_p": st.one_of(st.floats(max_value=0, exclude_max=True), st.floats(min_value=1, exclude_min=True)),
    "presence_penalty": st.one_of(st.floats(min_value=2, exclude_min=True), st.floats(max_value=-2, exclude_max=True)),
    "frequency_penalty": st.one_of(st.floats(min_value=2, exclude_min=True), not_a_number),
    "repetition_penalty": st.one_of(st.floats(max_value=0), not_a_number),
    "n": st.one_of(st.integers(max_value=0), st.integers(min_value=16385), not_an_int),
    "seed": st.one_of(st.integers(max_value=-(2**63) - 1), st.integers(min_value=2**64), not_an_int),
    "max_tokens": st.one_of(not_an_int, st.integers(max_value=0)),
    "min_tokens": st.one_of(st.integers(max_value=-1), not_an_int),
    "prompt_logprobs": st.one_of(st.integers(max_value=-1), st.integers(min_value=MAX_LOGPROBS + 1), not_an_int),
    "stop": st.one_of(st.integers(), st.just(""), st.lists(st.integers(), min_size=1),
                      st.lists(text, max_size=2).map(lambda xs: xs + [""])),
    "stop_token_ids": st.one_of(st.lists(st.integers(max_value=-1), min_size=1), st.lists(text, min_size=1),
                                st.integers()),
    "logit_bias": st.one_of(st.dictionaries(st.text(alphabet="abc", min_size=1), st.floats(-1, 1), min_size=1),
                            st.dictionaries(st.integers(0, 9).map(str), text, min_size=1), st.integers()),
    "stream": not_a_bool,
    "ignore_eos": not_a_bool,
    "skip_special_tokens": not_a_bool,
    "include_stop_str_in_output": not_a_bool,
    "user": st.one_of(st.integers(), st.booleans()),
    "priority": not_an_int,
    "response_format": st.one_of(st.sampled_from([{"type": "xml"}, {"type": "json_schema",
                                                                      "json_schema": {"schema": {"type": "strin"}}}]),
                                 st.integers()),
    "stream_options": st.just({"include_usage": True}),  # without stream=true
    "best_of": st.integers(min_value=2, max_value=5),    # != n (1)
}

invalid_completion = {
    **invalid_common,
    "prompt": st.one_of(st.just(""), st.just([]), st.just([[]]), st.just([1, "a"]), st.integers(),
                        st.lists(st.integers(max_value=-1), min_size=1), st.just([""]), st.just({"a": 1})),
    "logprobs": st.one_of(st.integers(max_value=-1), st.integers(min_value=MAX_LOGPROBS + 1), not_an_int),
    "echo": not_a_bool,
    "suffix": st.one_of(text, st.integers()),
    "add_special_tokens": not_a_bool,
}

invalid_chat = {
    **invalid_common,
    "messages": st.one_of(
        st.just([]), st.just("hi"), st.just([{"role": "robot", "content": "x"}]),
        st.just([{"content": "x"}]), st.just([{"role": "user"}]), st.just([{"role": "user", "content": 3}]),
        st.sampled_from(["image_url", "input_audio", "video_url", "file", "bogus"]).map(
            lambda t: [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": t}]}])),
    "logprobs": st.one_of(st.integers(), st.text(max_size=3)),
    "top_logprobs": st.one_of(st.integers(max_value=-1), st.integers(min_value=MAX_LOGPROBS + 1), not_an_int),
    "max_completion_tokens": st.one_of(not_an_int, st.integers(max_value=0)),
    "tools": st.sampled_from([[{"type": "function"}], [{"type": "function", "function": {"description": "no name"}}],
                              [{"type": "function", "function": {"name": "f", "parameters": []}}]]),
    "tool_choice": st.sampled_from(["auto", "required", "sometimes", {"type": "function", "function": {"name": "f"}}]),
    "functions": st.just([{"name": "f"}]),
    "chat_template_kwargs": st.one_of(st.integers(), st.text(max_size=3)),
    "add_generation_prompt": not_a_bool,
    "continue_final_message": not_a_bool,
    "echo": not_a_bool,
}


@st.composite
def one_invalid_field(draw, table: dict):
    name = draw(st.sampled_from(sorted(table)))
    return name, draw(table[name])


@SETTINGS
@given(one_invalid_field(invalid_completion))
def test_invalid_completion_field_is_named(case):
    name, value = case
    body = {"prompt": "x", name: value}
    message, param = refusal(CompletionRequest, body)
    assert message.startswith(f"{name}") and param is not None and param.startswith(name), (message, param)


@SETTINGS
@given(one_invalid_field(invalid_chat))
def test_invalid_chat_field_is_named(case):
    name, value = case
    body = {"messages": USER, name: value}
    message, param = refusal(ChatCompletionRequest, body)
    assert message.startswith(f"{name}") and param is not None and param.startswith(name), (message, param)


def test_range_messages_name_the_allowed_range():
    message, param = refusal(CompletionRequest, {"prompt": "x", "temperature": -1})
    assert param == "temperature"
    assert message.startswith("temperature: Input should be greater than or equal to 0")
    assert "[0, 2]" in message
    message, _ = refusal(CompletionRequest, {"prompt": "x", "top_p": 0})
    assert "top_p" in message and "(0, 1]" in message
    message, _ = refusal(CompletionRequest, {"prompt": "x", "logprobs": 21})
    assert "logprobs" in message and "[0, 20]" in message


def test_top_logprobs_needs_logprobs():
    message, param = refusal(ChatCompletionRequest, {"messages": USER, "top_logprobs": 2})
    assert param == "top_logprobs"
    ChatCompletionRequest(messages=USER, top_logprobs=0)  # 0 without logprobs is harmless, as in vLLM


def test_prompt_logprobs_with_stream_refused():
    _, param = refusal(CompletionRequest, {"prompt": "x", "stream": True, "prompt_logprobs": 1})
    assert param == "prompt_logprobs"


def test_unsupported_features_refused_by_name():
    cases = [
        (CompletionRequest, {"prompt": "x", "suffix": "tail"}, "suffix"),
        (ChatCompletionRequest, {"messages": USER, "functions": [{"name": "f"}]}, "functions"),
        (CompletionRequest, {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ]
    for model, body, name in cases:
        message, param = refusal(model, body)
        assert name in message and "not supported" in message, message
        assert param == name
    message, _ = refusal(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]})
    assert "image_url" in message and "not supported" in message and "messages[0].content" in message
    # no-op values of those fields are accepted
    ChatCompletionRequest.model_validate({"messages": USER, "tool_choice": "none", "tools": [],
                                          "use_beam_search": False, "store": False,
                                          "response_format": {"type": "text"}})
    ChatCompletionRequest.model_validate({"messages": USER, "tool_choice": "auto", "tools": []})
    # tools with vLLM's default tool_choice ("auto") are a valid request: the server refuses them
    # only when it has no tool-call parser (test_tool_calls.py, test_auto_tools.py)
    ChatCompletionRequest.model_validate({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]})


def test_continue_final_message():
    req = ChatCompletionRequest.model_validate({"messages": USER, "continue_final_message": True})
    assert req.continue_final_message and not req.add_generation_prompt
    _, param = refusal(ChatCompletionRequest, {"messages": USER, "continue_final_message": True,
                                               "add_generation_prompt": True})
    assert param == "continue_final_message"


field_name = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True).filter(lambda s: not keyword.iskeyword(s))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
IGNORED = "Request fields ignored"


def unknown_to(model) -> st.SearchStrategy:
    """Field names `model` does not read (not its fields, not its refused-unless-no-op names)."""
    return field_name.filter(lambda n: n not in model.model_fields and n not in model._UNSUPPORTED)


def ignored_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and IGNORED in r.getMessage()]


FIXTURE_SETTINGS = settings(SETTINGS, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@FIXTURE_SETTINGS
@given(st.data(), st.booleans())
def test_unknown_fields_are_ignored_and_logged(caplog, data, chat):
    """vLLM's request models allow extra fields and log their names: an unknown field, whatever
    its name and value, changes nothing about the request and is named in one warning."""
    model = ChatCompletionRequest if chat else CompletionRequest
    base = _fix_consistency(data.draw(request_body(chat_fields, ("messages",)) if chat
                                      else request_body(completion_fields, ("prompt",))), chat)
    if chat and base.get("logprobs"):
        base["top_logprobs"] = 2
    extra = data.draw(st.dictionaries(unknown_to(model), json_values, min_size=1, max_size=4))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vtool.server"):
        req = model.model_validate({**base, **extra})
    warnings = ignored_warnings(caplog)
    assert len(warnings) == 1, warnings  # once per request
    for name in extra:
        assert name in warnings[0]
    plain = model.model_validate(base)
    assert req.model_dump() == plain.model_dump()  # nothing of them is kept
    assert req.to_sampling_kwargs() == plain.to_sampling_kwargs()
    sampling_params = pytest.importorskip("vtool.runtime.sampling.params")

    def params(request):  # SamplingParams, or what it refuses the request with
        try:
            return sampling_params.SamplingParams(**request.to_sampling_kwargs())
        except VtoolError as err:
            return str(err)

    assert params(req) == params(plain)  # nothing of them reaches SamplingParams
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vtool.server"):
        model.model_validate(base)
    assert ignored_warnings(caplog) == []  # a request without unknown fields logs nothing


def test_nested_unknown_fields_are_named_with_their_path(caplog):
    body = {"messages": [{"role": "system", "content": "s"},
                         {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"x": 1}}],
                          "foo": 1}],
            "stream": True, "stream_options": {"include_usage": True, "extra_stat": True},
            "response_format": {"type": "text", "strict": True}, "frobnicate": [1]}
    with caplog.at_level(logging.WARNING, logger="vtool.server"):
        req = ChatCompletionRequest.model_validate(body)
    assert req.ignored_fields() == ["frobnicate", "stream_options.extra_stat", "response_format.strict",
                                    "messages[1].foo", "messages[1].content[0].cache_control"]
    assert ignored_warnings(caplog) == ["Request fields ignored (not parameters this server reads): frobnicate, "
                                        "stream_options.extra_stat, response_format.strict, messages[1].foo, "
                                        "messages[1].content[0].cache_control"]
    assert req.template_messages()[1] == {"role": "user", "content": "a"}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vtool.server"):
        TokenizeRequest.model_validate({"prompt": "x", "bogus": 1})
        DetokenizeRequest.model_validate({"tokens": [1], "bogus": 2})
    assert len(ignored_warnings(caplog)) == 2


def test_unknown_fields_do_not_hide_refusals():
    # known-but-unsupported fields, wrong types and ranges stay 400s next to unknown fields
    message, param = refusal(CompletionRequest, {"prompt": "x", "use_beam_search": True, "frobnicate": 1})
    assert param == "use_beam_search" and "frobnicate" not in message
    _, param = refusal(CompletionRequest, {"prompt": "x", "temperature": "hot", "frobnicate": 1})
    assert param == "temperature"
    _, param = refusal(ChatCompletionRequest, {"messages": USER, "top_p": 7, "bogus": None})
    assert param == "top_p"


# ============================================================================ messages / content parts


@SETTINGS
@given(st.lists(st.text(max_size=6), min_size=1, max_size=4))
def test_text_parts_join_with_newlines(parts):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": p} for p in parts]}])
    assert req.template_messages() == [{"role": "user", "content": "\n".join(parts)}]


def test_message_history_from_openai_client_accepted():
    # what the openai client sends back when a response message is appended to the history
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "hello", "refusal": None, "annotations": [], "audio": None,
                "function_call": None, "tool_calls": [{"id": "c1", "type": "function",
                                                       "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
               {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    req = ChatCompletionRequest(messages=history)
    rendered = req.template_messages()
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert rendered[2]["tool_call_id"] == "c1"


# ============================================================================ tokenize / responses


def test_tokenize_detokenize_requests():
    assert TokenizeRequest(prompt="x").add_special_tokens is True
    req = TokenizeRequest(messages=USER)
    assert req.add_special_tokens is False and req.add_generation_prompt
    assert req.template_messages() == USER
    assert TokenizeRequest(prompt="x", add_special_tokens=False, return_token_strs=True).add_special_tokens is False
    for body in ({}, {"prompt": "x", "messages": USER}):
        _, param = refusal(TokenizeRequest, body)
        assert param == "prompt"
    assert DetokenizeRequest(tokens=[1, 2]).tokens == [1, 2]
    _, param = refusal(DetokenizeRequest, {"tokens": [1, -2]})
    assert param == "tokens"
    TokenizeResponse(count=2, max_model_len=4096, tokens=[1, 2], token_strs=["a", "b"])


def test_response_shapes():
    c = CompletionResponse(model="m", choices=[{"index": 0, "text": "hi", "finish_reason": "length", "logprobs": {
        "tokens": ["h", "i"], "token_logprobs": [None, -0.5], "top_logprobs": [None, {"i": -0.5}],
        "text_offset": [0, 1]}}], usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3})
    d = c.model_dump()
    assert d["id"].startswith("cmpl-") and len(d["id"]) == 5 + 32 and d["object"] == "text_completion"
    assert isinstance(d["created"], int)
    assert set(d["choices"][0]["logprobs"]) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    ch = ChatCompletionResponse(model="m", choices=[{"index": 0, "message": {"role": "assistant", "content": "x"},
                                                     "logprobs": {"content": [{"token": "x", "logprob": -1.0,
                                                                               "bytes": [120], "top_logprobs": [
                                                                                   {"token": "x", "logprob": -1.0,
                                                                                    "bytes": [120]}]}]}}],
                                usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    d = ch.model_dump()
    assert d["id"].startswith("chatcmpl-") and d["object"] == "chat.completion"
    assert d["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0] == {"token": "x", "logprob": -1.0,
                                                                             "bytes": [120]}
    chunk = ChatCompletionStreamResponse(model="m", choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}])
    event = sse_event(chunk, exclude_unset=True)
    assert event.startswith("data: {") and event.endswith("\n\n")
    assert json.loads(event[6:])["object"] == "chat.completion.chunk"
    assert CompletionStreamResponse(model="m", choices=[{"index": 0, "text": "a"}]).object == "text_completion"
    assert ModelList(data=[ModelCard(id="m", max_model_len=8)]).model_dump()["data"][0]["object"] == "model"
    body = error_json(400, "bad", param="temperature")
    assert body == {"error": {"message": "bad", "type": "BadRequestError", "param": "temperature", "code": 400}}
    ErrorResponse.model_validate(body)
    assert NotFoundError("x").to_json()["error"]["type"] == "NotFoundError"


# ============================================================================ a real FastAPI app


def make_app():
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        prompt = req.prompt
        if prompt == "vtool-error":
            raise VtoolError("temperature 7 is outside what this model accepts")
        if prompt == "value-error":
            raise ValueError("a plain ValueError")
        if prompt == "crash":
            raise RuntimeError("kaboom")
        if prompt == "missing-model":
            raise NotFoundError("The model `nope` does not exist.", param="model")
        kwargs = req.to_sampling_kwargs()
        if req.stream:
            async def events():
                for i, piece in enumerate(["a", "b"]):
                    yield sse_event(CompletionStreamResponse(model="m", choices=[{"index": 0, "text": piece}]))
                yield sse_event(CompletionStreamResponse(model="m", choices=[
                    {"index": 0, "text": "", "finish_reason": "length"}]))
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return CompletionResponse(model=req.model or "m", choices=[
            {"index": 0, "text": json.dumps(kwargs["max_tokens"]), "finish_reason": "length"}],
            usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        kwargs = req.to_sampling_kwargs()
        return ChatCompletionResponse(model="m", choices=[
            {"index": 0, "message": {"role": "assistant", "content": json.dumps(kwargs["logprobs"])},
             "logprobs": {"content": [{"token": "x", "logprob": -0.1, "bytes": [120], "top_logprobs": []}]}}],
            usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id="m", max_model_len=2048)])

    return app


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    return TestClient(make_app(), raise_server_exceptions=False)


def _assert_openai_error(response, status: int, *fragments: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    for fragment in fragments:
        assert fragment in body["error"]["message"], body
    return body["error"]


@pytest.mark.parametrize("raw, fragment", [
    (b'{"prompt": "x",', "not valid JSON"),
    (b"{prompt: x}", "not valid JSON"),
    (b"", "body is required"),
    (b"[1, 2]", "must be a JSON object"),
    (b'"hello"', "must be a JSON object"),
])
def test_bad_json_is_400(client, raw, fragment):
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    err = _assert_openai_error(r, 400, fragment)
    assert err["type"] == "BadRequestError"


@SETTINGS
@given(one_invalid_field(invalid_completion))
def test_invalid_fields_are_400_not_422(client, case):
    name, value = case
    # Python's json writes NaN / Infinity and Starlette reads them back: they must be refused too
    r = client.post("/v1/completions", content=json.dumps({"prompt": "x", name: value}),
                    headers={"content-type": "application/json"})
    err = _assert_openai_error(r, 400, name)
    assert err["param"].startswith(name)


def test_app_error_mapping(client):
    err = _assert_openai_error(client.post("/v1/completions", json={"prompt": "x", "temperature": "warm"}), 400,
                               "temperature: Input should be a valid number")
    assert err["param"] == "temperature"
    ok = client.post("/v1/completions", json={"prompt": "x", "bogus": 1})  # unknown: ignored, as vLLM
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "16"
    _assert_openai_error(client.post("/v1/completions", json={"prompt": "vtool-error"}), 400, "temperature 7")
    _assert_openai_error(client.post("/v1/completions", json={"prompt": "value-error"}), 400, "plain ValueError")
    err = _assert_openai_error(client.post("/v1/completions", json={"prompt": "missing-model"}), 404, "nope")
    assert err["type"] == "NotFoundError" and err["param"] == "model"
    err = _assert_openai_error(client.post("/v1/completions", json={"prompt": "crash"}), 500, "kaboom")
    assert err["type"] == "InternalServerError"
    _assert_openai_error(client.get("/v1/nowhere"), 404)
    _assert_openai_error(client.get("/v1/completions"), 405)
    _assert_openai_error(client.post("/v1/completions", content=b"prompt=x",
                                     headers={"content-type": "text/plain"}), 400)
    err = _assert_openai_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}), 400,
                               "max_tokens: must be at least 1, got -1")
    assert err["param"] == "max_tokens"
    err = _assert_openai_error(client.post("/v1/chat/completions", json={"messages": USER,
                                                                          "max_completion_tokens": 0}), 400)
    assert err["param"] == "max_completion_tokens"
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": None})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "null"
    ok = client.post("/v1/completions", json={"prompt": "x", "echo": True, "max_tokens": 0})
    assert ok.json()["choices"][0]["text"] == "1"  # echo without generation survives FastAPI's parsing
    assert client.get("/v1/models").json()["data"][0]["id"] == "m"
    assert "/v1/completions" in client.app.openapi()["paths"]  # the schema generates


@FIXTURE_SETTINGS
@given(st.dictionaries(unknown_to(CompletionRequest), json_values, min_size=1, max_size=4), st.booleans())
def test_unknown_fields_never_cause_a_4xx(client, caplog, extra, stream):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vtool.server"):
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 7, "stream": stream, **extra})
    assert r.status_code == 200, r.text
    if not stream:
        assert r.json()["choices"][0]["text"] == "7"
    assert len(ignored_warnings(caplog)) == 1


# ============================================================================ the openai client


@pytest.fixture(scope="module")
def server_url():
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(), log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def test_openai_client_sees_bad_request_errors(server_url):
    import openai

    client = openai.OpenAI(base_url=server_url, api_key="sk-test", max_retries=0, timeout=10)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="x", temperature=-1)
    assert info.value.status_code == 400
    assert "temperature: Input should be greater than or equal to 0" in info.value.message
    assert info.value.body["param"] == "temperature"

    # an unknown field is ignored (vLLM logs it); a non-positive max_tokens is refused
    ok = client.chat.completions.create(model="m", messages=USER, extra_body={"frobnicate": True})
    assert ok.choices[0].message.content == "null"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="x", max_tokens=-1)
    assert info.value.body["param"] == "max_tokens" and "must be at least 1" in info.value.message

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://example.invalid/x.png"}}]}])
    assert "image_url" in info.value.message

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="m", prompt="missing-model")
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="m", prompt="crash")

    # valid requests: the client parses our response bodies
    done = client.completions.create(model="m", prompt="x", max_tokens=None)  # sent as null: unset
    assert done.choices[0].text == "null" and done.id.startswith("cmpl-")
    assert client.completions.create(model="m", prompt="x").choices[0].text == "16"  # vLLM's default
    chat = client.chat.completions.create(model="m", messages=USER, logprobs=True, top_logprobs=2,
                                          max_completion_tokens=4)
    assert chat.choices[0].message.content == "2" and chat.choices[0].logprobs.content[0].bytes == [120]
    pieces = [c.choices[0].text for c in client.completions.create(model="m", prompt="x", stream=True)]
    assert pieces == ["a", "b", ""]
    assert [m.id for m in client.models.list()] == ["m"]


# ============================================================================ the real handlers, a fake engine
#
# completions.py's create_completion / create_chat_completion behind FastAPI, over an engine
# that needs no model: a character tokenizer and scripted outputs whose logprob dicts are
# built as the engine builds them (the chosen token first, then the top-N, which here never
# holds the chosen token, so that the order rules are visible).

FAKE_TOP = [ord("z"), ord("y"), ord("x"), ord("w")]


class CharTokenizer:
    vocab_size = 256

    def encode(self, text, add_special_tokens=True):
        return [ord(ch) for ch in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def id_to_token(self, token_id):
        return chr(token_id)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        text = "".join(f"<{m['role']}>{m['content'] or ''}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def fake_entry(token: int, logprob: float, num: int):
    from vtool.runtime.sampling.host import Logprob

    entry = {token: Logprob(logprob, rank=len(FAKE_TOP) + 1)}
    for rank, top in enumerate(FAKE_TOP[:num], start=1):
        entry[top] = Logprob(-0.1 * rank, rank=rank)
    return entry


class FakeStream:
    def __init__(self, outputs):
        self.outputs, self.arrival, self.closed = outputs, time.monotonic(), False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for out in self.outputs:
            yield out

    def close(self):
        self.closed = True


class FakeEngine:
    """Generates 'a', 'b', 'c', ... (max_tokens of them, 3 when unset), one output each."""

    def __init__(self):
        self.added = []
        self.parents = {}  # request id -> the (parent id, n) it was added with

    async def add(self, request_id, prompt_ids, params, priority=0, parent=None):
        from vtool.runtime.engine.request import StepOutput

        self.added.append((request_id, list(prompt_ids), params))
        self.parents[request_id] = parent
        count = params.max_tokens if params.max_tokens else 3
        plp = None
        if params.prompt_logprobs is not None:
            plp = [None] + [fake_entry(t, -1.0, params.prompt_logprobs) for t in prompt_ids[1:]]
        outs = []
        for k in range(count):
            token = ord("a") + k
            last = k == count - 1
            outs.append(StepOutput(
                request_id=request_id, new_token_ids=[token], new_text=chr(token),
                new_logprobs=[fake_entry(token, -0.5 - k, params.logprobs)] if params.logprobs is not None else [],
                finished=last, finish_reason="length" if last else None, stop_reason=None,
                num_prompt_tokens=len(prompt_ids), num_output_tokens=k + 1, num_cached_tokens=0,
                prompt_logprobs=plp if k == 0 else None))
        return FakeStream(outs)


def fake_state(engine, force_include_usage=False):
    from vtool.runtime.serving.completions import ServingState

    values = {"engine": engine, "tokenizer": CharTokenizer(), "served_names": ["m"], "max_model_len": 64,
              "metrics": None, "metrics_enabled": False, "sampling_defaults": {},
              "force_include_usage": force_include_usage}
    return ServingState(**{f.name: values[f.name] for f in dataclasses.fields(ServingState) if f.name in values})


def fake_client(force_include_usage=False):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vtool.runtime.serving.completions import create_chat_completion, create_completion

    engine = FakeEngine()
    state = fake_state(engine, force_include_usage)
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: HTTPRequest):
        return await create_completion(body, raw, state)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: HTTPRequest):
        return await create_chat_completion(body, raw, state)

    client = TestClient(app, raise_server_exceptions=True)
    client.engine = engine
    return client


@pytest.fixture(scope="module")
def fake():
    return fake_client()


def sse(response) -> list[dict]:
    assert response.status_code == 200, response.text
    events = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completions_default_max_tokens_reaches_the_engine(fake):
    body = fake.post("/v1/completions", json={"prompt": "hi"}).json()
    assert fake.engine.added[-1][2].max_tokens == 16 and body["usage"]["completion_tokens"] == 16
    fake.post("/v1/chat/completions", json={"messages": USER})
    assert fake.engine.added[-1][2].max_tokens is None  # chat: up to the context


def test_parallel_samples_name_their_parent_and_single_requests_none(fake):
    """n > 1: every child reaches the engine with (its prompt's request id, n), the parent the
    metrics count once (vLLM's ParentRequest); n = 1 and each prompt of a list apart."""
    fake.post("/v1/completions", json={"prompt": ["hi", "there"], "n": 3, "max_tokens": 2})
    children = [rid for rid, _, _ in fake.engine.added[-6:]]
    parents = [fake.engine.parents[rid] for rid in children]
    assert len({p for p in parents}) == 2 and all(p is not None and p[1] == 3 for p in parents)
    assert all(rid.startswith(p[0] + "-") for rid, p in zip(children, parents))
    fake.post("/v1/chat/completions", json={"messages": USER, "n": 2, "max_tokens": 2})
    assert {fake.engine.parents[rid][1] for rid, _, _ in fake.engine.added[-2:]} == {2}
    fake.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert fake.engine.parents[fake.engine.added[-1][0]] is None


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_zero_holds_the_chosen_token(fake, stream):
    """vLLM's completion top_logprobs keep the first logprobs + 1 entries of the engine's dict:
    with logprobs=0 that is {chosen token: its logprob}, never an empty dict."""
    r = fake.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 0, "stream": stream})
    if stream:
        parts = [e["choices"][0]["logprobs"] for e in sse(r) if e["choices"]]
        tops = [t for p in parts for t in p["top_logprobs"]]
        chosen = [t for p in parts for t in p["token_logprobs"]]
    else:
        lp = r.json()["choices"][0]["logprobs"]
        tops, chosen = lp["top_logprobs"], lp["token_logprobs"]
    assert tops == [{"a": -0.5}, {"b": -1.5}, {"c": -2.5}] and chosen == [-0.5, -1.5, -2.5]


def test_completion_and_chat_top_logprobs_follow_the_engine_dict_order(fake):
    lp = fake.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": 2}).json()["choices"][0][
        "logprobs"]
    assert list(lp["top_logprobs"][0].items()) == [("a", -0.5), ("z", -0.1), ("y", -0.2)]
    content = fake.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "logprobs": True,
                                                      "top_logprobs": 2}).json()["choices"][0]["logprobs"]["content"]
    # vLLM's chat top_logprobs: the first top_logprobs entries of the dict, the chosen token first
    assert [(t["token"], t["logprob"]) for t in content[0]["top_logprobs"]] == [("a", -0.5), ("z", -0.1)]
    content = fake.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "logprobs": True}).json()[
        "choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "a" and content[0]["top_logprobs"] == []


def test_completion_return_token_ids(fake):
    body = fake.post("/v1/completions", json={"prompt": ["hi", "yo"], "max_tokens": 2, "n": 2, "temperature": 1,
                                              "return_token_ids": True}).json()
    assert [c["prompt_token_ids"] for c in body["choices"]] == [[104, 105]] * 2 + [[121, 111]] * 2
    assert [c["token_ids"] for c in body["choices"]] == [[97, 98]] * 4
    plain = fake.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None and plain["text"] == "ab"
    # streamed: the prompt's ids in each choice's first chunk, each chunk's new ids in it
    events = sse(fake.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True,
                                                    "return_token_ids": True}))
    choices = [e["choices"][0] for e in events]
    assert [c["prompt_token_ids"] for c in choices] == [[104, 105], None, None]
    assert [c["token_ids"] for c in choices] == [[97], [98], [99]]
    plain = [e["choices"][0] for e in sse(fake.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                                            "stream": True}))]
    assert all(c["token_ids"] is None and c["prompt_token_ids"] is None for c in plain)


def test_completion_echo_shapes(fake):
    body = fake.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == "hiab"
    assert choice["logprobs"]["tokens"] == ["h", "i", "a", "b"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -0.5, -1.5]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3]
    # echo=true, max_tokens=0: the prompt alone (its logprobs alone), the one token run counted
    body = fake.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0, "echo": True, "logprobs": 1,
                                              "return_token_ids": True}).json()
    choice = body["choices"][0]
    # with return_token_ids vLLM echoes no prompt text: the ids say what the prompt was
    assert choice["text"] == "" and choice["prompt_token_ids"] == [104, 105] and choice["token_ids"] == [97]
    assert choice["logprobs"]["tokens"] == ["h", "i"] and body["usage"]["completion_tokens"] == 1
    events = sse(fake.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "echo": True, "stream": True}))
    choices = [e["choices"][0] for e in events]
    assert [c["text"] for c in choices] == ["hia", "b"]
    assert choices[0]["prompt_token_ids"] == [104, 105]  # vLLM sends the prompt's ids with the echo
    # a token-id prompt is echoed decoded
    assert fake.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 1, "echo": True}).json()[
        "choices"][0]["text"] == "hia"


def test_stream_offsets_count_generated_text(fake):
    events = sse(fake.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 1, "stream": True}))
    assert [e["choices"][0]["logprobs"]["text_offset"] for e in events] == [[0], [1], [2]]


def test_chat_return_token_ids(fake):
    body = fake.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "return_token_ids": True}).json()
    rendered = [ord(ch) for ch in "<user>hi</><assistant>"]
    assert body["prompt_token_ids"] == rendered and body["choices"][0]["token_ids"] == [97, 98]
    plain = fake.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).json()
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None
    events = sse(fake.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "n": 2, "temperature": 1,
                                                         "stream": True, "return_token_ids": True}))
    roles = [e for e in events if e["choices"][0]["delta"].get("role")]
    assert [e["choices"][0]["index"] for e in roles] == [0, 1] and events[:2] == roles  # vLLM: all role chunks first
    assert all(e["prompt_token_ids"] == rendered for e in roles)
    content = [e for e in events if e not in roles]
    assert all("prompt_token_ids" not in e for e in content)
    for index in (0, 1):
        assert [t for e in content if e["choices"][0]["index"] == index for t in e["choices"][0]["token_ids"]] == [97, 98]
    plain = sse(fake.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "stream": True}))
    assert all("prompt_token_ids" not in e and "token_ids" not in e["choices"][0] for e in plain)


# ---------------------------------------------------------------------- truncate_prompt_tokens


@settings(SETTINGS, max_examples=50)
@given(prompt=st.text(alphabet="abcdef", min_size=1, max_size=100),
       keep=st.one_of(st.just(-1), st.integers(1, 80)), as_ids=st.booleans(), endpoint=st.sampled_from(["cmpl", "chat"]))
def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(prompt, keep, as_ids, endpoint):
    """vLLM: the last `keep` tokens of the (rendered) prompt, -1 for as many as max_model_len (64
    here) holds; more than max_model_len is refused by name with vLLM's message and nothing
    reaches the engine."""
    client = fake_client()
    if endpoint == "cmpl":
        body = {"prompt": [ord(c) for c in prompt] if as_ids else prompt}
        path, ids = "/v1/completions", [ord(c) for c in prompt]
    else:
        body = {"messages": [{"role": "user", "content": prompt}]}
        path, ids = "/v1/chat/completions", [ord(c) for c in f"<user>{prompt}</><assistant>"]
    r = client.post(path, json={**body, "max_tokens": 1, "truncate_prompt_tokens": keep})
    limit = 64 if keep == -1 else keep
    if limit > 64:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "truncate_prompt_tokens"
        assert error["message"] == (f"truncate_prompt_tokens value ({keep}) is greater than max_model_len (64). "
                                    "Please, select a smaller truncation size.")
        assert client.engine.added == []
        return
    assert r.status_code == 200, r.text
    assert client.engine.added[-1][1] == ids[-limit:]
    assert r.json()["usage"]["prompt_tokens"] == min(limit, len(ids))


@pytest.mark.parametrize("value", [0, -2, "ten", 2.5])
def test_truncate_prompt_tokens_out_of_range_is_refused_by_name(fake, value):
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": USER})):
        r = fake.post(path, json={**body, "truncate_prompt_tokens": value})
        assert r.status_code == 400 and "truncate_prompt_tokens" in r.text, r.text


# ------------------------------------------------------------------ return_tokens_as_token_ids


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_name_tokens_by_id_when_asked(fake, stream):
    """vLLM: "token_id:N" for the chosen token and every top entry; the text itself is
    unchanged. text_offset, as vLLM counts it: within one response by those strings' lengths,
    and a stream's chunk starts at the length of the text streamed before it."""
    r = fake.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 1, "stream": stream,
                                           "return_tokens_as_token_ids": True})
    if stream:
        parts = [e["choices"][0]["logprobs"] for e in sse(r) if e["choices"] and e["choices"][0]["logprobs"]]
        lp = {k: [x for p in parts for x in p[k]] for k in ("tokens", "top_logprobs", "text_offset")}
        text = "".join(e["choices"][0]["text"] for e in sse(fake.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 2, "stream": True, "return_tokens_as_token_ids": True})) if e["choices"])
    else:
        choice = r.json()["choices"][0]
        lp, text = choice["logprobs"], choice["text"]
    assert text == "ab"
    assert lp["tokens"] == ["token_id:97", "token_id:98"]
    assert lp["top_logprobs"] == [{"token_id:97": -0.5, "token_id:122": -0.1}, {"token_id:98": -1.5, "token_id:122": -0.1}]
    assert lp["text_offset"] == ([0, len("a")] if stream else [0, len("token_id:97")])


def test_chat_logprobs_name_tokens_by_id_and_the_server_flag_is_the_default():
    """The request's field wins; unset, the server's --return-tokens-as-token-ids decides."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vtool.runtime.serving.completions import create_chat_completion

    for server_flag in (False, True):
        state = fake_state(FakeEngine())
        state.return_tokens_as_token_ids = server_flag
        app = FastAPI()
        install_error_handlers(app)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, raw: HTTPRequest):
            return await create_chat_completion(body, raw, state)

        client = TestClient(app)
        for requested in (None, False, True):
            body = {"messages": USER, "max_tokens": 1, "logprobs": True, "top_logprobs": 2}
            if requested is not None:
                body["return_tokens_as_token_ids"] = requested
            content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"][0]
            as_ids = server_flag if requested is None else requested
            names = ["token_id:97", "token_id:122"] if as_ids else ["a", "z"]
            assert content["token"] == names[0] and content["bytes"] == list(names[0].encode())
            assert [t["token"] for t in content["top_logprobs"]] == names
            assert [t["bytes"] for t in content["top_logprobs"]] == [list(n.encode()) for n in names]


roles = st.sampled_from(["system", "user", "assistant"])
chat_messages = st.lists(st.fixed_dictionaries({"role": roles, "content": st.text(alphabet="pqrs ", max_size=4)}),
                         min_size=1, max_size=4)


@settings(SETTINGS, max_examples=40)
@given(chat_messages, st.sampled_from(["generation_prompt", "continue", "neither"]), st.booleans(), st.booleans())
def test_chat_echo_and_role(messages, mode, echo, stream):
    """vLLM: the answer's role is the assistant's after a generation prompt, else the last
    message's; echo puts the last message's content first when its role is the answer's."""
    client = fake_client()
    body = {"messages": messages, "max_tokens": 2, "echo": echo, "stream": stream}
    if mode == "continue":
        body["continue_final_message"] = True
    elif mode == "neither":
        body["add_generation_prompt"] = False
    role = "assistant" if mode == "generation_prompt" else messages[-1]["role"]
    prefix = messages[-1]["content"] if echo and messages[-1]["role"] == role else ""
    r = client.post("/v1/chat/completions", json=body)
    if not stream:
        message = r.json()["choices"][0]["message"]
        assert message["role"] == role and message["content"] == prefix + "ab"
        return
    events = sse(r)
    assert events[0]["choices"][0]["delta"] == {"role": role, "content": ""}
    deltas = [e["choices"][0]["delta"]["content"] for e in events[1:]]
    if prefix:
        assert deltas[0] == prefix  # its own chunk, right after the role
    assert "".join(deltas) == prefix + "ab"


def test_chat_echo_asks_for_prompt_logprobs(fake):
    # vLLM: echo sets prompt_logprobs to top_logprobs (0 by default); a stream never carries them
    body = fake.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "echo": True}).json()
    assert fake.engine.added[-1][2].prompt_logprobs == 0 and body["prompt_logprobs"][0] is None
    fake.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "echo": True, "stream": True})
    assert fake.engine.added[-1][2].prompt_logprobs is None


def test_continuous_usage_is_per_choice():
    client = fake_client()
    events = sse(client.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 2, "n": 2, "temperature": 1, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    for e in events[:-1]:
        index = e["choices"][0]["index"]
        done = sum(len(x["choices"][0]["text"]) for x in events[:-1]
                   if x["choices"][0]["index"] == index and events.index(x) <= events.index(e))
        assert e["usage"] == {"prompt_tokens": 2, "completion_tokens": done, "total_tokens": 2 + done,
                              "prompt_tokens_details": None}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4,
                                                                     "total_tokens": 6}
    # continuous_usage_stats needs include_usage (vLLM); the server's force flag turns both on
    events = sse(client.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": False, "continuous_usage_stats": True}}))
    assert all(e["usage"] is None for e in events)
    forced = fake_client(force_include_usage=True)
    events = sse(forced.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "stream": True}))
    assert all("usage" in e for e in events) and events[-1]["choices"] == []


# ============================================================================ structured output


@pytest.mark.parametrize("body, kind, field", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
     "json_schema", "response_format.json_schema"),
    ({"structured_outputs": {"json": {"type": "boolean"}}}, "json_schema", "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, "grammar", "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs.json_object"),
    ({"guided_json": {"type": "integer"}}, "json_schema", "guided_json"),
    ({"guided_regex": "a+"}, "regex", "guided_regex"),
    ({"guided_choice": ["x"]}, "choice", "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", "guided_grammar"),
])
@pytest.mark.parametrize("model, base", [(CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": USER})])
def test_structured_output_fields_become_one_grammar(model, base, body, kind, field):
    spec = model.model_validate({**base, **body}).to_sampling_kwargs()["structured_outputs"]
    assert spec["kind"] == kind and spec["field"] == field
    assert SamplingParams(**model.model_validate({**base, **body}).to_sampling_kwargs()).structured_outputs == spec


@pytest.mark.parametrize("body, field, fragment", [
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex", "invalid regex"),
    ({"guided_json": {"type": "strin"}}, "guided_json", "invalid json schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
     "response_format.json_schema", "invalid json schema"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", "invalid grammar"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "only one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
])
def test_an_unusable_grammar_is_a_400_naming_its_field(body, field, fragment):
    message, _ = refusal(CompletionRequest, {"prompt": "x", **body})
    assert field in message and fragment in message, message
