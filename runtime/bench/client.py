"""The streaming HTTP client of `vtool bench`: one request as vLLM's endpoint_request_func.py
times it, and a run of many under a concurrency limit and a request rate.

Per request (perf_counter clock; see shared/notes/serving-metrics.md):
* `start_time` just before the POST; `ttft` when the first SSE chunk with non-empty `choices`
  arrives; `itl` one gap per later chunk with choices, measured from `most_recent_timestamp`;
  one exception to vLLM: a later chunk whose choices carry no output at all but a
  `finish_reason` (llama-server ends every stream with such a chunk: `"text": ""` or
  `"delta": {}`) is a terminator, not a token, so it adds no ITL sample (vLLM would add a ~0
  gap per request against llama-server and none against vLLM or vtool, which put the finish
  reason on the last token's chunk);
* completions: `most_recent_timestamp` moves only on chunks with choices (a terminator
  included), so `latency` ends at the last of them; chat: it moves on every JSON chunk (the
  usage-only one too), so `latency` ends at the last JSON chunk; `[DONE]` never counts;
* `usage` is read wherever a server puts it: a final chunk with empty `choices`
  (stream_options.include_usage: vLLM, vtool, llama-server's chat), the finish chunk itself
  (llama-server's completions), or every chunk (continuous usage: the last one wins).
  `output_tokens` / `prompt_len` come from it; without usage `output_tokens` stays 0 and
  metrics.py counts the generated text instead (and says so);
* success: HTTP 200 and, for completions, at least one chunk with choices; for chat, HTTP 200.
  A chunk that is not JSON, not an object, or an in-band `{"error": ...}` fails the request.
"""
from __future__ import annotations

import asyncio
import codecs
import dataclasses
import functools
import json
import math
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
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


class StreamError(RuntimeError):
    """A stream the client cannot read as OpenAI SSE chunks (recorded against the request)."""


