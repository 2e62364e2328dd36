"""The metrics of `vllm bench serve`, computed from per-request records.

Pure functions, no I/O. The definitions follow vLLM's `calculate_metrics`
(`vllm/benchmarks/serve.py`) as written down in shared/notes/serving-metrics.md:

* only successful requests enter the latency lists; a failed one adds 0 output tokens;
* output tokens: the server's usage, else the generated text re-tokenized, else (where vLLM
  counts 1) one per content chunk; the result says which (`output_tokens_counted_by`);
* TTFT, E2EL: one sample per request; TPOT = (latency - ttft) / (output_len - 1), only for
  requests with output_len > 1; ITL: every per-chunk gap of every request pooled in one list;
* throughputs divide by the benchmark's wall duration;
* statistics are numpy's mean / median / std / percentile (linear) of the list, or of 0 when
  the list is empty, times 1000 (ms);
* peak output throughput and peak concurrency are maxima over 1-second bins counted from the
  earliest successful start.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
METRIC_NAMES: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")


@dataclasses.dataclass
class RequestRecord:
    """What one streamed request measured (vLLM's RequestFuncOutput). Times are seconds,
    from time.perf_counter(); `start_time` is the perf_counter value just before the POST."""

    success: bool = False
    prompt_len: int = 0             # usage.prompt_tokens when the server sent it, else the client's count
    output_tokens: int = 0          # usage.completion_tokens; 0 when the server sent no usage
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""
    generated_text: str = ""
    reasoning_text: str = ""        # chat: delta.reasoning_content / reasoning (thinking models)
    client_prompt_len: int | None = None      # the client's own count of the prompt it sent
    usage_prompt_tokens: int | None = None    # what the server's usage said, None without usage
    usage_completion_tokens: int | None = None
    usage_cached_tokens: int | None = None    # usage.prompt_tokens_details.cached_tokens
    retries: int = 0                # sent again after a stale keep-alive connection failed it (client.py)
    output_chunks: int | None = None          # chunks with choices that were neither role-only nor a terminator

    @property
    def content_chunks(self) -> int:
        """Chunks that carried output: as the client counted them, else the first one and one
        per ITL gap."""
        if self.output_chunks is not None:
            return self.output_chunks
        return 1 + len(self.itl) if self.success else 0


@dataclasses.dataclass(frozen=True)
class LatencyStats:
    """mean / median / std and the selected percentiles of one latency list, in ms."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: tuple[tuple[float, float], ...]   # ((p, value_ms), ...)

    def percentile(self, p: float) -> float:
        for q, v in self.percentiles_ms:
            if q == p:
                return v
        raise KeyError(p)


@dataclasses.dataclass(frozen=True)
class BenchMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    output_lens: tuple[int, ...]      # per request, 0 for failed ones (vLLM's actual_output_lens)
    output_count_methods: dict[str, int] = dataclasses.field(default_factory=dict)  # method -> successful requests
    input_from_usage: int = 0         # successful requests whose prompt length came from usage
    cached_prompt_tokens: int | None = None   # sum of usage.prompt_tokens_details.cached_tokens, None if never sent

    def to_dict(self) -> dict[str, Any]:
        """The summary keys of vLLM's result JSON (duration, completed, ..., p99_ttft_ms, ...)."""
        d: dict[str, Any] = {
            "duration": self.duration_s,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input,
            "total_output_tokens": self.total_output,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_output_tokens_per_s": self.max_output_tokens_per_s,
            "max_concurrent_requests": self.max_concurrent_requests,
            "output_tokens_counted_by": dict(self.output_count_methods),
            "input_tokens_from_usage": self.input_from_usage,
            "cached_prompt_tokens": self.cached_prompt_tokens,
        }
        for name in METRIC_NAMES:
            st: LatencyStats = getattr(self, name)
            d[f"mean_{name}_ms"] = st.mean_ms
            d[f"median_{name}_ms"] = st.median_ms
            d[f"std_{name}_ms"] = st.std_ms
            for p, v in st.percentiles_ms:
                d[f"p{format_percentile(p)}_{name}_ms"] = v
        return d


def format_percentile(p: float) -> str:
    """99 -> '99', 99.9 -> '99.9' (vLLM's `str(int(p)) if int(p) == p else str(p)`)."""
    return str(int(p)) if int(p) == p else str(p)


def latency_stats(values_s: Sequence[float], percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> LatencyStats:
    """vLLM's `np.mean(xs or 0) * 1000` etc.: an empty list gives zeros."""
    xs: Any = list(values_s) or 0
    return LatencyStats(
        mean_ms=float(np.mean(xs)) * 1000,
        median_ms=float(np.median(xs)) * 1000,
        std_ms=float(np.std(xs)) * 1000,
        percentiles_ms=tuple((float(p), float(np.percentile(xs, p)) * 1000) for p in percentiles),
    )


# How a request's output tokens were counted (BenchMetrics.output_count_methods):
USAGE = "usage"               # the server's usage.completion_tokens
TOKENIZER = "tokenizer"       # the generated text re-tokenized with the client's tokenizer
CHUNKS = "chunks"             # no usage, no tokenizer: one token per chunk with output (a lower bound)


def count_output_tokens(rec: RequestRecord, count_tokens: Callable[[str], int] | None = None,
                        method: str = TOKENIZER) -> tuple[int, str]:
    """(output tokens, how they were counted): usage.completion_tokens when the server sent a
    positive one (vLLM's rule: 0 counts as missing); else the generated text (reasoning
    included) re-tokenized without special tokens by `count_tokens`, named `method`; else
    one per content chunk (vLLM counts 1 per request here, which makes output throughput
    meaningless against a server that sends no usage)."""
    if rec.output_tokens:
        return int(rec.output_tokens), USAGE
    if count_tokens is not None:
        return int(count_tokens(rec.reasoning_text + rec.generated_text)), method
    return rec.content_chunks, CHUNKS


def request_output_len(rec: RequestRecord, count_tokens: Callable[[str], int] | None = None) -> int:
    return count_output_tokens(rec, count_tokens)[0]


def tpot_of(rec: RequestRecord, output_len: int) -> float | None:
    """(latency - ttft) / (output_len - 1), or None when output_len <= 1."""
    if output_len > 1:
        return (rec.latency - rec.ttft) / (output_len - 1)
    return None


def token_timestamps(rec: RequestRecord) -> list[float]:
    """start_time + ttft + cumsum(itl): one timestamp per content chunk."""
    t = rec.start_time + rec.ttft
    times = [t]
    for gap in rec.itl:
        t += gap
        times.append(t)
    return times


def peak_rates(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """(peak output chunks per 1-second bin, peak requests active in a 1-second bin), over the
    successful requests; bins counted from the earliest successful start (vLLM serve.py:494-546)."""
    ok = [r for r in records if r.success]
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    t_end = max(r.start_time + r.latency for r in ok)
    n_bins = int(np.ceil(t_end - t0)) + 1
    tokens = np.zeros(n_bins)
    active = np.zeros(n_bins)
    for r in ok:
        for t in token_timestamps(r):
            b = int(t - t0)
            if 0 <= b < n_bins:
                tokens[b] += 1
        first = int(r.start_time - t0)
        last = int((r.start_time + r.latency) - t0)
        for b in range(max(first, 0), min(last, n_bins - 1) + 1):
            active[b] += 1
    return float(np.max(tokens)), int(np.max(active))


def calculate_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
    count_tokens: Callable[[str], int] | None = None,
    goodput_slo_ms: dict[str, float] | None = None,
    count_method: str = TOKENIZER,
) -> BenchMetrics:
    """vLLM's calculate_metrics. `goodput_slo_ms` maps any of ttft/tpot/e2el to an SLO in ms; a
    successful request is good when every given SLO >= its value (TPOT 0 for output_len <= 1).
    Output tokens: count_output_tokens (`count_method` names `count_tokens` in the result)."""
    if duration_s <= 0 or not math.isfinite(duration_s):
        raise ValueError(f"benchmark duration must be a positive number of seconds, got {duration_s!r}")
    percentiles = tuple(float(p) for p in percentiles)
    output_lens: list[int] = []
    total_input = 0
    completed = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    methods: dict[str, int] = {}
    from_usage = 0
    cached: int | None = None
    for rec in records:
        if not rec.success:
            output_lens.append(0)
            continue
        n, how = count_output_tokens(rec, count_tokens, count_method)
        methods[how] = methods.get(how, 0) + 1
        output_lens.append(n)
        total_input += int(rec.prompt_len)
        from_usage += rec.usage_prompt_tokens is not None
        if rec.usage_cached_tokens is not None:
            cached = (cached or 0) + rec.usage_cached_tokens
        tpot = tpot_of(rec, n)
        if tpot is not None:
            tpots.append(tpot)
        all_tpots.append(0.0 if tpot is None else tpot)
        itls.extend(rec.itl)
        ttfts.append(rec.ttft)
        e2els.append(rec.latency)
        completed += 1

    goodput = None
    if goodput_slo_ms:
        unknown = set(goodput_slo_ms) - {"ttft", "tpot", "e2el"}
        if unknown:
            raise ValueError(f"goodput SLOs are ttft, tpot, e2el; got {sorted(unknown)}")
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        good = 0
        for i in range(completed):
            if all(slo / 1000.0 >= per_metric[k][i] for k, slo in goodput_slo_ms.items()):
                good += 1
        goodput = good / duration_s

    peak_tok, peak_conc = peak_rates(records)
    total_output = int(sum(output_lens))
    return BenchMetrics(
        completed=completed,
        failed=sum(1 for r in records if not r.success),
        duration_s=float(duration_s),
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / duration_s,
        request_goodput=goodput,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        ttft=latency_stats(ttfts, percentiles),
        tpot=latency_stats(tpots, percentiles),
        itl=latency_stats(itls, percentiles),
        e2el=latency_stats(e2els, percentiles),
        max_output_tokens_per_s=peak_tok,
        max_concurrent_requests=peak_conc,
        output_lens=tuple(output_lens),
        output_count_methods=methods,
        input_from_usage=from_usage,
        cached_prompt_tokens=cached,
    )
