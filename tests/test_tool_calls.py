"""Tool calling through `vtool serve` and the openai client (issue 14, part): tools rendered by
the chat template, tool_choice "none", a named function and "required" forced by a grammar built
from the tools' schemas (arguments validated with jsonschema), streamed as OpenAI streams them;
"auto" refused as vLLM refuses it without a tool-call parser; bad choices are 400s."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from test_engine_core import Server  # the same `vtool serve` process fixture

MODEL = "tiny-chat"
USER = [{"role": "user", "content": "Weather in Paris, and book a table?"}]
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
           "minimum": 1, "maximum": 5}}, "required": ["city", "days"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {"people": {"type": "integer", "minimum": 1, "maximum": 9},
        "vegan": {"type": "boolean"}}, "required": ["people", "vegan"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "book_table", "parameters": BOOK}}]
SCHEMAS = {"get_weather": WEATHER, "book_table": BOOK}


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    s = Server(tiny_model_dir, tmp_path_factory.mktemp("tools") / "server.log")
    yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=120)
    s.stop()


def test_a_named_function_is_called_with_valid_arguments(client):
    for seed in range(3):
        done = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=80, seed=seed,
                                              temperature=1.0,
                                              tool_choice={"type": "function", "function": {"name": "book_table"}})
        message = done.choices[0].message
        assert message.content is None and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.type == "function" and call.function.name == "book_table" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), BOOK)
        assert done.choices[0].finish_reason == "stop"


def test_required_calls_one_or_more_tools(client):
    for seed in range(3):
        # one call (parallel_tool_calls false bounds the list: the random model would go on adding calls)
        done = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                              max_tokens=200, seed=seed, temperature=1.0, parallel_tool_calls=False)
        calls = done.choices[0].message.tool_calls
        assert len(calls) == 1 and done.choices[0].finish_reason == "tool_calls", done.choices[0]
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_call_streams_id_and_name_first_then_arguments(client):
    stream = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=80, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather"
    assert all(tc.id is None and tc.function.name is None for tc in calls[1:])
    jsonschema.validate(json.loads("".join(tc.function.arguments or "" for tc in calls)), WEATHER)
    assert deltas[-1].finish_reason == "stop"


def test_none_answers_in_text_and_the_history_may_hold_calls(client):
    # SmolLM2's template was not written for tools: null content on a call turn is a 400 naming it
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER + [{"role": "assistant", "content": None,
                                                                      "tool_calls": [call]}], max_tokens=2)
    assert "chat template cannot render" in info.value.message
    history = USER + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    done = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert done.choices[0].message.content is not None and not done.choices[0].message.tool_calls


@pytest.mark.parametrize("kwargs, fragment", [
    ({"tools": TOOLS}, "--tool-call-parser"),  # "auto" is the default with tools, as in vLLM
    ({"tools": TOOLS, "tool_choice": "auto"}, "--tool-call-parser"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "no tool named 'nope'"),
    ({"tool_choice": "required"}, "'required' needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
      "tool_choice": "required"}, "invalid json schema"),
])
def test_bad_tool_requests_are_400s(client, kwargs, fragment):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, **kwargs)
    assert fragment in info.value.message
