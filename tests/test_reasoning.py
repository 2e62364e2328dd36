"""Reasoning parsers (--reasoning-parser): the <think> section split into `reasoning`, whole and
streamed (hypothesis: any cut of the text streams to the same split), and through a live
`vtool serve` with the openai client, where a grammar makes the tiny model think on cue."""
from __future__ import annotations

import re

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_engine_core import Server  # the same `vtool serve` process fixture
from vtool.runtime.serving.reasoning import PARSERS, reasoning_parser

MODEL = "tiny-chat"

pieces = st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think>", "\n", "\n\n", "a", "b c", "é", "<x>"])


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(sorted(PARSERS)), parts=st.lists(pieces, max_size=12), data=st.data())
def test_any_cut_of_the_text_streams_to_the_same_split(name, parts, data):
    parser = reasoning_parser(name)
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    stream, reasoning, content = parser.stream(), "", ""
    for k, chunk in enumerate(chunks):
        r, c = stream.push(chunk, final=k == len(chunks) - 1)
        reasoning, content = reasoning + r, content + c
    assert (reasoning or None, content or None) == parser.split(text)


@pytest.mark.parametrize("name, text, want", [
    ("deepseek_r1", "<think>plan</think>\n\nanswer", ("plan", "answer")),
    ("deepseek_r1", "plan</think>answer", ("plan", "answer")),  # the template opened it in the prompt
    ("deepseek_r1", "still thinking", ("still thinking", None)),
    ("qwen3", "<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "answer")),
    ("qwen3", "no thinking here", (None, "no thinking here")),  # enable_thinking false
    ("qwen3", "<think>cut short", ("cut short", None)),
])
def test_splits(name, text, want):
    assert reasoning_parser(name).split(text) == want


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # enable_in_reasoning: the grammar below covers the thinking too (by default, as in vLLM, a grammar
    # starts after the reasoning section; test_grammar_starts_after_a_closed_section checks that)
    s = Server(tiny_model_dir, tmp_path_factory.mktemp("reasoning") / "server.log", "--reasoning-parser",
               "deepseek_r1", "--default-chat-template-kwargs", '{"enable_thinking": true}',
               "--structured-outputs-config", '{"enable_in_reasoning": true}')
    yield s
    s.stop()


THINK = {"structured_outputs": {"regex": "<think>[a-z]{3}</think>[a-z]{4}"}}  # the model thinks on cue


def test_reasoning_is_split_from_the_answer(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                          extra_body=THINK)
    message = done.choices[0].message
    assert re.fullmatch("[a-z]{3}", message.reasoning) and re.fullmatch("[a-z]{4}", message.content), message
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                            stream=True, extra_body=THINK)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert re.fullmatch("[a-z]{3}", reasoning) and re.fullmatch("[a-z]{4}", content)
    last_reasoning = max(i for i, d in enumerate(deltas) if getattr(d, "reasoning", None))
    first_content = min(i for i, d in enumerate(deltas) if d.content)
    # thinking first, then the answer; one delta may close the one and open the other (a token
    # across </think>, or deltas coalesced while the client was behind)
    assert last_reasoning <= first_content
    hidden = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                            extra_body={**THINK, "include_reasoning": False})
    assert getattr(hidden.choices[0].message, "reasoning", None) is None


@pytest.mark.parametrize("default, own, empty_think", [
    ({}, None, False),                                             # Qwen3 thinks by default
    ({"enable_thinking": False}, None, True),                      # the server's default
    ({"enable_thinking": False}, {"enable_thinking": True}, False),  # the request's own wins
    ({}, {"enable_thinking": False}, True),
])
def test_default_chat_template_kwargs_reach_qwen3s_real_template(default, own, empty_think):
    from assets import qwen3_tokenizer_dir
    from vtool.runtime.serving.completions import ServingState, render_chat_prompt
    from vtool.runtime.serving.protocol import ChatCompletionRequest
    from vtool.runtime.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(qwen3_tokenizer_dir())
    state = ServingState(engine=None, tokenizer=tokenizer, served_names=["m"], max_model_len=4096,
                         metrics_enabled=False, sampling_defaults={}, default_chat_template_kwargs=default)
    body = {"messages": [{"role": "user", "content": "hi"}], **({"chat_template_kwargs": own} if own else {})}
    text = tokenizer.decode(render_chat_prompt(state, ChatCompletionRequest.model_validate(body)),
                            skip_special_tokens=False)
    # Qwen3's template closes an empty think section in the prompt when thinking is off
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == empty_think, text
