"""The streaming HTTP client of `vtool bench`: one request as vLLM's endpoint_request_func.py
times it, and a run of many under a concurrency limit and a request rate.

Per request (perf_counter clock; see shared/notes/serving-metrics.md):
* `start_time` just before the POST; `ttft` when the first SSE chunk with non-empty `choices`
  arrives; `itl` one gap per later chunk with choices, measured from `most_recent_timestamp`;
* completions: `most_recent_timestamp` moves only on chunks with choices, so `latency` ends at
  the last content chunk; chat: it moves on every JSON chunk (the usage-only one too), so
  `latency` ends at the last JSON chunk; `[DONE]` never counts;
* `output_tokens` / `prompt_len` come from the usage chunk (stream_options.include_usage);
* success: HTTP 200 and, for completions, at least one chunk with choices; for chat, HTTP 200.
"""
from __future__ import annotations

import asyncio
import codecs
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

import httpx

from vtool.runtime.bench.metrics import RequestRecord

Endpoint = Literal["completions", "chat"]
ENDPOINT_PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
REQUEST_TIMEOUT_S = 6 * 60 * 60   # vLLM's AIOHTTP_TIMEOUT
NO_TTFT_ERROR = "Never received a valid chunk to calculate TTFT. This response will be marked as failed!"


# --------------------------------------------------------------------------- URLs

def api_base(url: str) -> str:
    """The server root of `url`: 'http://h:p', 'http://h:p/v1' and 'http://h:p/v1/completions'
    all give 'http://h:p'. A bare 'host:port' gets 'http://'."""
    u = url.strip().rstrip("/")
    if "://" not in u:
        u = "http://" + u
    for suffix in ("/v1/chat/completions", "/v1/completions", "/v1"):
        if u.endswith(suffix):
            return u[: -len(suffix)]
    return u


def endpoint_url(url: str, endpoint: Endpoint) -> str:
    if endpoint not in ENDPOINT_PATHS:
        raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, got {endpoint!r}")
    return api_base(url) + ENDPOINT_PATHS[endpoint]


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# --------------------------------------------------------------------------- SSE

class SSEDecoder:
    """Incremental Server-Sent-Events decoder: feed raw bytes, get the `data` payload of each
    complete event. Events end at a blank line; lines starting with ':' are comments and are
    skipped; the 'data:' prefix (and one following space) is removed; several data lines of one
    event are joined with '\\n'. CRLF is accepted. Events without data (comment-only) give
    nothing. `[DONE]` is passed through; the caller decides what it means."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += self._decoder.decode(chunk)
        self._buffer = self._buffer.replace("\r\n", "\n")
        out: list[str] = []
        while "\n\n" in self._buffer:
            event, self._buffer = self._buffer.split("\n\n", 1)
            data = self._event_data(event)
            if data is not None:
                out.append(data)
        return out

    def flush(self) -> list[str]:
        """End of stream: a last event not followed by a blank line still counts."""
        self._buffer += self._decoder.decode(b"", final=True)
        rest, self._buffer = self._buffer.replace("\r\n", "\n"), ""
        data = self._event_data(rest)
        return [] if data is None else [data]

    @staticmethod
    def _event_data(event: str) -> str | None:
        lines = []
        for line in event.split("\n"):
            if not line or line.startswith(":"):
                continue
            if line.startswith("data:"):
                value = line[5:]
                lines.append(value[1:] if value.startswith(" ") else value)
        return "\n".join(lines) if lines else None


# --------------------------------------------------------------------------- one request

@dataclasses.dataclass
class RequestInput:
    prompt: str
    prompt_len: int
    output_len: int
    model: str
    api_url: str                      # the full endpoint URL
    ignore_eos: bool = False
    api_key: str | None = None
    extra_body: dict[str, Any] | None = None


def _payload(inp: RequestInput, body: dict[str, Any]) -> dict[str, Any]:
    payload = {"model": inp.model, **body, "stream": True, "stream_options": {"include_usage": True}}
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    if inp.extra_body:
        payload.update(inp.extra_body)
    return payload


def completions_payload(inp: RequestInput) -> dict[str, Any]:
    return _payload(inp, {"prompt": inp.prompt, "max_tokens": inp.output_len})


def chat_payload(inp: RequestInput) -> dict[str, Any]:
    return _payload(inp, {"messages": [{"role": "user", "content": inp.prompt}],
                          "max_completion_tokens": inp.output_len})


async def _stream_request(client: httpx.AsyncClient, inp: RequestInput, chat: bool) -> RequestRecord:
    payload = chat_payload(inp) if chat else completions_payload(inp)
    headers = {"Content-Type": "application/json", **auth_headers(inp.api_key)}
    out = RequestRecord(prompt_len=inp.prompt_len)
    text_parts: list[str] = []
    st = time.perf_counter()
    out.start_time = st
    most_recent = st
    first_chunk = False
    try:
        async with client.stream("POST", inp.api_url, json=payload, headers=headers,
                                 timeout=REQUEST_TIMEOUT_S) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace").strip()
                out.error = f"HTTP {response.status_code} {response.reason_phrase}"
                if body:
                    out.error += f": {body[:500]}"
                return out
            decoder = SSEDecoder()

            def handle(events: list[str]) -> None:
                nonlocal most_recent, first_chunk
                for data in events:
                    if data.strip() == "[DONE]":
                        continue
                    timestamp = time.perf_counter()
                    obj = json.loads(data)
                    choices = obj.get("choices")
                    if choices:
                        if not first_chunk:
                            first_chunk = True
                            out.ttft = timestamp - st
                        else:
                            out.itl.append(timestamp - most_recent)
                        c0 = choices[0] or {}
                        piece = (c0.get("delta") or {}).get("content") if chat else c0.get("text")
                        text_parts.append(piece or "")
                        most_recent = timestamp
                    else:
                        usage = obj.get("usage")
                        if usage:
                            out.output_tokens = int(usage.get("completion_tokens") or 0)
                            if usage.get("prompt_tokens") is not None:
                                out.prompt_len = int(usage["prompt_tokens"])
                        if obj.get("error"):
                            raise RuntimeError(f"server error in stream: {json.dumps(obj['error'])[:500]}")
                        if chat:   # chat: every JSON chunk moves the end, the usage chunk included
                            most_recent = timestamp

            async for chunk in response.aiter_bytes():
                handle(decoder.feed(chunk))
            handle(decoder.flush())
        out.generated_text = "".join(text_parts)
        if first_chunk or chat:
            out.success = True
        else:
            out.error = NO_TTFT_ERROR
        out.latency = most_recent - st
    except Exception as e:  # noqa: BLE001 - any failure is recorded against the request
        out.success = False
        out.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return out


async def request_completions(client: httpx.AsyncClient, inp: RequestInput) -> RequestRecord:
    """One streamed POST /v1/completions (vLLM's async_request_openai_completions)."""
    return await _stream_request(client, inp, chat=False)


async def request_chat_completions(client: httpx.AsyncClient, inp: RequestInput) -> RequestRecord:
    """One streamed POST /v1/chat/completions (vLLM's async_request_openai_chat_completions)."""
    return await _stream_request(client, inp, chat=True)


REQUEST_FUNCS: dict[str, Callable[[httpx.AsyncClient, RequestInput], Any]] = {
    "completions": request_completions,
    "chat": request_chat_completions,
}


# --------------------------------------------------------------------------- a run

def make_client(max_concurrency: int | None = None) -> httpx.AsyncClient:
    """A keep-alive client whose pool never queues a request the semaphore let through."""
    limits = httpx.Limits(max_connections=max_concurrency or None,
                          max_keepalive_connections=max_concurrency or None, keepalive_expiry=60)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S))


