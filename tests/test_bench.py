"""`vtool bench`: vLLM's serving metrics on hand-computed records, their invariants, and the
streaming client end to end against a real SSE server on 127.0.0.1."""

import asyncio
import dataclasses
import contextlib
import io
import json
import math
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from vtool import VtoolError
import httpx

from vtool.runtime.bench.client import (NO_TTFT_ERROR, ClientPool, RequestInput, SSEDecoder, StreamError, StreamParser, api_base,
                                        endpoint_url, request_chat_completions, request_completions, request_delays,
                                        run_requests)
from vtool.runtime.bench import command
from vtool.runtime.bench.command import (BenchOptions, BenchPrompt, bench_main, fresh_seed, load_dataset_prompts,
                                         parse_concurrency, parse_goodput, plan_prompts, probe_server_tokenizer,
                                         run_bench, synthetic_prompts, word_prompts)
from vtool.runtime.bench.metrics import (RequestRecord, calculate_metrics, count_output_tokens, latency_stats,
                                         peak_rates)

# ----------------------------------------------------------------------------- metrics: by hand


def _hand_records() -> list[RequestRecord]:
    return [
        RequestRecord(True, 10, 4, 0.1, [0.02, 0.03, 0.05], 0.2, 0.0),
        RequestRecord(True, 20, 1, 0.3, [], 0.3, 0.5),
        RequestRecord(False, 99, 0, 0.0, [], 0.0, 0.1, error="HTTP 500"),
        RequestRecord(True, 5, 3, 0.2, [0.1, 0.1], 0.4, 1.2),
    ]


def test_metrics_hand_computed():
    m = calculate_metrics(_hand_records(), 2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (35, 8)
    assert m.output_lens == (4, 1, 0, 3)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(21.5)
    # TTFT over the 3 successful requests
    assert m.ttft.mean_ms == pytest.approx(200.0)
    assert m.ttft.median_ms == pytest.approx(200.0)
    assert m.ttft.std_ms == pytest.approx(1000 * math.sqrt(0.02 / 3))
    # TPOT: A (0.2-0.1)/3, D (0.4-0.2)/2; B has 1 token and is left out
    assert m.tpot.mean_ms == pytest.approx(1000 * (0.1 / 3 + 0.1) / 2)
    assert m.tpot.median_ms == pytest.approx(1000 * (0.1 / 3 + 0.1) / 2)
    # ITL pooled over chunks: [.02 .03 .05 .1 .1]
    assert m.itl.mean_ms == pytest.approx(60.0)
    assert m.itl.median_ms == pytest.approx(50.0)
    assert m.itl.percentile(90) == pytest.approx(100.0)
    assert m.itl.percentile(50) == pytest.approx(50.0)
    assert m.e2el.mean_ms == pytest.approx(300.0)
    # bins from t0=0: chunks at .1 .12 .15 .2 .8 | 1.4 1.5 1.6 ; requests A,B in bin 0, D in bin 1
    assert m.max_output_tokens_per_s == 5.0
    assert m.max_concurrent_requests == 2
    d = m.to_dict()
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
                "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms"):
        assert key in d, key


def test_goodput_and_fallback_output_len():
    m = calculate_metrics(_hand_records(), 2.0, goodput_slo_ms={"ttft": 250})
    assert m.request_goodput == pytest.approx(1.0)         # A, D
    m = calculate_metrics(_hand_records(), 2.0, goodput_slo_ms={"tpot": 50})
    assert m.request_goodput == pytest.approx(1.0)         # A (33 ms), B (TPOT 0)
    assert calculate_metrics(_hand_records(), 2.0).request_goodput is None
    # no usage: re-tokenize the text, or (vLLM counts 1) one token per content chunk without a tokenizer
    rec = RequestRecord(True, 3, 0, 0.1, [0.1], 0.2, 0.0, generated_text="a b c")
    m = calculate_metrics([rec], 1.0)
    assert m.total_output == 2 and m.output_count_methods == {"chunks": 1}
    m = calculate_metrics([rec], 1.0, count_tokens=lambda s: len(s.split()), count_method="server /tokenize")
    assert m.total_output == 3 and m.to_dict()["output_tokens_counted_by"] == {"server /tokenize": 1}
    assert calculate_metrics(_hand_records(), 2.0).output_count_methods == {"usage": 3}


def test_empty_and_all_failed():
    m = calculate_metrics([RequestRecord(False, 5, error="x")], 1.0)
    assert (m.completed, m.failed, m.total_output) == (0, 1, 0)
    assert m.ttft.mean_ms == 0.0 and m.itl.percentile(99) == 0.0
    assert (m.max_output_tokens_per_s, m.max_concurrent_requests) == (0.0, 0)
    with pytest.raises(ValueError):
        calculate_metrics([], 0.0)


# ----------------------------------------------------------------------------- metrics: invariants

_gap = st.floats(0.0005, 0.5, allow_nan=False)
_record = st.builds(
    lambda ok, plen, ntok, ttft, itl, tail, start: RequestRecord(
        ok, plen, ntok, ttft, itl, ttft + sum(itl) + tail, start, error="" if ok else "failed"),
    st.booleans(), st.integers(0, 4000), st.integers(0, 300), st.floats(0.001, 3.0), st.lists(_gap, max_size=12),
    st.floats(0.0, 0.2), st.floats(0.0, 5.0))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_record, min_size=1, max_size=25), st.floats(0.1, 100.0))
def test_metric_invariants(records, duration):
    m = calculate_metrics(records, duration)
    ok = [r for r in records if r.success]
    out = [r.output_tokens or 1 + len(r.itl) for r in ok]     # usage, else one per content chunk
    assert m.completed == len(ok) and m.completed + m.failed == len(records)
    assert m.request_throughput * duration == pytest.approx(len(ok))
    assert m.output_throughput * duration == pytest.approx(sum(out))
    assert m.total_token_throughput * duration == pytest.approx(sum(r.prompt_len for r in ok) + sum(out))
    # TPOT only over successful requests with more than one token
    tpots = [(r.latency - r.ttft) / (n - 1) for r, n in zip(ok, out) if n > 1]
    assert m.tpot.mean_ms == pytest.approx(1000 * float(np.mean(tpots or 0)))
    assert m.tpot.median_ms == pytest.approx(1000 * float(np.median(tpots or 0)))
    # ITL pooled over chunks, not averaged per request
    pooled = [g for r in ok for g in r.itl]
    assert m.itl.mean_ms == pytest.approx(1000 * float(np.mean(pooled or 0)))
    assert m.ttft.mean_ms == pytest.approx(1000 * float(np.mean([r.ttft for r in ok] or 0)))
    # percentiles monotone, and between min and max
    lists = ((m.ttft, [r.ttft for r in ok]), (m.tpot, tpots), (m.itl, pooled), (m.e2el, [r.latency for r in ok]))
    for stats, xs in lists:
        ps = [v for _, v in stats.percentiles_ms]
        assert all(a <= b + 1e-9 for a, b in zip(ps, ps[1:]))
        if xs:
            lo, hi = 1000 * min(xs), 1000 * max(xs)
            assert lo - 1e-6 <= stats.median_ms <= hi + 1e-6
            assert lo - 1e-6 <= stats.mean_ms <= hi + 1e-6
            assert lo - 1e-6 <= ps[0] and ps[-1] <= hi + 1e-6
    # failed requests are left out entirely: dropping them changes nothing but `failed`
    m2 = calculate_metrics(ok, duration) if ok else None
    if m2 is not None:
        for a in ("completed", "total_input", "total_output", "ttft", "tpot", "itl", "e2el",
                  "max_output_tokens_per_s", "max_concurrent_requests"):
            assert getattr(m, a) == getattr(m2, a), a
    # peaks
    assert m.max_output_tokens_per_s <= sum(1 + len(r.itl) for r in ok)
    assert (m.max_concurrent_requests >= 1) == bool(ok)
    assert m.max_concurrent_requests <= len(ok)


