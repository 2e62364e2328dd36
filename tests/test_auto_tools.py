"""tool_choice "auto" through `vtool serve --enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3` and the openai client (issue 14), and the chat answer's shaping
(serving/chat_output.py: reasoning split, then content and tool calls), whole and streamed.

The tiny chat model has random weights, so a regex (structured_outputs) makes it write what a
tool-calling model would. The assistant turn is opened with an empty think section (as Qwen3's
template does with thinking off), so the prompt closes the reasoning and the grammar applies from
the first token: the same request also checks that a grammar waits for the reasoning section
only when one is open (vLLM's default).
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_engine_core import Server
from test_tool_calls import MODEL, SCHEMAS, TOOLS, USER, WEATHER
from vtool.runtime.serving.chat_output import ChoiceShaper
from vtool.runtime.serving.protocol import ChatCompletionRequest
from vtool.runtime.serving.reasoning import reasoning_parser
from vtool.runtime.serving.tool_parsers import tool_parser

CLOSED = [*USER, {"role": "assistant", "content": "<think>\n\n</think>\n\n"}]  # thinking off
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
# "Paris" or "Rome", 1-5 days: the call a tool-calling model writes in Hermes' format
CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-5]\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = Server(tiny_model_dir, tmp_path_factory.mktemp("auto-tools") / "server.log", "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_auto_returns_the_call_the_model_wrote(client):
    for regex, content in ((CALL, None), ("Let me check[.]\n" + CALL, "Let me check.\n")):  # as vLLM's hermes: the text before the call
        done = client.chat.completions.create(model=MODEL, messages=CLOSED, tools=TOOLS, max_tokens=60,
                                              extra_body={**CONTINUE, "structured_outputs": {"regex": regex}})
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == content, choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_auto_streams_id_and_name_first_then_arguments(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=CLOSED, tools=TOOLS, max_tokens=60, stream=True,
        extra_body={**CONTINUE, "structured_outputs": {"regex": "Checking[.]\n" + CALL}})
    choices = [c.choices[0] for c in stream if c.choices]
    calls = [tc for c in choices for tc in (c.delta.tool_calls or [])]
    assert "".join(c.delta.content or "" for c in choices) == "Checking.\n"
    assert calls[0].index == 0 and calls[0].id and calls[0].function.name == "get_weather"
    assert all(tc.index == 0 and tc.id is None and tc.function.name is None for tc in calls[1:])
    jsonschema.validate(json.loads("".join(tc.function.arguments or "" for tc in calls)), WEATHER)
    assert choices[-1].finish_reason == "tool_calls"


def test_auto_answers_in_text_when_the_model_calls_nothing(client):
    done = client.chat.completions.create(model=MODEL, messages=CLOSED, tools=TOOLS, max_tokens=20,
                                          extra_body={**CONTINUE, "structured_outputs": {"regex": "[a-z ]{5,20}"}})
    choice = done.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
    assert choice.message.content and choice.message.reasoning is None


def test_a_grammar_waits_while_the_reasoning_section_is_open(client):
    # the prompt opens the section and the model (random) never closes it: the regex must not
    # constrain what it writes (qwen3's parser calls an output without <think> the answer)
    done = client.chat.completions.create(model=MODEL, messages=[*USER, {"role": "assistant", "content": "<think>"}],
                                          max_tokens=12, temperature=1.0, seed=3,
                                          extra_body={**CONTINUE, "structured_outputs": {"regex": "x{100}"}})
    text = done.choices[0].message.content or ""
    assert done.choices[0].finish_reason == "length" and text and set(text) != {"x"}, done.choices[0]


# --- the shaping alone, whole against streamed -------------------------------------------------

def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=MODEL, messages=USER, tools=TOOLS, **kw)


WRITTEN = [
    ("<think>\nweather first\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
     "{\"city\": \"Rome\", \"days\": 2}}\n</tool_call>", "\nweather first\n", None, ["get_weather"]),
    ("<think>plan</think>Sure.\n<tool_call>\n{\"name\": \"book_table\", \"arguments\": {\"people\": 2, "
     "\"vegan\": true}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
     "{\"city\": \"Paris\", \"days\": 1}}\n</tool_call>", "plan", "Sure.\n", ["book_table", "get_weather"]),
    ("No tools needed: 4.", None, "No tools needed: 4.", []),
    ("<tool_call>\n{\"name\": \"get_weather\", \"argu", None, "<tool_call>\n{\"name\": \"get_weather\", \"argu", []),
]


@pytest.mark.parametrize("text, reasoning, content, names", WRITTEN)
def test_the_whole_answer_is_split_into_reasoning_content_and_calls(text, reasoning, content, names):
    shaper = ChoiceShaper(_request(), reasoning_parser("qwen3"), tool_parser("hermes"))
    fields, finish = shaper.message(text, "stop")
    assert (fields["reasoning"], fields["content"]) == (reasoning, content)
    assert [c["function"]["name"] for c in fields.get("tool_calls", [])] == names
    for call in fields.get("tool_calls", []):
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert finish == ("tool_calls" if names else "stop")


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(WRITTEN[:3]), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_streamed_pieces_add_up_to_the_whole_answer(case, cuts):
    text = case[0]
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    shaper = ChoiceShaper(_request(), reasoning_parser("qwen3"), tool_parser("hermes"))
    whole, finish = ChoiceShaper(_request(), reasoning_parser("qwen3"), tool_parser("hermes")).message(text, "stop")
    reasoning, content, calls = "", "", {}
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        delta = shaper.push(text[a:b], final=k == len(bounds) - 2)
        if delta is None:
            continue
        reasoning += delta.reasoning or ""
        content += delta.content or ""
        for tc in delta.tool_calls:
            entry = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
            entry["name"] = tc.get("function", {}).get("name") or entry["name"]
            entry["arguments"] += tc.get("function", {}).get("arguments") or ""
    assert (reasoning or None, content or None) == (whole["reasoning"], whole["content"])
    assert [calls[i]["name"] for i in sorted(calls)] == [c["function"]["name"] for c in whole.get("tool_calls", [])]
    assert [json.loads(calls[i]["arguments"]) for i in sorted(calls)] == \
        [json.loads(c["function"]["arguments"]) for c in whole.get("tool_calls", [])]
    assert shaper.stream_finish("stop") == finish


def test_auto_without_a_parser_is_refused_and_flags_are_checked():
    from vtool import VtoolError
    from vtool.runtime.serving.serve_cmd import ServeOptions

    with pytest.raises(VtoolError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ServeOptions(enable_auto_tool_choice=True)
    with pytest.raises(VtoolError, match="hermes"):
        ServeOptions(enable_auto_tool_choice=True, tool_call_parser="nope")
    with pytest.raises(VtoolError, match="backend 'xgrammar' is not available"):
        ServeOptions(structured_outputs_config='{"backend": "xgrammar"}')
    with pytest.raises(VtoolError, match="enable_in_reasonin"):
        ServeOptions(structured_outputs_config='{"enable_in_reasonin": true}')
