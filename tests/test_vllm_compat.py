"""Where vLLM's OpenAI server behaves in a particular way, a real `vtool serve` (the tiny chat
model, on 127.0.0.1) does the same: unknown fields ignored and logged, /v1/completions'
default max_tokens of 16, non-positive max_tokens refused (echo's prompt-scoring idiom
excepted), logprobs=0, chat echo with continue_final_message, return_token_ids. Driven with
the unchanged `openai` client and with httpx where the raw JSON matters."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from live_server import vtool_serve
from vtool.runtime.serving.protocol import ChatCompletionRequest, CompletionRequest

KEY = "test-key"
MODEL = "tiny-chat"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    folder = tiny_model_dir
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ["--model", str(folder), "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL,
            "--api-key", KEY, "--max-num-seqs", "16", "--max-num-batched-tokens", "128"]
    with vtool_serve(args, log) as url:
        yield url, log


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server[0]}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def stream_events(server, path: str, body: dict) -> list[dict]:
    r = post(server, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    data = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def tokenize(server, **body) -> list[int]:
    return post(server, "/tokenize", {"model": MODEL, **body}).json()["tokens"]


GREEDY = {"model": MODEL, "temperature": 0}
STORY = [{"role": "user", "content": "Tell me a story"}]


# ============================================================================ unknown fields

field_names = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True).filter(
    lambda n: all(n not in m.model_fields and n not in m._UNSUPPORTED for m in (CompletionRequest,
                                                                                ChatCompletionRequest)))
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=4)
                           | st.floats(allow_nan=False, allow_infinity=False),
                           lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner,
                                                                                        max_size=2), max_leaves=5)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(field_names, json_values, min_size=1, max_size=3), st.booleans())
def test_unknown_fields_are_ignored_and_logged(server, extra, chat):
    """vLLM accepts a field it does not know and logs its name; the field changes nothing."""
    path, body = (("/v1/chat/completions", {**GREEDY, "messages": STORY, "max_tokens": 3}) if chat
                  else ("/v1/completions", {**GREEDY, "prompt": "Once upon a time", "max_tokens": 3}))
    with_extra = post(server, path, {**body, **extra})
    assert with_extra.status_code == 200, with_extra.text
    plain = post(server, path, body).json()
    text = (lambda r: r["choices"][0]["message"]["content"]) if chat else (lambda r: r["choices"][0]["text"])
    assert text(with_extra.json()) == text(plain)
    deadline = time.monotonic() + 10
    while True:
        lines = [line for line in server[1].read_text().splitlines() if "Request fields ignored" in line]
        if lines and all(name in lines[-1] for name in extra):
            break
        assert time.monotonic() < deadline, lines[-3:]
        time.sleep(0.1)


def test_unknown_fields_through_the_openai_client(client):
    r = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=2, temperature=0,
                                       extra_body={"frobnicate": 1, "chat_template_kwargz": {}})
    assert r.choices[0].message.content is not None
    # a known field vtool does not implement is still refused by name
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"bad_words": ["x"]})
    assert "bad_words" in info.value.message


# ============================================================================ max_tokens


def test_completions_default_to_16_tokens_and_chat_to_the_context(server, client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=MODEL, messages=STORY, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_MODEL_LEN - r.usage.prompt_tokens
    # null is unset on completions too
    r = post(server, "/v1/completions", {**GREEDY, "prompt": [1, 2, 3], "max_tokens": None, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 3


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": STORY, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": STORY, "max_tokens": -5}, "max_tokens"),
    ("/v1/chat/completions", {"messages": STORY, "max_completion_tokens": 0, "max_tokens": 5},
     "max_completion_tokens"),
])
def test_nonpositive_max_tokens_is_a_400(server, client, path, body, param):
    r = post(server, path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "must be at least 1" in error["message"] and error["code"] == 400
    assert client.completions.create(model=MODEL, prompt="still here?", max_tokens=1).choices[0].text is not None


def test_echo_with_zero_max_tokens_returns_the_prompt_scored(server):
    prompt = "The capital of France is"
    r = post(server, "/v1/completions", {**GREEDY, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == prompt
    ids = tokenize(server, prompt=prompt)
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert all(v <= 0 for v in choice["logprobs"]["token_logprobs"][1:])


# ============================================================================ logprobs


def test_logprobs_zero_returns_the_chosen_token(server):
    r = post(server, "/v1/completions", {**GREEDY, "prompt": "Hi", "max_tokens": 5, "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 5
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]
    events = stream_events(server, "/v1/completions", {**GREEDY, "prompt": "Hi", "max_tokens": 5, "logprobs": 0})
    streamed = [t for e in events for t in e["choices"][0]["logprobs"]["top_logprobs"]]
    assert streamed == lp["top_logprobs"]


def test_sampled_token_leads_top_logprobs(server):
    """vLLM's dict of a position holds the sampled token first: completions keep it among the
    logprobs + 1 they return, chat puts it first in top_logprobs."""
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 8, "temperature": 2.0, "seed": 7, "logprobs": 2}
    lp = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert next(iter(top)) == token and top[token] == chosen and len(top) in (2, 3)
    body = {"model": MODEL, "messages": STORY, "max_tokens": 8, "temperature": 2.0, "seed": 7, "logprobs": True,
            "top_logprobs": 2}
    content = post(server, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    for entry in content:
        assert entry["top_logprobs"][0]["token"] == entry["token"] and len(entry["top_logprobs"]) == 2


# ============================================================================ chat echo


def test_chat_echo_with_continue_final_message(server):
    start = "Once upon a time, a"
    messages = [*STORY, {"role": "assistant", "content": start}]
    body = {**GREEDY, "messages": messages, "max_tokens": 6, "continue_final_message": True}
    plain = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed["role"] == "assistant" and echoed["content"] == start + plain["content"]
    events = stream_events(server, "/v1/chat/completions", {**body, "echo": True})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1]["choices"][0]["delta"]["content"] == start
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == start + plain["content"]


def test_chat_echo_needs_the_answers_role(server):
    # after a generation prompt the answer is the assistant's: a user message is not echoed
    body = {**GREEDY, "messages": STORY, "max_tokens": 3}
    plain = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed == plain
    # without one, the answer continues the last message, whatever its role, and takes that role
    body = {**body, "add_generation_prompt": False, "echo": True}
    message = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith(STORY[0]["content"])


# ============================================================================ return_token_ids


def test_completion_return_token_ids(server):
    prompt = "Once upon a time"
    body = {**GREEDY, "prompt": prompt, "max_tokens": 6, "return_token_ids": True}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    assert choice["prompt_token_ids"] == tokenize(server, prompt=prompt)
    assert len(choice["token_ids"]) == 6
    assert post(server, "/detokenize", {"model": MODEL, "tokens": choice["token_ids"]}).json()["prompt"] == \
        choice["text"]
    events = stream_events(server, "/v1/completions", body)
    chunks = [e["choices"][0] for e in events]
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    plain = post(server, "/v1/completions", {**body, "return_token_ids": False}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None


def test_chat_return_token_ids(server, client):
    body = {**GREEDY, "messages": STORY, "max_tokens": 5, "return_token_ids": True}
    r = post(server, "/v1/chat/completions", body).json()
    assert r["prompt_token_ids"] == tokenize(server, messages=STORY)
    assert len(r["choices"][0]["token_ids"]) == r["usage"]["completion_tokens"]
    events = stream_events(server, "/v1/chat/completions", body)
    assert events[0]["prompt_token_ids"] == r["prompt_token_ids"]
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == r["choices"][0]["token_ids"]
    # the openai client keeps them (extra fields of its models)
    via_client = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=5, temperature=0,
                                                extra_body={"return_token_ids": True})
    assert via_client.prompt_token_ids == r["prompt_token_ids"]
    assert via_client.choices[0].token_ids == r["choices"][0]["token_ids"]


# ============================================================================ truncate_prompt_tokens, token ids in logprobs


def test_truncate_prompt_tokens_generates_from_the_prompts_end(server, client):
    """The last k tokens of a prompt give the same greedy answer as sending those k alone;
    usage counts k; -1 lets a prompt longer than the context run from its end."""
    ids = tokenize(server, prompt="Once upon a time there was a little robot who loved to paint")
    keep = 5
    cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": keep})
    alone = client.completions.create(model=MODEL, prompt=ids[-keep:], max_tokens=6, temperature=0)
    assert cut.usage.prompt_tokens == keep and cut.choices[0].text == alone.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=2, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    long = (ids * 40)[: MAX_MODEL_LEN + 20]
    with pytest.raises(openai.BadRequestError):  # past the context, as sent
        client.completions.create(model=MODEL, prompt=long, max_tokens=1)
    ran = client.completions.create(model=MODEL, prompt=long, max_tokens=1,
                                    extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN - 8})
    assert ran.usage.prompt_tokens == MAX_MODEL_LEN - 8
    with pytest.raises(openai.BadRequestError, match="Please, select a smaller truncation size"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN + 1})


def test_return_tokens_as_token_ids(server):
    body = {**GREEDY, "prompt": "Once upon a time", "max_tokens": 4, "logprobs": 2}
    named = post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    plain = post(server, "/v1/completions", body).json()["choices"][0]
    assert named["text"] == plain["text"] and named["token_ids"] is None
    ids = post(server, "/v1/completions", {**body, "return_token_ids": True}).json()["choices"][0]["token_ids"]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(all(k.startswith("token_id:") for k in top) for top in named["logprobs"]["top_logprobs"])
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    chat = post(server, "/v1/chat/completions", {**GREEDY, "messages": STORY, "max_tokens": 3, "logprobs": True,
                                                 "top_logprobs": 1, "return_tokens_as_token_ids": True}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert all(c["token"].startswith("token_id:") and bytes(c["bytes"]).decode() == c["token"] for c in content)


# ============================================================================ /metrics


def test_metrics_carry_vllms_request_level_series(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server[0]}/metrics").text)}

    def total(name: str, suffix: str) -> float:
        return sum(s.value for s in families[name].samples if s.name == name + suffix)

    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:request_max_num_generation_tokens",
                 "vllm:iteration_tokens_total", "vllm:time_to_first_token_seconds"):
        assert total(name, "_count") >= 1, name
    assert total("vllm:request_generation_tokens", "_sum") >= 4
    assert total("vllm:request_success", "_total") >= 1
    info = families["vllm:cache_config_info"].samples
    assert len(info) == 1 and info[0].labels["block_size"] == "16" and info[0].labels["engine"] == "0"
    assert int(info[0].labels["num_gpu_blocks"]) > 0
    assert {s.labels["reason"] for s in families["vllm:num_requests_waiting_by_reason"].samples} == {
        "capacity", "deferred"}
    for family in families.values():
        if family.name != "vllm:cache_config_info" and family.name.startswith("vllm:"):
            assert all(s.labels.get("model_name") == MODEL and s.labels.get("engine") == "0"
                       for s in family.samples), family.name


def test_parallel_samples_are_one_request_to_the_n_and_longest_child_series(server):
    """n=3 is one request to vLLM's request_params_n and request_max_num_generation_tokens (its
    ParentRequest observes them once, with the longest child), three to the per-request series."""
    from prometheus_client.parser import text_string_to_metric_families

    def totals() -> dict[str, float]:
        families = text_string_to_metric_families(httpx.get(f"{server[0]}/metrics").text)
        return {s.name: s.value for f in families for s in f.samples
                if s.name.endswith(("_count", "_sum")) and f.name in (
                    "vllm:request_params_n", "vllm:request_max_num_generation_tokens", "vllm:request_generation_tokens")}

    before = totals()
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "n": 3, "max_tokens": 6,
                                                 "temperature": 1.0, "seed": 5, "return_token_ids": True})
    assert response.status_code == 200, response.text
    lengths = [len(choice["token_ids"]) for choice in response.json()["choices"]]
    after = totals()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("vllm:request_params_n_count") == 1 and grew("vllm:request_params_n_sum") == 3
    assert grew("vllm:request_max_num_generation_tokens_count") == 1
    assert grew("vllm:request_max_num_generation_tokens_sum") == max(lengths)
    assert grew("vllm:request_generation_tokens_count") == 3
    assert grew("vllm:request_generation_tokens_sum") == sum(lengths)