def test_peak_rates_bins():
    # two overlapping requests in bin 0, chunks 0.1..0.9 → 9 in bin 0
    recs = [RequestRecord(True, 1, 5, 0.1, [0.1] * 4, 0.5, 0.0), RequestRecord(True, 1, 5, 0.1, [0.1] * 4, 0.5, 0.4)]
    assert peak_rates(recs) == (10.0, 2)
    assert latency_stats([]).mean_ms == 0.0


# ----------------------------------------------------------------------------- SSE parsing, options

def _sse(*events: str) -> bytes:
    return "".join(events).encode()


def test_sse_decoder_basics():
    d = SSEDecoder()
    assert d.feed(b": ping\n\n") == []
    assert d.feed(b'data: {"a": 1}\n\ndata: [DO') == ['{"a": 1}']
    assert d.feed(b"NE]\r\n\r\n") == ["[DONE]"]
    assert d.feed(b"event: x\nid: 3\ndata: one\ndata:two\n\n") == ["one\ntwo"]
    assert d.feed(b"data: tail") == [] and d.flush() == ["tail"]
    # a UTF-8 character split across network chunks
    snow = 'data: "\u2603"\n\n'.encode()
    assert d.feed(snow[:8]) == [] and d.feed(snow[8:]) == ['"\u2603"']


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=8))
def test_sse_decoder_split_invariant(cuts):
    stream = _sse(": hello\n\n", 'data: {"choices": [{"text": "\u00e9t\u00e9"}]}\n\n',
                  "data: {\"choices\": []}\r\n\r\n",
                  ": c\ndata: {\"usage\": {}}\n\n", "data: [DONE]\n\n")
    pos = sorted({c % (len(stream) + 1) for c in cuts})
    d, got, last = SSEDecoder(), [], 0
    for p in pos + [len(stream)]:
        got += d.feed(stream[last:p])
        last = p
    got += d.flush()
    assert got == ['{"choices": [{"text": "\u00e9t\u00e9"}]}', '{"choices": []}', '{"usage": {}}', "[DONE]"]


# ----------------------------------------------------------------------------- stream parsing: usage anywhere

def _usage_obj(completion: int, prompt: int, as_float: bool, cached: int | None) -> dict:
    u = {"completion_tokens": float(completion) if as_float else completion, "prompt_tokens": prompt,
         "total_tokens": completion + prompt}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


@st.composite
def _streams(draw):
    """An OpenAI stream as some server sends it: content chunks; for chat maybe a role chunk
    first; the finish reason on the last token's chunk (vLLM, vtool) or on a chunk of its own
    with no output (llama-server); usage in a final chunk with empty or no choices (OpenAI,
    vLLM), in the finish chunk (llama-server's completions), in every chunk (continuous), or
    nowhere."""
    chat = draw(st.booleans())
    texts = draw(st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=8))
    role = chat and draw(st.booleans())
    finish = draw(st.sampled_from(["on_last", "separate", "none"]))
    where = draw(st.sampled_from(["final_empty", "final_no_choices", "finish_chunk", "continuous", "none"]))
    if where == "finish_chunk" and finish == "none":
        finish = "separate"
    as_float = draw(st.booleans())
    prompt = draw(st.integers(0, 5000))
    cached = draw(st.none() | st.integers(0, 100))
    extra = draw(st.dictionaries(st.sampled_from(["timings", "system_fingerprint", "created", "object"]),
                                 st.integers() | st.text(max_size=5), max_size=2))
    n = len(texts)

    def choice(text: str | None, reason: str | None) -> dict:
        if chat:
            delta = {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "finish_reason": reason}
        return {"index": 0, "text": "" if text is None else text, "logprobs": None, "finish_reason": reason}

    chunks: list[dict] = []
    if role:
        chunks.append({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None},
                                    "finish_reason": None}], **extra})
    for i, t in enumerate(texts):
        c = {"choices": [choice(t, "length" if finish == "on_last" and i == n - 1 else None)], **extra}
        if where == "continuous" or (where == "finish_chunk" and finish == "on_last" and i == n - 1):
            c["usage"] = _usage_obj(i + 1, prompt, as_float, cached)
        chunks.append(c)
    if finish == "separate":
        c = {"choices": [choice(None, "length")], **extra}
        if where in ("finish_chunk", "continuous"):
            c["usage"] = _usage_obj(n, prompt, as_float, cached)
        chunks.append(c)
    if where in ("final_empty", "continuous"):
        chunks.append({"choices": [], "usage": _usage_obj(n, prompt, as_float, cached)})
    elif where == "final_no_choices":
        chunks.append({"usage": _usage_obj(n, prompt, as_float, cached), **extra})
    return chat, texts, role, finish, where, prompt, cached, chunks


@settings(max_examples=300, deadline=None)
@given(_streams(), st.booleans())
def test_stream_parser_reads_usage_wherever_it_is(stream, with_counter):
    chat, texts, role, _finish, where, prompt, cached, chunks = stream
    rec = RequestRecord(prompt_len=999, client_prompt_len=999)
    parser = StreamParser(rec, 0.0, chat)
    times = []
    for i, c in enumerate(chunks):
        times.append(float(i + 1))
        parser.feed(json.dumps(c), float(i + 1))
    parser.feed("[DONE]", 100.0)
    parser.finish()
    assert rec.success and rec.error == ""
    assert rec.generated_text == "".join(texts)
    assert rec.ttft == 1.0                                  # the first chunk with choices
    # one gap per later token chunk (the role chunk counts as the first, as in vLLM); a finish
    # chunk with no output adds none
    assert len(rec.itl) == len(texts) - 1 + role
    assert all(g == 1.0 for g in rec.itl)
    with_choices = [t for t, c in zip(times, chunks) if c.get("choices")]
    assert rec.latency == (times[-1] if chat else with_choices[-1])
    count = (lambda s: len(s)) if with_counter else None   # noqa: E731 - one token per character
    n, how = count_output_tokens(rec, count)
    if where == "none":
        assert rec.usage_completion_tokens is None and rec.prompt_len == 999
        assert (n, how) == ((len("".join(texts)), "tokenizer") if with_counter else (len(texts), "chunks"))
    else:
        assert (n, how) == (len(texts), "usage")
        assert rec.output_tokens == rec.usage_completion_tokens == len(texts)
        assert rec.prompt_len == rec.usage_prompt_tokens == prompt
        assert rec.usage_cached_tokens == cached


_json_keys = st.sampled_from(["choices", "usage", "text", "delta", "content", "finish_reason", "error", "index",
                              "completion_tokens", "prompt_tokens", "prompt_tokens_details", "cached_tokens",
                              "role", "reasoning_content", "tool_calls"]) | st.text(max_size=4)
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_json_keys, inner, max_size=5),
                     max_leaves=25)