def _int_or_none(x: Any) -> int | None:
    """A usage count: a non-negative whole number (ints, or floats such as 12.0), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x if x >= 0 else None
    if isinstance(x, float) and math.isfinite(x) and x >= 0 and x == int(x):
        return int(x)
    return None


def _text(x: Any) -> str:
    return x if isinstance(x, str) else ""


class StreamParser:
    """The per-request state of one streamed response: feed it each SSE data payload with its
    arrival time; it fills `record` (ttft, itl, latency, text, usage). Pure: no I/O, no clock.
    Raises StreamError for a payload that is not an OpenAI chunk (the caller fails the request)."""

    def __init__(self, record: RequestRecord, start: float, chat: bool) -> None:
        self.record = record
        self.start = start
        self.chat = chat
        self.most_recent = start
        self.first_chunk = False        # a chunk with choices arrived (vLLM's first_chunk_received)
        self._text: list[str] = []
        self._reasoning: list[str] = []

    def _output(self, choice: dict[str, Any]) -> tuple[str, str, bool]:
        """(content text, reasoning text, whether the choice carries any output)."""
        if self.chat:
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                delta = {}
            content = _text(delta.get("content"))
            reasoning = _text(delta.get("reasoning_content")) or _text(delta.get("reasoning"))
            other = bool(delta.get("tool_calls")) or bool(_text(delta.get("refusal")))
            return content, reasoning, bool(content or reasoning or other)
        text = _text(choice.get("text"))
        return text, "", bool(text)

    def feed(self, data: str, timestamp: float) -> None:
        payload = data.strip()
        if not payload or payload == "[DONE]":
            return
        try:
            obj = json.loads(payload)
        except (json.JSONDecodeError, RecursionError) as e:
            raise StreamError(f"a stream chunk is not JSON ({e}): {payload[:200]!r}") from None
        if not isinstance(obj, dict):
            raise StreamError(f"a stream chunk is not a JSON object: {payload[:200]!r}")
        if obj.get("error"):
            raise StreamError(f"server error in stream: {json.dumps(obj['error'])[:500]}")
        usage = obj.get("usage")
        if isinstance(usage, dict):
            completion = _int_or_none(usage.get("completion_tokens"))
            prompt = _int_or_none(usage.get("prompt_tokens"))
            if completion is not None:
                self.record.usage_completion_tokens = completion
            if prompt is not None:
                self.record.usage_prompt_tokens = prompt
            details = usage.get("prompt_tokens_details")
            cached = _int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None
            if cached is not None:
                self.record.usage_cached_tokens = cached
        choices = obj.get("choices")
        if isinstance(choices, list) and choices:
            c0 = choices[0] if isinstance(choices[0], dict) else {}
            content, reasoning, has_output = self._output(c0)
            terminator = self.first_chunk and not has_output and c0.get("finish_reason") is not None
            if not self.first_chunk:
                self.first_chunk = True
                self.record.ttft = timestamp - self.start
            elif not terminator:
                self.record.itl.append(timestamp - self.most_recent)
            self.most_recent = timestamp   # a terminator still ends the request, as in vLLM
            role_only = self.chat and not has_output and isinstance(c0.get("delta"), dict) and "role" in c0["delta"]
            if not terminator and not role_only:
                self.record.output_chunks = (self.record.output_chunks or 0) + 1
            self._text.append(content)
            self._reasoning.append(reasoning)
        if self.chat:   # chat: every JSON chunk moves the end, the usage chunk included
            self.most_recent = timestamp

    def finish(self) -> None:
        """End of the stream: text, latency, usage into the record, and success."""
        rec = self.record
        rec.generated_text = "".join(self._text)
        rec.reasoning_text = "".join(self._reasoning)
        if rec.usage_completion_tokens is not None:
            rec.output_tokens = rec.usage_completion_tokens
        if rec.usage_prompt_tokens is not None:
            rec.prompt_len = rec.usage_prompt_tokens
        rec.output_chunks = rec.output_chunks or 0
        rec.latency = self.most_recent - self.start
        if self.first_chunk or self.chat:
            rec.success = True
        else:
            rec.error = NO_TTFT_ERROR


# A kept-alive connection the server has closed fails the next request before any response:
# llama-server (cpp-httplib) closes the connection after every streamed response although its
# headers say keep-alive. Such a request never reached the server, so it is sent once more on a
# new connection, as curl does ("Connection died, retrying a fresh connect"); the clock restarts.
STALE_CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


async def _stream_request(client: httpx.AsyncClient, inp: RequestInput, chat: bool) -> RequestRecord:
    payload = chat_payload(inp) if chat else completions_payload(inp)
    headers = {"Content-Type": "application/json", **auth_headers(inp.api_key)}
    out = RequestRecord(prompt_len=inp.prompt_len, client_prompt_len=inp.prompt_len)
    for attempt in range(2):
        st = time.perf_counter()
        out.start_time = st
        parser = StreamParser(out, st, chat)
        responded = False
        try:
            async with client.stream("POST", inp.api_url, json=payload, headers=headers,
                                     timeout=REQUEST_TIMEOUT_S) as response:
                responded = True
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", "replace").strip()
                    out.error = f"HTTP {response.status_code} {response.reason_phrase}"
                    if body:
                        out.error += f": {body[:500]}"
                    return out
                decoder = SSEDecoder()
                async for chunk in response.aiter_bytes():
                    for data in decoder.feed(chunk):
                        parser.feed(data, time.perf_counter())
                for data in decoder.flush():
                    parser.feed(data, time.perf_counter())
            parser.finish()
            return out
        except STALE_CONNECTION_ERRORS as e:
            if attempt == 0 and not responded:
                out.retries += 1
                continue
            out.success = False
            out.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        except Exception as e:  # noqa: BLE001 - any failure is recorded against the request
            out.success = False
            out.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return out
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

@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for every client of the process (httpx's default: its CA bundle, the
    SSL_CERT_* environment). Building one loads the CA bundle, ~33 ms on the CPU machine, and a run
    at concurrency 64 built one per slot: 2.1 s before its first request (py-spy, client_capacity.py)."""
    return httpx.create_ssl_context()


