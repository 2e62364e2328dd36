"""The metrics of `vllm bench serve`, computed from per-request records.

Pure functions, no I/O. The definitions follow vLLM's `calculate_metrics`
(`vllm/benchmarks/serve.py`) as written down in shared/notes/serving-metrics.md:

* only successful requests enter the latency lists; a failed one adds 0 output tokens;
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
    prompt_len: int = 0
    output_tokens: int = 0          # usage.completion_tokens; 0 when the server sent no usage
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""
    generated_text: str = ""


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


def request_output_len(rec: RequestRecord, count_tokens: Callable[[str], int] | None = None) -> int:
    """usage.completion_tokens; without it the generated text re-tokenized (no special tokens),
    and with no tokenizer 1, as vLLM does."""
    if rec.output_tokens:
        return int(rec.output_tokens)
    if count_tokens is None:
        return 1
    return int(count_tokens(rec.generated_text))


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
) -> BenchMetrics:
    """vLLM's calculate_metrics. `goodput_slo_ms` maps any of ttft/tpot/e2el to an SLO in ms; a
    successful request is good when every given SLO >= its value (TPOT 0 for output_len <= 1)."""
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
    for rec in records:
        if not rec.success:
            output_lens.append(0)
            continue
        n = request_output_len(rec, count_tokens)
        output_lens.append(n)
        total_input += int(rec.prompt_len)
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
    )