@settings(max_examples=400, deadline=None)
@given(st.booleans(), st.lists(st.one_of(_json.map(json.dumps), st.text(max_size=20)), max_size=8))
def test_stream_parser_never_crashes(chat, payloads):
    """Any payload either parses or fails the request with a StreamError; counts stay whole and
    non-negative, times ordered."""
    rec = RequestRecord(prompt_len=5, client_prompt_len=5)
    parser = StreamParser(rec, 0.0, chat)
    try:
        for i, data in enumerate(payloads):
            parser.feed(data, float(i + 1))
        parser.finish()
    except StreamError:
        return
    n, _ = count_output_tokens(rec, None)
    assert isinstance(rec.output_tokens, int) and rec.output_tokens >= 0 and n >= 0
    assert isinstance(rec.prompt_len, int) and rec.prompt_len >= 0
    assert all(g >= 0 for g in rec.itl) and rec.ttft >= 0 and rec.latency >= 0
    assert isinstance(rec.generated_text, str)


def test_stream_parser_llama_server_capture():
    """The chunks llama-server 0c1e570 sent for one 3-token completion and one chat (trimmed)."""
    completion = [
        {"choices": [{"text": ",", "index": 0, "logprobs": None, "finish_reason": None}], "object": "text_completion"},
        {"choices": [{"text": " a", "index": 0, "logprobs": None, "finish_reason": None}], "object": "text_completion"},
        {"choices": [{"text": " group", "index": 0, "logprobs": None, "finish_reason": None}]},
        {"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}], "object": "text_completion",
         "usage": {"completion_tokens": 3, "prompt_tokens": 4, "total_tokens": 7,
                   "prompt_tokens_details": {"cached_tokens": 3}},
         "timings": {"cache_n": 3, "prompt_n": 1, "predicted_n": 3}},
    ]
    chat = [
        {"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}]},
        {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "Hello"}}]},
        {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "!"}}]},
        {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}]},
        {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 31, "total_tokens": 33,
                                  "prompt_tokens_details": {"cached_tokens": 0}}, "timings": {}},
    ]
    for is_chat, chunks, text, prompt, out in ((False, completion, ", a group", 4, 3), (True, chat, "Hello!", 31, 2)):
        rec = RequestRecord(prompt_len=1)
        parser = StreamParser(rec, 0.0, is_chat)
        for i, c in enumerate(chunks):
            parser.feed(json.dumps(c), float(i + 1))
        parser.finish()
        assert (rec.success, rec.generated_text, rec.prompt_len, rec.output_tokens) == (True, text, prompt, out)
        assert len(rec.itl) == 2 and rec.ttft == 1.0
        assert rec.latency == (len(chunks) if is_chat else 4.0)
    assert calculate_metrics([rec], 1.0).output_count_methods == {"usage": 1}


def test_stream_parser_refuses_garbage():
    for bad in ("not json", "[1, 2]", '{"error": {"message": "boom"}}'):
        with pytest.raises(StreamError):
            StreamParser(RequestRecord(), 0.0, False).feed(bad, 1.0)