def make_client(max_concurrency: int | None = None) -> httpx.AsyncClient:
    """A keep-alive client whose pool never queues a request the semaphore let through."""
    limits = httpx.Limits(max_connections=max_concurrency or None,
                          max_keepalive_connections=max_concurrency or None, keepalive_expiry=60)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S), verify=tls_context())


class ClientPool:
    """Single-connection keep-alive clients, one per request in flight: a request takes an idle
    one (the most recently used: its connection is the likeliest to be alive) or a new one, and
    gives it back when it ends. httpx's own pool scans every connection it holds on each request
    and each response close, asking the socket of every idle one whether the server closed it
    (anyio's getpeername and a poll each): against a server that answers at once, 64 streams
    through one shared pool took in 12.5-13.1k chunks a second with a mean time to first token
    of ~0.5 s, the same streams over one-connection clients 40-44k and ~0.11 s
    (tests/bench/client_capacity.py). A pool of one connection scans one."""

    def __init__(self) -> None:
        self._idle: list[httpx.AsyncClient] = []
        self._all: list[httpx.AsyncClient] = []

    def take(self) -> httpx.AsyncClient:
        if self._idle:
            return self._idle.pop()
        client = make_client(1)
        self._all.append(client)
        return client

    def give(self, client: httpx.AsyncClient) -> None:
        self._idle.append(client)

    @property
    def size(self) -> int:
        """Clients made so far: the most requests that were in flight at once."""
        return len(self._all)

    async def aclose(self) -> None:
        for client in self._all:
            await client.aclose()
        self._all.clear()
        self._idle.clear()


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
    processes: int = 1,
) -> tuple[list[RequestRecord], float]:
    """Send every input (in order, at `request_rate`, at most `max_concurrency` in flight) and
    return the records in input order and the benchmark duration: wall time from just before
    the first request is sent until the last one returns. `processes` > 1 reads the streams in
    that many worker processes (client_processes.py), the schedule and the limit kept here."""
    func = REQUEST_FUNCS[endpoint]
    delays = request_delays(len(inputs), request_rate, burstiness,
                            np.random.default_rng(seed) if seed is not None else None)
    if processes > 1:
        from vtool.runtime.bench.client_processes import run_requests_in_processes

        return await run_requests_in_processes(inputs, delays, endpoint, max_concurrency, processes, on_done)
    pool = ClientPool()

    async def send(i: int) -> RequestRecord:
        client = pool.take()
        try:
            return await func(client, inputs[i])
        finally:
            pool.give(client)

    try:
        return await run_schedule(delays, send, max_concurrency, on_done)
    finally:
        await pool.aclose()


async def run_schedule(delays: Sequence[float], send: Callable[[int], Awaitable[RequestRecord]],
                       max_concurrency: int | None,
                       on_done: Callable[[RequestRecord], None] | None) -> tuple[list[RequestRecord], float]:
    """A run's shape, whoever streams the requests: request i is sent (`send(i)`) at its delay
    after the start, at most `max_concurrency` in flight; `on_done` sees each record as it ends.
    Returns the records in input order and the wall time from the start to the last return."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(i: int) -> RequestRecord:
        if limit is None:
            rec = await send(i)
        else:
            async with limit:
                rec = await send(i)
        if on_done is not None:
            on_done(rec)
        return rec

    tasks: list[asyncio.Task[RequestRecord]] = []
    t0 = time.perf_counter()
    for i, delay in enumerate(delays):
        wait = t0 + delay - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(i)))
    records = list(await asyncio.gather(*tasks))
    return records, time.perf_counter() - t0


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