def request_delays(n: int, request_rate: float = math.inf, burstiness: float = 1.0,
                   rng: np.random.Generator | None = None) -> list[float]:
    """Send time of each request, seconds after the first (vLLM's get_request): all 0 for an
    infinite rate; otherwise cumulative gamma gaps (shape=burstiness, scale=1/(rate*burstiness);
    burstiness 1 is a Poisson process) rescaled so the last one is at n / rate."""
    if n <= 0:
        return []
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = [1.0 / request_rate] * n
    else:
        rng = rng or np.random.default_rng()
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n).tolist()
    delays = np.cumsum(gaps).tolist()
    if delays[-1] != 0:
        factor = (n / request_rate) / delays[-1]
        delays = [d * factor for d in delays]
    return delays


async def run_requests(
    inputs: Sequence[RequestInput],
    endpoint: Endpoint = "completions",
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    client: httpx.AsyncClient | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every input (in order, at `request_rate`, at most `max_concurrency` in flight) and
    return the records in input order and the benchmark duration: wall time from just before
    the first request is sent until the last one returns."""
    func = REQUEST_FUNCS[endpoint]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    delays = request_delays(len(inputs), request_rate, burstiness,
                            np.random.default_rng(seed) if seed is not None else None)
    own = client is None
    client = client or make_client(max_concurrency)

    async def one(inp: RequestInput) -> RequestRecord:
        if sem is None:
            rec = await func(client, inp)
        else:
            async with sem:
                rec = await func(client, inp)
        if on_done is not None:
            on_done(rec)
        return rec

    try:
        tasks: list[asyncio.Task[RequestRecord]] = []
        t0 = time.perf_counter()
        for inp, delay in zip(inputs, delays):
            wait = t0 + delay - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(inp)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    finally:
        if own:
            await client.aclose()
    return records, duration


# --------------------------------------------------------------------------- discovery

async def fetch_models(url: str, api_key: str | None = None, client: httpx.AsyncClient | None = None) -> list[str]:
    """The ids GET /v1/models lists, in order."""
    own = client is None
    client = client or httpx.AsyncClient(timeout=30)
    try:
        r = await client.get(api_base(url) + "/v1/models", headers=auth_headers(api_key))
        r.raise_for_status()
        return [m["id"] for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]
    finally:
        if own:
            await client.aclose()