def test_stale_keepalive_connection_is_retried_once():
    """llama-server closes the connection after each streamed response although it says keep-alive:
    the next request on it fails before any response, and is sent again."""
    calls = []
    body = ('data: {"choices": [{"text": "hi", "finish_reason": "length"}], '
            '"usage": {"completion_tokens": 1, "prompt_tokens": 2}}\n\ndata: [DONE]\n\n')

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) % 2 == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            inp = RequestInput("x", 1, 1, "m", "http://test/v1/completions")
            return await request_completions(client, inp)

    rec = asyncio.run(go())
    assert rec.success and rec.retries == 1 and rec.output_tokens == 1 and len(calls) == 2

    def always(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    async def go_always():
        async with httpx.AsyncClient(transport=httpx.MockTransport(always)) as client:
            return await request_completions(client, RequestInput("x", 1, 1, "m", "http://test/v1/completions"))

    calls.clear()
    rec = asyncio.run(go_always())
    assert not rec.success and "RemoteProtocolError" in rec.error and len(calls) == 2


def test_server_tokenizer_probe_wants_vllms_shape():
    def client_for(answer):
        def handler(request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            return answer(body)
        return httpx.Client(transport=httpx.MockTransport(handler))

    def vllm(body):
        n = len(body["prompt"].split())
        return httpx.Response(200, json={"count": n, "tokens": list(range(n)), "max_model_len": 8})

    count, why = probe_server_tokenizer(client_for(vllm), "http://s", "m")
    assert why == "" and count("a b c") == 3
    # llama-server: reads "content", answers {"tokens": []} to vLLM's request
    llama = lambda body: httpx.Response(200, json={"tokens": [] if "content" not in body else [1, 2]})  # noqa: E731
    count, why = probe_server_tokenizer(client_for(llama), "http://s", "m")
    assert count is None and "vLLM's shape" in why
    zero = lambda body: httpx.Response(200, json={"count": 0, "tokens": []})  # noqa: E731
    assert probe_server_tokenizer(client_for(zero), "http://s", "m")[0] is None
    missing = lambda body: httpx.Response(404, json={"detail": "Not Found"})  # noqa: E731
    count, why = probe_server_tokenizer(client_for(missing), "http://s", "m")
    assert count is None and "404" in why


def test_options_parsing_and_urls():
    assert parse_concurrency("1,4, 16") == [1, 4, 16]
    assert parse_concurrency(["1,2", 8]) == [1, 2, 8]
    assert parse_concurrency("inf") == [0] and parse_concurrency(None) == [0]
    with pytest.raises(VtoolError):
        parse_concurrency("1,x")
    with pytest.raises(VtoolError):
        parse_concurrency("-2")
    assert parse_goodput(["ttft:200", "tpot:50 e2el:1000"]) == {"ttft": 200.0, "tpot": 50.0, "e2el": 1000.0}
    with pytest.raises(VtoolError):
        parse_goodput(["itl:5"])
    for u in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/completions", "h:1"):
        assert api_base(u) == "http://h:1"
    assert endpoint_url("http://h:1/v1", "chat") == "http://h:1/v1/chat/completions"
    assert request_delays(3) == [0.0, 0.0, 0.0]
    d = request_delays(50, 10.0, 1.0, np.random.default_rng(0))
    assert d == sorted(d) and d[-1] == pytest.approx(5.0)
    assert request_delays(4, 2.0, math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert BenchOptions(result_json="x.json").json_path("m") is not None
    assert BenchOptions().json_path("m") is None


# ----------------------------------------------------------------------------- datasets

class WordTokenizer:
    """Whitespace words over a fixed vocabulary; id 0 is a special BOS."""
    vocab_size = 40
    all_special_ids = [0]

    def __init__(self):
        self.words = ["<s>"] + [f"w{i}" for i in range(1, self.vocab_size)]

    def encode(self, text, add_special_tokens=True):
        ids = [self.words.index(w) for w in text.split() if w in self.words]
        return ([0] if add_special_tokens else []) + ids

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)


class MergeTokenizer:
    """Greedy longest match over a, b, ab, ba, aa: decode/encode does not round-trip."""
    vocab = ["<s>", "a", "b", "ab", "ba", "aa"]
    vocab_size = 6
    all_special_ids = [0]

    def encode(self, text, add_special_tokens=True):
        ids, i = ([0] if add_special_tokens else []), 0
        while i < len(text):
            if text[i:i + 2] in self.vocab:
                ids.append(self.vocab.index(text[i:i + 2]))
                i += 2
            else:
                ids.append(self.vocab.index(text[i]))
                i += 1
        return ids

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)


@pytest.mark.parametrize("tok", [WordTokenizer(), MergeTokenizer()])
def test_synthetic_prompts_exact_length(tok):
    prompts = synthetic_prompts(tok, 12, 17, seed=3)
    assert len(prompts) == 12
    for p in prompts:
        assert p.prompt_len == 17 == len(tok.encode(p.prompt, add_special_tokens=False))
        assert "<s>" not in p.prompt
    assert [p.prompt for p in prompts] == [p.prompt for p in synthetic_prompts(tok, 12, 17, seed=3)]
    assert len({p.prompt for p in prompts}) > 1


def test_word_prompts_fit_with_counter():
    count = lambda s: len(s.split()) + s.count("room")  # noqa: E731 - "room" is two tokens
    for p in word_prompts(5, 30, seed=1, count_tokens=count):
        assert count(p.prompt) == 30 == p.prompt_len
    assert all(p.prompt_len == 8 for p in word_prompts(3, 8))


def test_dataset_files(tmp_path):
    tok = WordTokenizer()
    share = [
        {"conversations": [{"from": "human", "value": "w1 w2 w3 w4 w5"}, {"from": "gpt", "value": "w6 w7 w8 w9"}]},
        {"conversations": [{"from": "human", "value": "w1 w2"}, {"from": "gpt", "value": "w6 w7 w8 w9"}]},  # 3 tokens
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"id": "no conversations"},
    ]
    p = tmp_path / "sharegpt.json"
    p.write_text(json.dumps(share))
    got = load_dataset_prompts(p, 1, tokenizer=tok)
    assert [(g.prompt, g.prompt_len, g.output_len) for g in got] == [("w1 w2 w3 w4 w5", 6, 5)]
    got = load_dataset_prompts(p, 4, output_len=7)            # no tokenizer: no filter, oversampled to 4
    assert len(got) == 4 and {g.prompt for g in got} == {"w1 w2 w3 w4 w5", "w1 w2"}
    assert all(g.output_len == 7 and g.prompt_len == 0 for g in got)
    j = tmp_path / "p.jsonl"
    j.write_text('{"prompt": "w1 w2"}\n\n"w3"\n{"text": "w4 w5 w6"}\n')
    assert [(g.prompt, g.prompt_len) for g in load_dataset_prompts(j, 3, tokenizer=tok)] == \
        [("w1 w2", 3), ("w3", 2), ("w4 w5 w6", 4)]
    t = tmp_path / "p.txt"
    t.write_text("first prompt\n\nsecond prompt\n")
    assert [g.prompt for g in load_dataset_prompts(t, 2)] == ["first prompt", "second prompt"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{\n")
    with pytest.raises(VtoolError):
        load_dataset_prompts(bad, 2)
    with pytest.raises(VtoolError):
        load_dataset_prompts(tmp_path / "missing.json", 2)


# ----------------------------------------------------------------------------- a real SSE server

T_FIRST, GAP, USAGE_DELAY = 0.20, 0.08, 0.12   # seconds
N_TOKENS = 5
API_KEY = "sk-test-key"
TOL = 0.045


def _make_app():
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    app.state.seen = []
    app.state.sent = {}
    app.state.peers = []      # the client's (host, port) of each generation request: its connection

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "tiny-model", "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(req: Request):
        body = await req.json()
        n = len(body["prompt"].split()) + (1 if body.get("add_special_tokens", True) else 0)
        return {"count": n, "tokens": list(range(n)), "max_model_len": 4096}

    app.state.in_flight = 0
    app.state.max_in_flight = 0   # the most generation streams open at once

    async def stream(body: dict, chat: bool, prompt_tokens: int, sent: list):
        app.state.in_flight += 1
        app.state.max_in_flight = max(app.state.max_in_flight, app.state.in_flight)
        try:
            async for event in _events(body, chat, prompt_tokens, sent):
                yield event
        finally:
            app.state.in_flight -= 1

    async def _events(body: dict, chat: bool, prompt_tokens: int, sent: list):
        # `sent` gets the perf_counter time each content chunk (and the usage chunk) is handed over;
        # server thread and client share the process clock.
        def chunk(i: int) -> str:
            if chat:
                delta = {"content": f"t{i} "} | ({"role": "assistant"} if i == 0 else {})
                choice = {"index": 0, "delta": delta, "finish_reason": None}
            else:
                choice = {"index": 0, "text": f"t{i} ", "finish_reason": None}
            return "data: " + json.dumps({"id": "x", "choices": [choice]}) + "\n\n"

        n = body.get("max_completion_tokens" if chat else "max_tokens")
        yield ": keep-alive comment\n\n"                 # a comment before the first token: not TTFT
        await asyncio.sleep(T_FIRST)
        sent.append(time.perf_counter())
        yield chunk(0)
        for i in range(1, n):
            await asyncio.sleep(GAP)
            if i == 2:                                   # an empty-choices chunk in the middle of a gap
                yield "data: " + json.dumps({"id": "x", "choices": []}) + "\n\n"
                await asyncio.sleep(GAP)
            if i == 3:                                   # one event split across two writes
                c = chunk(i)
                yield c[:15]
                await asyncio.sleep(0.005)
                sent.append(time.perf_counter())
                yield c[15:]
            else:
                sent.append(time.perf_counter())
                yield chunk(i)
        await asyncio.sleep(USAGE_DELAY)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        sent.append(time.perf_counter())
        yield "data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\ndata: [DONE]\n\n"

    async def handle(req: Request, chat: bool):
        body = await req.json()
        app.state.seen.append((req.headers.get("authorization"), body))
        app.state.peers.append((req.client.host, req.client.port))
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if "FAIL" in prompt:
            return JSONResponse({"error": {"message": "synthetic failure"}}, status_code=500)
        if req.headers.get("authorization") != f"Bearer {API_KEY}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        sent = app.state.sent.setdefault(prompt, [])
        sent.clear()
        return StreamingResponse(stream(body, chat, len(prompt.split()) + 1, sent), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: Request):
        return await handle(req, chat=True)

    return app


@pytest.fixture(scope="module")
def server():
    with _serving(_make_app()) as served:
        yield served


@contextlib.contextmanager
def _serving(app):
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", app
    srv.should_exit = True
    th.join(timeout=5)
    sock.close()


def _expected_itl(chat: bool) -> list[float]:
    # gap 2 holds the empty-choices chunk: completions time it from token 1, chat from the empty chunk
    return [GAP, GAP if chat else 2 * GAP, GAP, GAP]


def _check_timing(rec: RequestRecord, chat: bool, sent: list[float]):
    """Against the sleeps: each gap within TOL (sleeps overshoot under load, so sums are bounded
    loosely); against the server's own send times (same clock): every arrival within TOL."""
    assert rec.success, rec.error
    assert T_FIRST - 0.002 <= rec.ttft <= T_FIRST + 0.1
    assert len(rec.itl) == N_TOKENS - 1
    for got, want in zip(rec.itl, _expected_itl(chat)):
        assert want - TOL < got < want + TOL, (rec.itl, chat)
    assert len(sent) == N_TOKENS + 1                          # content chunks, then usage
    assert sent[0] - 0.002 <= rec.start_time + rec.ttft < sent[0] + TOL
    if not chat:  # completions: start + ttft + cumsum(itl) is each content chunk's arrival
        arrivals = np.cumsum([rec.start_time + rec.ttft] + rec.itl)
        for got, at in zip(arrivals, sent):
            assert at - 0.002 <= got < at + TOL, (list(arrivals), sent)
    nominal_end = T_FIRST + 5 * GAP
    if chat:   # chat: the request ends at the usage chunk; the empty chunk moved the ITL origin
        assert sent[-1] - 0.002 <= rec.start_time + rec.latency < sent[-1] + TOL
        assert abs(rec.latency - (rec.ttft + sum(rec.itl)) - (GAP + USAGE_DELAY)) < 2 * TOL
        nominal_end += USAGE_DELAY
    else:      # completions: the request ends at the last content chunk
        assert rec.latency == pytest.approx(rec.ttft + sum(rec.itl), abs=1e-9)
    assert nominal_end - 0.002 <= rec.latency < nominal_end + 0.25
    assert rec.output_tokens == N_TOKENS
    assert rec.prompt_len == 4                  # usage.prompt_tokens replaced the client's 999
    assert rec.generated_text == "".join(f"t{i} " for i in range(N_TOKENS))


@pytest.mark.parametrize("chat", [False, True])
def test_single_request_timing(server, chat):
    url, app = server
    inp = RequestInput("hello tiny world", 999, N_TOKENS, "tiny-model",
                       endpoint_url(url, "chat" if chat else "completions"), ignore_eos=True, api_key=API_KEY)
    func = request_chat_completions if chat else request_completions

    async def go():
        from vtool.runtime.bench.client import make_client
        async with make_client(1) as client:
            return await func(client, inp)

    rec = asyncio.run(go())
    _check_timing(rec, chat, app.state.sent["hello tiny world"])
    auth, body = app.state.seen[-1]
    assert auth == f"Bearer {API_KEY}"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    if chat:
        assert body["max_completion_tokens"] == N_TOKENS and body["messages"][0]["role"] == "user"
    else:
        assert body["max_tokens"] == N_TOKENS and body["prompt"] == "hello tiny world"


@pytest.mark.parametrize("limit", [2, None])
def test_requests_in_flight_each_keep_one_connection_alive(server, limit):
    """A run opens one connection per request in flight and reuses it for later requests: with a
    limit of 2 (and with none, requests sent 0.1 s apart that each take ~0.3 s: 3-4 in flight) eight
    requests arrive over a handful of kept-alive connections, never one connection per request."""
    url, app = server
    ep = endpoint_url(url, "completions")
    inputs = [RequestInput(f"keep alive {i}", 3, 1, "tiny-model", ep, api_key=API_KEY) for i in range(8)]
    before = len(app.state.peers)
    rate = math.inf if limit else 10.0
    recs, _ = asyncio.run(run_requests(inputs, "completions", max_concurrency=limit, request_rate=rate,
                                       burstiness=math.inf))
    assert all(r.success for r in recs), [r.error for r in recs]
    peers = app.state.peers[before:]
    assert len(peers) == 8
    if limit:
        assert len(set(peers)) == limit, peers
    else:
        assert 3 <= len(set(peers)) <= 5, peers
    assert all(r.retries == 0 for r in recs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), max_size=40))
