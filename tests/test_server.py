"""`vtool serve` as a real process on 127.0.0.1, driven by the unchanged `openai` client
(and raw HTTP where the client would hide the status line)."""
from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from live_server import vtool_serve

KEY = "test-key"
MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    folder = tiny_model_dir
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ["--model", str(folder), "--max-model-len", "256", "--served-model-name", MODEL, "--api-key", KEY,
            "--max-num-seqs", "16", "--max-num-batched-tokens", "128", "--enable-log-outputs", "--trust-remote-code"]
    with vtool_serve(args, log) as url:
        yield url, log


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)


def post(server, path: str, body, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (str, bytes)) else None
    return httpx.post(f"{server[0]}{path}", json=None if content is not None else body, content=content,
                      headers={**headers, "Content-Type": "application/json"}, timeout=60)


def metric(server, name: str) -> float:
    text = httpx.get(f"{server[0]}/metrics").text
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_completions_blocking_and_streaming_agree(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 12
    assert full.choices[0].finish_reason == "length"


def test_chat_blocking_and_streaming_agree(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"


def test_usage_prompt_tokens_equals_tokenize_count(server, client):
    prompt = "The capital of France is"
    count = post(server, "/tokenize", {"model": MODEL, "prompt": prompt}).json()["count"]
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage.prompt_tokens == count
    messages = [{"role": "user", "content": prompt}]
    count = post(server, "/tokenize", {"model": MODEL, "messages": messages}).json()["count"]
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens == count


def test_greedy_is_deterministic_and_batch_independent(server, client):
    prompts = [f"Request number {i} says" for i in range(8)]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text
             for p in prompts]

    async def together():
        aclient = openai.AsyncOpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)
        rs = await asyncio.gather(*[aclient.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0)
                                    for p in prompts])
        return [r.choices[0].text for r in rs]

    assert asyncio.run(together()) == alone


def test_seed_reproduces_and_n2_gives_two_choices(client):
    kw = dict(model=MODEL, prompt="Pick a word:", max_tokens=8, temperature=1.0, seed=42, n=2)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len(a.choices) == 2 and a.choices[0].text != a.choices[1].text
    assert a.usage.completion_tokens == 16


def test_stop_strings(client):
    text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=0).choices[0].text
    stop = text[6:9]
    cut = client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


def test_logprobs_shapes(client):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) == 3 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(max(t.values()) - v) < 1e-6 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)


def test_sixteen_concurrent_streams_finish(server):
    async def one(aclient, i):
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Story {i}"}], max_tokens=20, stream=True,
            temperature=0.8, seed=i)
        finish = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return finish

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)
        return await asyncio.gather(*[one(aclient, i) for i in range(16)])

    assert all(f in ("stop", "length") for f in asyncio.run(main()))


def test_dropped_client_frees_its_blocks(server):
    idle = metric(server, "vllm:kv_cache_usage_perc")
    body = {"model": MODEL, "prompt": "A very long story begins " * 5, "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server[0]}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                assert metric(server, "vllm:kv_cache_usage_perc") > idle
                break  # leave mid-stream
    deadline = time.monotonic() + 10
    while metric(server, "vllm:kv_cache_usage_perc") != idle:
        assert time.monotonic() < deadline, "blocks of a dropped stream were not freed"
        time.sleep(0.1)
    assert metric(server, "vllm:num_requests_running") == 0


@pytest.mark.parametrize("body, field", [
    ('{"model": "tiny-chat", "prompt": "x",', "JSON"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10_000}, "maximum context length"),
    ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": [99_999_999]}, "vocabulary"),
    ({"model": MODEL, "prompt": "word " * 300}, "max_model_len=256"),
    ({"model": MODEL}, "prompt"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, client, body, field):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field.lower() in error["message"].lower() and error["code"] == 400
    assert client.completions.create(model=MODEL, prompt="still alive?", max_tokens=2).choices[0].text is not None


def test_prompt_past_context_names_both_lengths(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": list(range(100, 400))})
    assert r.status_code == 400
    assert "300 tokens" in r.json()["error"]["message"] and "256" in r.json()["error"]["message"]


def test_unknown_model_is_404_and_missing_key_is_401(server):
    r = post(server, "/v1/completions", {"model": "gpt-17", "prompt": "x"})
    assert r.status_code == 404 and "gpt-17" in r.json()["error"]["message"]
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": "x"}, key=None).status_code == 401
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": "x"}, key="wrong").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server[0]}/v1", api_key="wrong", max_retries=0).models.list()


def test_small_endpoints(server, client):
    url = server[0]
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ping").status_code == 200 and httpx.post(f"{url}/ping").status_code == 200
    assert httpx.get(f"{url}/version").json()["version"]
    info = httpx.get(f"{url}/server_info").json()
    assert info["served_model_names"] == [MODEL] and info["engine"]["max_num_seqs"] == 16
    assert [m.id for m in client.models.list().data] == [MODEL]
    ids = post(server, "/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True}).json()
    assert post(server, "/detokenize", {"model": MODEL, "tokens": ids["tokens"]}).json()["prompt"] == "Hello world"
    assert post(server, "/detokenize", {"model": MODEL, "tokens": [10**9]}).status_code == 400
    assert post(server, "/reset_prefix_cache", {}).status_code == 200
    text = httpx.get(f"{url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_success_total"):
        assert name in text, name


def test_unset_max_tokens_runs_to_the_context_and_logs(server, client):
    prompt_tokens = 3
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=None, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 256 - prompt_tokens
    assert r.choices[0].finish_reason == "length"
    log = server[1].read_text()
    assert "accepted '--trust-remote-code'" in log
    assert "Received request" in log and "Finished request" in log