def test_client_pool_hands_out_each_client_once_and_grows_to_the_peak(moves):
    """ClientPool under any order of take (True) and give-back (False, of the oldest taken): a
    client is never handed to two holders at once, each is a one-connection client, and the pool
    makes exactly as many as were ever held at once (so a concurrency limit bounds it)."""
    pool = ClientPool()
    held: list = []
    peak = 0
    for take in moves:
        if take:
            client = pool.take()
            assert all(client is not h for h in held)
            held.append(client)
            peak = max(peak, len(held))
        elif held:
            pool.give(held.pop(0))
    assert pool.size == peak
    for client in held:
        assert client._transport._pool._max_connections == 1
    asyncio.run(pool.aclose())
    assert pool.size == 0


def _numbered_inputs(url: str, n: int, output_len: int = 1) -> list[RequestInput]:
    """Input i has i + 1 words, so the server's usage.prompt_tokens (words + 1) names it: i + 2."""
    ep = endpoint_url(url, "completions")
    return [RequestInput(" ".join(["w"] * (i + 1)), 0, output_len, "tiny-model", ep, api_key=API_KEY)
            for i in range(n)]


def test_worker_processes_keep_the_runs_contract(server):
    """Streams read by two worker processes: records come back in input order, every one timed
    on the clock this process measures the run with (the server's first chunk comes T_FIRST after
    the request), and the concurrency limit holds over both workers (the server never sees more
    than 3 streams at once, and sees 3)."""
    url, app = server
    inputs = _numbered_inputs(url, 8)
    app.state.max_in_flight = 0
    t_before = time.perf_counter()
    recs, duration = asyncio.run(run_requests(inputs, "completions", max_concurrency=3, processes=2))
    assert all(r.success for r in recs), [r.error for r in recs]
    assert [r.prompt_len for r in recs] == [i + 2 for i in range(8)]
    assert app.state.max_in_flight == 3
    for r in recs:
        # the slack is for two worker processes on a loaded CI machine (0.328 s seen once); a TTFT
        # counted from the run's start instead of the request's would still fail: the last
        # requests start a whole request (T_FIRST + 5 GAP) after the first
        assert T_FIRST - 0.002 <= r.ttft < T_FIRST + 0.3
        assert t_before <= r.start_time
    span = max(r.start_time + r.latency for r in recs) - min(r.start_time for r in recs)
    assert span - 0.002 <= duration < span + 0.5


def test_a_dead_worker_fails_its_requests_and_the_run_goes_on(server):
    """A worker process killed mid-run: the requests it held fail by name, the rest run on the
    other worker, and the run returns (no hang)."""
    import multiprocessing

    from vtool.runtime.bench.client_processes import WORKER_DIED

    url, _ = server
    inputs = _numbered_inputs(url, 8, output_len=N_TOKENS)
    killed: list[int] = []

    def kill_one(rec: RequestRecord) -> None:
        if not killed:
            worker = next(p for p in multiprocessing.active_children() if p.name == "vtool-bench-client")
            worker.kill()
            killed.append(worker.pid)

    inputs[0] = dataclasses.replace(inputs[0], output_len=1)   # ends first: its on_done kills a worker
    recs, _ = asyncio.run(run_requests(inputs, "completions", max_concurrency=4, processes=2, on_done=kill_one))
    assert killed and len(recs) == 8
    failed = [r for r in recs if not r.success]
    assert failed and all(r.error == WORKER_DIED for r in failed)
    assert sum(r.success for r in recs) >= 4


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.integers(0, 4096)), st.integers(1, 256))
def test_default_client_processes(concurrency, cores):
    """One process below 32 streams or without a limit; else one per 16 streams, at most half the
    cores and 8; never fewer for more streams."""
    from vtool.runtime.bench.client_processes import default_client_processes

    n = default_client_processes(concurrency, cores)
    assert 1 <= n <= 8
    if not concurrency or concurrency < 32:
        assert n == 1
    else:
        assert n == max(1, min(8, cores // 2, concurrency // 16))
        assert default_client_processes(concurrency + 16, cores) >= n


def test_failures_are_recorded(server):
    url, _ = server
    ep = endpoint_url(url, "completions")
    inputs = [RequestInput("please FAIL", 3, 2, "tiny-model", ep, api_key=API_KEY),
              RequestInput("wrong key", 3, 2, "tiny-model", ep, api_key="nope"),
              RequestInput("unreachable", 3, 2, "tiny-model", "http://127.0.0.1:9/v1/completions", api_key=API_KEY)]
    recs, dur = asyncio.run(run_requests(inputs, "completions", max_concurrency=3))
    assert dur > 0 and not any(r.success for r in recs)
    assert recs[0].error.startswith("HTTP 500") and "synthetic failure" in recs[0].error
    assert recs[1].error.startswith("HTTP 401")
    assert recs[2].error                         # a connection error, by name
    assert NO_TTFT_ERROR.startswith("Never received")


@pytest.mark.parametrize("client_processes", [None, 2])
def test_run_bench_end_to_end(server, tmp_path, client_processes):
    url, _ = server
    prompts = [BenchPrompt("one two", 2), BenchPrompt("three four five", 3), BenchPrompt("FAIL here", 2),
               BenchPrompt("six", 1)]
    out = io.StringIO()
    console = Console(file=out, width=140, force_terminal=False)
    path = tmp_path / "res" / "bench.json"
    t0 = time.perf_counter()
    report = run_bench(url + "/v1", None, prompts, N_TOKENS, [1, 4], "completions", API_KEY, console, path,
                       client_processes=client_processes)
    wall = time.perf_counter() - t0
    assert report["model_id"] == "tiny-model"           # discovered through /v1/models
    assert json.loads(path.read_text()) == report
    assert [r["max_concurrency"] for r in report["runs"]] == [1, 4]
    assert [r["client_processes"] for r in report["runs"]] == [client_processes or 1] * 2
    per_req = T_FIRST + 5 * GAP
    for run in report["runs"]:
        assert (run["completed"], run["failed"]) == (3, 1)
        assert run["total_output_tokens"] == 3 * N_TOKENS
        assert run["total_input_tokens"] == (3 + 4 + 2)   # usage.prompt_tokens = words + 1
        assert "synthetic failure" in run["failed_errors"][0]
        assert run["request_throughput"] == pytest.approx(3 / run["duration"])
        assert run["output_throughput"] == pytest.approx(15 / run["duration"])
        assert 1000 * T_FIRST - 2 <= run["mean_ttft_ms"] < 1000 * T_FIRST + 100
        assert 1000 * 5 * GAP / 4 - 2 <= run["mean_tpot_ms"] < 1000 * (5 * GAP / 4 + TOL)
        assert abs(run["median_itl_ms"] - 1000 * GAP) < 1000 * TOL
        assert 1000 * per_req - 2 <= run["mean_e2el_ms"] < 1000 * per_req + 250
        for m in ("ttft", "tpot", "itl", "e2el"):
            for k in (f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms", f"p50_{m}_ms", f"p90_{m}_ms", f"p99_{m}_ms"):
                assert isinstance(run[k], float), k
        assert "ttfts" not in run                          # only with save_detailed
        assert run["server_steps"] is None                 # no vtool /metrics behind this server
    c1, c4 = report["runs"]
    assert c1["duration"] > 3 * per_req - 0.05          # one at a time
    assert c4["duration"] < 2 * per_req                 # all at once
    assert c4["max_concurrent_requests"] == 3
    assert wall < 12
    text = out.getvalue()
    for title in ("Time to First Token", "Time per Output Token (excl. 1st token)", "Inter-token Latency",
                  "End-to-end Latency", "Output token throughput (tok/s)", "Peak concurrent requests", "Summary",
                  "Error 0"):
        assert title in text, title


@given(st.lists(st.tuples(st.sampled_from(("decode", "mixed", "prefill")), st.floats(0, 5, allow_nan=False)),
                max_size=40), st.integers(0, 20))
def test_server_steps_between_two_snapshots(steps, already):
    """What a level took, from two scrapes of a server whose counters already hold earlier steps."""
    from vtool.runtime.bench import server_steps as ss

    def snapshot(items):
        return {k: (float(sum(1 for kind, _ in items if kind == k)), sum(t for kind, t in items if kind == k))
                for k in ss.KINDS}

    earlier = [("decode", 0.01)] * already
    got = ss.between(snapshot(earlier), snapshot(earlier + steps))
    for kind in ss.KINDS:
        mine = [t for k, t in steps if k == kind]
        assert got[kind]["steps"] == len(mine)
        if mine:
            assert got[kind]["mean_ms"] == pytest.approx(1e3 * sum(mine) / len(mine), abs=2e-3)
        else:
            assert got[kind]["mean_ms"] is None
    line = ss.describe(got)
    assert line.startswith("server steps: ") and all((f" {k} (" in line) == any(s == k for s, _ in steps)
                                                     for k in ss.KINDS)
    assert ss.between(None, snapshot(steps)) is None and ss.describe(None) is None
    if steps:  # a server that restarted between the scrapes: its counters start again
        assert ss.between(snapshot(earlier + steps), snapshot([])) is None


def test_bench_main_chat_synthetic(server, tmp_path):
    url, app = server
    opts = BenchOptions(model=None, url=url, endpoint="chat", num_prompts=3, input_len=6, output_len=N_TOKENS,
                        concurrency=parse_concurrency("3"), api_key=API_KEY, seed=1,
                        result_json=str(tmp_path / "chat.json"), save_detailed=True, ignore_eos=True)
    out = io.StringIO()
    report = bench_main(opts, tokenizer=WordTokenizer(), console=Console(file=out, width=140))
    run = report["runs"][0]
    assert report["endpoint"] == "/v1/chat/completions" and report["endpoint_type"] == "openai-chat"
    assert (run["completed"], run["failed"]) == (3, 0)
    sent = [b for _, b in app.state.seen[-3:]]
    assert all(len(b["messages"][0]["content"].split()) == 6 for b in sent)   # exact --input-len
    assert run["total_input_tokens"] == 3 * 7
    assert len(run["ttfts"]) == len(run["itls"]) == len(run["errors"]) == len(run["generated_texts"]) == 3
    for itl, e2el, ttft in zip(run["itls"], run["e2els"], run["ttfts"]):
        assert e2el - ttft - sum(itl) == pytest.approx(GAP + USAGE_DELAY, abs=TOL)  # empty chunk + usage chunk
    assert json.loads((tmp_path / "chat.json").read_text())["runs"][0]["completed"] == 3
    assert "warning" not in out.getvalue()
    # no sampling flag given: greedy, as vLLM's bench (not the server's default temperature)
    assert all(b["temperature"] == 0.0 and "top_p" not in b for b in sent)
    assert report["sampling_params"] == {"temperature": 0.0}


def _invoke_bench(args: list[str]):
    from click.testing import CliRunner
    from vtool.runtime.cli import main

    return CliRunner().invoke(main, ["bench", *args])


def test_cli_sampling_and_arrival_flags_reach_every_request(server, tmp_path):
    url, app = server
    before = len(app.state.seen)
    out = tmp_path / "r.json"
    done = _invoke_bench(["--url", url, "--api-key", API_KEY, "--num-prompts", "3", "--input-len", "4",
                          "--output-len", str(N_TOKENS), "--concurrency", "3", "--temperature", "0.7",
                          "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05",
                          "--extra-body", '{"top_k": 5, "seed": 3}', "--request-rate", "40", "--burstiness", "0.5",
                          "--metric-percentiles", "25,75", "--goodput", "ttft:5000", "--save-detailed",
                          "--seed", "3", "--result-json", str(out)])
    assert done.exit_code == 0, done.output
    bodies = [b for _, b in app.state.seen[before:]]
    assert len(bodies) == 4                                  # the warm-up request, then 3
    for b in bodies:   # --extra-body over the flags, as vLLM merges them
        assert (b["temperature"], b["top_p"], b["top_k"], b["min_p"], b["seed"]) == (0.7, 0.9, 5, 0.05, 3)
    report = json.loads(out.read_text())
    run = report["runs"][0]
    assert report["sampling_params"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 3}
    assert (report["request_rate"], report["burstiness"], report["percentiles"]) == (40.0, 0.5, [25.0, 75.0])
    assert "p25_ttft_ms" in run and "p75_itl_ms" in run and "p99_ttft_ms" not in run
    assert run["request_goodput"] == pytest.approx(run["completed"] / run["duration"])
    assert len(run["e2els"]) == 3
    # A finite rate spreads the arrivals as the seed's gamma gaps say (seed 3 draws a wide
    # spread: an unpinned seed can draw three arrivals within a few ms and fail this).
    planned = request_delays(3, 40.0, 0.5, np.random.default_rng(3))
    starts = sorted(run["start_times"])
    assert starts[-1] - starts[0] > 0.5 * (planned[-1] - planned[0]) > 0.03


@pytest.mark.parametrize("args, words", [
    (["--extra-body", "{top_k: 5}"], "--extra-body is not valid JSON"),
    (["--extra-body", "[1, 2]"], "--extra-body must be a JSON object"),
    (["--top-p", "1.5"], "--top-p 1.5"),
    (["--top-p", "0"], "--top-p 0 keeps no token"),
    (["--min-p", "-0.1"], "--min-p -0.1"),
    (["--temperature", "nan"], "--temperature nan"),
    (["--top-k", "0"], "--top-k 0"),
    (["--request-rate", "0"], "--request-rate '0'"),
    (["--request-rate", "fast"], "--request-rate 'fast' is not a number"),
    (["--metric-percentiles", "50,101"], "--metric-percentiles: 101 is outside 0-100"),
    (["--goodput", "itl:5"], "--goodput"),
])
def test_cli_refuses_bad_bench_flags_before_connecting(args, words):
    # port 9 (discard) is never served: a refusal must come before any request
    done = _invoke_bench(["--url", "http://127.0.0.1:9", *args])
    assert done.exit_code == 2, done.output
    assert words in done.output


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@given(temperature=st.none() | finite, top_p=st.none() | finite, top_k=st.none() | st.integers(-3, 100),
       min_p=st.none() | finite,
       extra=st.none() | st.dictionaries(st.sampled_from(["temperature", "top_k", "seed", "n"]), st.integers(0, 9)))
def test_sampling_body_is_vllms(temperature, top_p, top_k, min_p, extra):
    valid = ((temperature is None or temperature >= 0) and (top_p is None or 0 < top_p <= 1)
             and (top_k is None or top_k == -1 or top_k > 0) and (min_p is None or 0 <= min_p <= 1))
    if not valid:
        with pytest.raises(VtoolError):
            command.sampling_body(temperature, top_p, top_k, min_p, extra)
        return
    body = command.sampling_body(temperature, top_p, top_k, min_p, extra)
    given_flags = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}
    for key, value in given_flags.items():
        if key in (extra or {}):
            assert body[key] == extra[key]
        elif value is not None:
            assert body[key] == value
        else:
            assert key not in body or (key == "temperature" and body[key] == 0.0)
    assert "temperature" in body
    assert set(body) == {k for k, v in given_flags.items() if v is not None} | {"temperature"} | set(extra or {})


def test_failed_test_run_is_refused(server):
    url, _ = server
    console = Console(file=io.StringIO())
    with pytest.raises(VtoolError, match="initial test request"):
        run_bench(url, "tiny-model", [BenchPrompt("FAIL first", 2)], 2, [1], "completions", API_KEY, console)
    with pytest.raises(VtoolError, match="--endpoint"):
        run_bench(url, "tiny-model", [BenchPrompt("x", 1)], 2, [1], "embeddings", API_KEY, console)


# ----------------------------------------------------------------------------- a llama-server-shaped server

class BigWordTokenizer(WordTokenizer):
    """WordTokenizer over 3000 words: enough distinct prompts for fresh prompts per run."""
    vocab_size = 3000

    def __init__(self):
        self.words = ["<s>"] + [f"w{i}" for i in range(1, self.vocab_size)]
        self.index = {w: i for i, w in enumerate(self.words)}

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [self.index[w] for w in text.split() if w in self.index]


def _make_llama_like_app():
    """The shapes llama-server 0c1e570 sends (see test_stream_parser_llama_server_capture):
    /tokenize reads {"content"} (vLLM's {"prompt"} gets {"tokens": []}); completions put usage in
    the finish chunk, whose text is empty; chat sends a role chunk, the content, a finish chunk
    with an empty delta, and usage in a chunk of its own only with include_usage. The prompt
    is counted in words, plus a BOS on completions and a 5-token template on chat;
    `app.state.usage` keeps every usage sent."""
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    app.state.prompts = []
    app.state.usage = []

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "/models/tiny.gguf", "object": "model", "owned_by": "llamacpp"}]}

    @app.post("/tokenize")
    async def tokenize(req: Request):
        body = await req.json()
        return {"tokens": list(range(len(body["content"].split()))) if "content" in body else []}

    async def stream(body: dict, chat: bool, prompt: str):
        n = body.get("max_completion_tokens" if chat else "max_tokens")
        p = len(prompt.split()) + (5 if chat else 1)
        usage = {"completion_tokens": n, "prompt_tokens": p, "total_tokens": n + p,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        app.state.usage.append(usage)
        if chat:
            yield "data: " + json.dumps({"choices": [{"finish_reason": None, "index": 0,
                                                      "delta": {"role": "assistant", "content": None}}]}) + "\n\n"
        for i in range(n):
            await asyncio.sleep(0.002)
            piece = {"delta": {"content": f" w{i + 1}"}} if chat else {"text": f" w{i + 1}", "logprobs": None}
            yield "data: " + json.dumps({"choices": [{"index": 0, "finish_reason": None, **piece}]}) + "\n\n"
        if chat:
            yield "data: " + json.dumps({"choices": [{"finish_reason": "length", "index": 0, "delta": {}}]}) + "\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield "data: " + json.dumps({"choices": [], "usage": usage, "timings": {}}) + "\n\n"
        else:
            yield "data: " + json.dumps({"choices": [{"text": "", "index": 0, "logprobs": None,
                                                      "finish_reason": "length"}],
                                         "usage": usage, "timings": {"predicted_n": n}}) + "\n\n"
        yield "data: [DONE]\n\n"

    async def handle(req: Request, chat: bool):
        body = await req.json()
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        app.state.prompts.append(prompt)
        return StreamingResponse(stream(body, chat, prompt), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: Request):
        return await handle(req, chat=True)

    return app


@pytest.fixture(scope="module")
def llama_like():
    with _serving(_make_llama_like_app()) as served:
        yield served


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=150)


def test_llama_like_server_needs_a_tokenizer(llama_like):
    url, app = llama_like
    opts = BenchOptions(url=url, num_prompts=2, input_len=8, output_len=3, concurrency=[1])
    sent = len(app.state.prompts)
    with pytest.raises(VtoolError, match="--tokenizer") as e:
        bench_main(opts, console=_quiet())
    assert "vLLM's shape" in str(e.value) and '{"tokens": []}' in str(e.value)
    assert len(app.state.prompts) == sent                      # refused before sending anything


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_llama_like_server_counts(llama_like, endpoint):
    url, app = llama_like
    n_prompts, input_len, output_len = 3, 9, 4
    first = len(app.state.usage)
    opts = BenchOptions(url=url, endpoint=endpoint, num_prompts=n_prompts, input_len=input_len, output_len=output_len,
                        concurrency=[1, 3], seed=11, save_detailed=True, ignore_eos=True)
    report = bench_main(opts, tokenizer=BigWordTokenizer(), console=_quiet())
    usage = app.state.usage[first:]
    assert len(usage) == 1 + 2 * n_prompts                     # warm-up, then two runs
    for run in report["runs"]:
        assert (run["completed"], run["failed"]) == (n_prompts, 0)
        assert run["output_tokens_counted_by"] == {"usage": n_prompts}
        assert run["output_lens"] == [output_len] * n_prompts
        overhead = 5 if endpoint == "chat" else 1              # the template; the BOS both sides add
        assert run["usage_prompt_tokens"] == [input_len + overhead] * n_prompts
        check = run["prompt_tokens_check"]
        assert check["mismatched_requests"] == 0 and check["requested_total"] == n_prompts * input_len
        assert check["server_total"] == n_prompts * (input_len + overhead)
        assert check["expected_total"] == (None if endpoint == "chat" else check["server_total"])
        assert all(len(itl) == output_len - 1 + (endpoint == "chat") for itl in run["itls"])
    # the totals are the usage the server sent (the warm-up's left out)
    assert sum(r["total_output_tokens"] for r in report["runs"]) == sum(u["completion_tokens"] for u in usage[1:])
    assert sum(r["total_input_tokens"] for r in report["runs"]) == sum(u["prompt_tokens"] for u in usage[1:])
    assert report["model_id"] == "/models/tiny.gguf" and report["fresh_prompts"] is True
    if endpoint == "completions":   # a tokenizer that is not the served model's shows
        class NoBos(BigWordTokenizer):
            def encode(self, text, add_special_tokens=True):
                return super().encode(text, add_special_tokens=False)

        out = io.StringIO()
        report = bench_main(dataclasses.replace(opts, concurrency=[2]), tokenizer=NoBos(),
                            console=Console(file=out, width=300))
        assert report["runs"][0]["prompt_tokens_check"]["mismatched_requests"] == n_prompts
        assert "another prompt length than the client (e.g. requested 9, expected 9, server 10)" in out.getvalue()


def test_llama_like_chat_without_usage_counts_the_text(llama_like):
    url, _ = llama_like
    tok = BigWordTokenizer()
    prompts = [BenchPrompt("w5 w6 w7", 3), BenchPrompt("w8 w9", 2)]
    out = io.StringIO()
    no_usage = {"stream_options": {"include_usage": False}}
    report = run_bench(url, None, prompts, 5, [2], "chat", console=Console(file=out, width=150), warmup=False,
                       count_tokens=lambda s: len(tok.encode(s, add_special_tokens=False)), extra_body=no_usage)
    run = report["runs"][0]
    assert run["completed"] == 2 and run["output_tokens_counted_by"] == {"tokenizer": 2}
    assert run["total_output_tokens"] == 10 and run["input_tokens_from_usage"] == 0
    assert "output tokens counted: 2 by tokenizer" in " ".join(out.getvalue().split())
    # no tokenizer either: a token per chunk with output (the role chunk and the finish chunk are not)
    report = run_bench(url, None, prompts, 5, [2], "chat", console=_quiet(), warmup=False, extra_body=no_usage)
    assert report["runs"][0]["output_tokens_counted_by"] == {"chunks": 2}
    assert report["runs"][0]["total_output_tokens"] == 10 and report["output_token_fallback"] == "chunks"


# ----------------------------------------------------------------------------- fresh prompts

def test_fresh_prompts_per_run(llama_like, monkeypatch):
    url, app = llama_like
    tok = BigWordTokenizer()
    opts = BenchOptions(url=url, num_prompts=4, input_len=7, output_len=2, concurrency=[1, 2, 4], seed=3)
    plan = plan_prompts(opts, "m", [1, 2, 4], 3, tok, _quiet())
    texts = [plan.warmup.prompt] + [bp.prompt for run in plan.runs for bp in run]
    assert len(plan.runs) == 3 and len(set(texts)) == len(texts) == 13
    assert all(len(tok.encode(t, False)) == 7 for t in texts)
    again = plan_prompts(opts, "m", [1, 2, 4], 3, tok, _quiet())
    assert [bp.prompt for run in again.runs for bp in run] == texts[1:]       # a seed reproduces them
    other = plan_prompts(opts, "m", [1, 2, 4], 4, tok, _quiet())
    assert not {bp.prompt for run in other.runs for bp in run} & set(texts)
    same = plan_prompts(dataclasses.replace(opts, fresh_prompts=False), "m", [1, 2, 4], 3, tok, _quiet())
    assert same.runs[0] == same.runs[1] == same.runs[2]

    assert fresh_seed() != fresh_seed()                                   # 32 random bits per invocation
    seeds = iter([1001, 2002])
    monkeypatch.setattr(command, "fresh_seed", lambda: next(seeds))
    first = len(app.state.prompts)
    report = bench_main(dataclasses.replace(opts, seed=None), tokenizer=tok, console=_quiet())
    sent = app.state.prompts[first:]
    assert len(sent) == 1 + 3 * 4 and len(set(sent)) == len(sent)        # warm-up and every run: new prompts
    assert len({s.split()[0] for s in sent}) == len(sent)                 # not even a first token shared
    assert report["fresh_prompts"] is True and report["seed"] == 1001
    first = len(app.state.prompts)
    report2 = bench_main(dataclasses.replace(opts, seed=None), tokenizer=tok, console=_quiet())
    assert report2["seed"] == 2002 and not set(app.state.prompts[first:]) & set(sent)
    report = bench_main(dataclasses.replace(opts, fresh_prompts=False), tokenizer=tok, console=_quiet())
    assert report["fresh_prompts"] is False


def test_the_clients_of_a_run_share_one_verifying_tls_context():
    """run_requests makes one client per request in flight; they share one TLS context (building
    one per slot cost 2 s at 64 before the first request), and it still verifies certificates."""
    import ssl

    from vtool.runtime.bench.client import make_client, tls_context

    clients = [make_client(1) for _ in range(3)]
    try:
        pools = [getattr(c._transport, "_pool", None) for c in clients]
        assert all(getattr(p, "_ssl_context", None) is tls_context() for p in pools)
    finally:
        async def close() -> None:
            for c in clients:
                await c.aclose()
        asyncio.run(close())
    assert tls_context().verify_mode == ssl.CERT_REQUIRED and tls_context().check_hostname
