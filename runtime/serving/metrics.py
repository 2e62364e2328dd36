"""Prometheus metrics under vLLM's `vllm:` names (prometheus-client).

Names, HELP texts, label names and bucket boundaries are vLLM v1's (vllm/v1/metrics/loggers.py):
every series carries model_name and engine (the engine core's index, "0" here), as vLLM's do.

Where each kind comes from:
- gauges and the token/preemption/prefix-cache counters: update_from_engine(Engine.stats()),
  called when /metrics is scraped; counters advance by what changed since the last call.
- per-step: observe_iteration(num_tokens) once per engine step (vllm:iteration_tokens_total),
  and observe_step(kind, seconds) (vtool's own vtool:engine_step_seconds{kind}: where a
  server's time goes between decode steps and steps that admit prompts).
- per finished request: observe_finished_request(FinishedRequestStats), from the engine core:
  request_success, e2e latency and vLLM's request-level histograms (queue, prefill, decode,
  inference time; prompt and generation tokens; n, max_tokens).
- latencies seen as outputs arrive: observe_first_token / observe_inter_tokens (a step's
  inter-token latencies at once: histogram_batch.observe_many).
- set_cache_config(...): vllm:cache_config_info, the cache configuration as labels.

The object lives where the engine core runs, so that one scrape sees every request whichever
API server took it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vtool.runtime.engine.request import FinishedRequestStats
from vtool.runtime.serving.histogram_batch import observe_many

# vLLM's bucket boundaries (seconds)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
# vtool's own: engine step durations, from a sub-millisecond decode step of a small model to
# a prefill wave of a large one
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25,
                 0.5, 1.0, 2.5, 5.0)
STEP_KINDS = ("decode", "mixed", "prefill")  # SchedulerOutput.kind

# vLLM's finish reasons: every one has its request_success series from the start (at 0)
FINISH_REASONS = ("stop", "length", "abort")
# vLLM's waiting reasons. This scheduler holds a request back only for capacity (KV blocks,
# max_num_seqs, the token budget); "deferred" (LoRA budget, KV transfer) stays 0 unless the
# engine reports num_waiting_deferred.
WAITING_REASONS = ("capacity", "deferred")
# vLLM's prompt token sources; external_kv_transfer (a KV connector) stays 0 here
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

DEFAULT_MAX_MODEL_LEN = 4096  # for the token-count buckets when the caller does not say


def one_two_five_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(value)
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int | None = None, engine_index: int = 0):
        """max_model_len sets the token-count histograms' largest bucket (as vLLM's buckets
        go up to the context length); engine_index is the `engine` label."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.engine = str(engine_index)
        # parallel sampling's parents still waiting for children: id -> [children left, the
        # longest child's generated tokens, whether a child was aborted]
        self._parents: dict[str, list] = {}
        r = self.registry
        labels = ["model_name", "engine"]
        token_buckets = one_two_five_buckets(max_model_len or DEFAULT_MAX_MODEL_LEN)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels + list(extra), registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: Any, extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, labels + list(extra), buckets=buckets, registry=r)

        # scheduler state
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.waiting_by_reason = gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. 'capacity': waiting for scheduling capacity; 'deferred': "
            "held back by a transient constraint. The reasons sum to vllm:num_requests_waiting.", ("reason",))
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        # counters
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        # each prompt by where its KV came from, counted when its prefill ends (vLLM's PromptTokenStats)
        self.prompt_tokens_by_source = counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                               ("source",))
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Number of cached prompt tokens (local + external).")
        self.prompt_tokens_recomputed = counter("vllm:prompt_tokens_recomputed",
                                                "Number of cached tokens recomputed for forward pass.")
        self.success = counter("vllm:request_success", "Count of successfully processed requests.",
                               ("finished_reason",))
        # vtool's own: where the engine core's host time goes, per part of a step (rates between
        # two scrapes give the profile of a running server; a GPU's "sample" includes the wait
        # for the step's kernels).
        # Speculative decoding (vLLM's SpecDecodingProm names; zero without --speculative-config).
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.spec_accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted tokens per draft position.", ("position",))
        self.spec_own_cache_rounds = counter(
            "vtool:spec_decode_own_cache_rounds",
            "Speculation rounds of a greedy request alone with both models on their own caches "
            "(engine/lone_chain.py); they also count in vllm:spec_decode_* and vtool:engine_steps.")
        self.lone_decode_rounds = counter(
            "vtool:lone_decode_rounds",
            "Rounds of several decode steps a greedy request alone ran on the library's own cache "
            "(engine/lone_decode.py); each also counts as one vtool:engine_steps.")
        self.engine_steps = counter("vtool:engine_steps", "Engine steps run.")
        self.step_seconds = histogram(
            "vtool:engine_step_seconds",
            "Seconds per engine step on the critical path (launch, or the previous step's tokens when queued "
            "behind it, to this step's tokens), by kind: decode (every sequence decodes), mixed (prompt chunks "
            "beside decoding sequences), prefill (prompt chunks only).", _STEP_BUCKETS, ("kind",))
        self.engine_phase_seconds = counter(
            "vtool:engine_step_phase_seconds",
            "Host seconds the engine core spent per part of its steps: schedule, forward (model launch), "
            "sample (incl. the wait for the device), outputs (stop checks, output records, metrics), io "
            "(receiving requests, sending outputs).", ("phase",))
        # histograms of counts
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", _ITERATION_TOKENS_BUCKETS)
        self.request_max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            token_buckets)
        self.request_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS)
        self.prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", token_buckets)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens",
                                            "Histogram of the max_tokens request parameter.", token_buckets)
        # histograms of time
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", _REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        _REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", _REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", _REQUEST_LATENCY_BUCKETS)
        self.cache_config: Gauge | None = None

        # every series exists from the start, as vLLM's do (a scrape before the first request
        # sees zeros, not missing names)
        m, e = self.model_name, self.engine
        for metric in (self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits,
                       self.preemptions, self.prompt_tokens, self.generation_tokens, self.prompt_tokens_cached,
                       self.prompt_tokens_recomputed, self.prefill_kv_computed, self.request_prompt_tokens,
                       self.request_generation_tokens, self.iteration_tokens, self.request_max_generation_tokens,
                       self.request_n, self.request_max_tokens, self.ttft, self.itl, self.tpot, self.e2e,
                       self.queue_time, self.inference_time, self.prefill_time, self.decode_time):
            metric.labels(m, e)
        for reason in FINISH_REASONS:
            self.success.labels(m, e, reason)
        for source in PROMPT_TOKEN_SOURCES:
            self.prompt_tokens_by_source.labels(m, e, source)
        # made once: observe_step runs on every engine step
        self._step_series = {kind: self.step_seconds.labels(m, e, kind) for kind in STEP_KINDS}
        # the per-token series, looked up once: labels() takes a lock and a dict lookup per call,
        # and these are observed for every token of every running request
        self._ttft, self._itl, self._iteration = (self.ttft.labels(m, e), self.itl.labels(m, e),
                                                  self.iteration_tokens.labels(m, e))
        for reason in WAITING_REASONS:
            self.waiting_by_reason.labels(m, e, reason)
        self._last_engine: dict[str, int] = {}

    def _of(self, metric: Any) -> Any:
        return metric.labels(self.model_name, self.engine)

    # -- latencies seen as outputs arrive ----------------------------------------------------
    def observe_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_inter_tokens(self, seconds: Sequence[float]) -> None:
        """One step's inter-token latencies, one per sequence that took a token."""
        observe_many(self._itl, seconds)

    def observe_finished(self, reason: str, e2e_seconds: float) -> None:
        """The HTTP side's record of a finish (success and e2e only). A request recorded by
        observe_finished_request must not be recorded here too."""
        self.success.labels(self.model_name, self.engine, reason).inc()
        self._of(self.e2e).observe(e2e_seconds)

    # -- the engine core ---------------------------------------------------------------------
    def observe_iteration(self, num_tokens: int) -> None:
        """One engine step. vLLM counts, per step, the tokens generated plus the whole prompt of
        each request whose first token came in that step."""
        self._iteration.observe(num_tokens)

    def observe_step(self, kind: str, seconds: float) -> None:
        """One engine step's duration by kind (SchedulerOutput.kind)."""
        self._step_series[kind].observe(seconds)

    def observe_finished_request(self, stats: FinishedRequestStats) -> None:
        """One finished request (one engine request: each of n choices is one). An aborted
        request records nothing, as vLLM records nothing for a request its client aborted.

        The intervals, as vLLM's: queue = first scheduled - arrival; prefill = first token -
        first scheduled; decode = finished - first token; inference = finished - first
        scheduled; e2e = finished - arrival; time per output token = decode / (generated - 1)
        (0 for a single token). An interval whose ends are not both known (a request never
        scheduled, or without a token) is not observed. Clock noise between processes never
        makes one negative: it is clamped at 0.

        vllm:request_params_n and vllm:request_max_num_generation_tokens are observed once per
        request as the client sent it, as vLLM's ParentRequest does: a request of its own with its
        n and generated tokens; the n children of parallel sampling (stats.parent_id set, stats.n
        the parent's n) once the last of them finishes, with n and the longest child's count, and
        not at all when one of them was aborted."""
        self._observe_parent(stats)
        if stats.finish_reason == "abort":
            return
        m, e = self.model_name, self.engine
        self.success.labels(m, e, stats.finish_reason).inc()

        def span(start: float | None, end: float | None) -> float | None:
            return None if start is None or end is None else max(0.0, end - start)

        scheduled, first, finished = stats.first_scheduled_time, stats.first_token_time, stats.finished_time
        for histogram, seconds in ((self.e2e, span(stats.arrival_time, finished)),
                                   (self.queue_time, span(stats.arrival_time, scheduled)),
                                   (self.prefill_time, span(scheduled, first)),
                                   (self.decode_time, span(first, finished)),
                                   (self.inference_time, span(scheduled, finished))):
            if seconds is not None:
                histogram.labels(m, e).observe(seconds)
        decode = span(first, finished)
        if decode is not None:
            generated_after_first = stats.num_generation_tokens - 1
            self._of(self.tpot).observe(decode / generated_after_first if generated_after_first > 0 else 0.0)
        self._of(self.request_prompt_tokens).observe(stats.num_prompt_tokens)
        self._of(self.prefill_kv_computed).observe(max(0, stats.num_prompt_tokens - stats.num_cached_tokens))
        self._of(self.request_generation_tokens).observe(stats.num_generation_tokens)
        if stats.max_tokens:  # vLLM observes a set max_tokens only
            self._of(self.request_max_tokens).observe(stats.max_tokens)
        if stats.parent_id is None:
            self._of(self.request_n).observe(stats.n)
            self._of(self.request_max_generation_tokens).observe(stats.num_generation_tokens)

    def _observe_parent(self, stats: FinishedRequestStats) -> None:
        """One child of parallel sampling finished: once all n have, the parent's n and longest
        child (nothing if any child was aborted)."""
        if stats.parent_id is None:
            return
        left, longest, aborted = self._parents.pop(stats.parent_id, [stats.n, 0, False])
        left, longest = left - 1, max(longest, stats.num_generation_tokens)
        aborted = aborted or stats.finish_reason == "abort"
        if left > 0:
            self._parents[stats.parent_id] = [left, longest, aborted]
        elif not aborted:
            self._of(self.request_n).observe(stats.n)
            self._of(self.request_max_generation_tokens).observe(longest)

    def set_cache_config(self, block_size: int, num_blocks: int, enable_prefix_caching: bool, **extra: Any) -> None:
        """vllm:cache_config_info: a gauge at 1 whose labels are the cache configuration, each
        value as str() writes it ("True", "16"), as vLLM's CacheConfig.metrics_info does, plus
        engine (no model_name, as in vLLM). num_blocks is vLLM's num_gpu_blocks. Calling it
        again replaces the previous configuration."""
        info = {"block_size": block_size, "num_gpu_blocks": num_blocks,
                "enable_prefix_caching": enable_prefix_caching, **extra, "engine": self.engine}
        if self.cache_config is not None:
            self.registry.unregister(self.cache_config)
        self.cache_config = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                  list(info), registry=self.registry)
        self.cache_config.labels(**{k: str(v) for k, v in info.items()}).set(1)

    def update_from_engine(self, stats: dict[str, Any]) -> None:
        """Gauges from a fresh engine snapshot; counters advance by what changed since."""
        m, e = self.model_name, self.engine
        self.running.labels(m, e).set(stats["num_running"])
        self.waiting.labels(m, e).set(stats["num_waiting"])
        deferred = stats.get("num_waiting_deferred", 0)
        self.waiting_by_reason.labels(m, e, "capacity").set(stats["num_waiting"] - deferred)
        self.waiting_by_reason.labels(m, e, "deferred").set(deferred)
        self.kv_usage.labels(m, e).set(stats["kv_cache_usage"])
        for key, counter in (("prompt_tokens", self.prompt_tokens), ("generation_tokens", self.generation_tokens),
                             ("num_preemptions", self.preemptions), ("prefix_cache_queries", self.prefix_queries),
                             ("prefix_cache_hits", self.prefix_hits)):
            delta = stats[key] - self._last_engine.get(key, 0)
            if delta > 0:
                counter.labels(m, e).inc(delta)
            self._last_engine[key] = stats[key]
        for pos, count in enumerate(stats.get("spec_accepted_per_pos", ())):
            key = f"spec_accepted_pos_{pos}"
            delta = count - self._last_engine.get(key, 0)
            if delta > 0:
                self.spec_accepted_per_pos.labels(m, e, str(pos)).inc(delta)
            self._last_engine[key] = count
        for key, counter, labels in (("steps", self.engine_steps, ()), ("spec_num_drafts", self.spec_drafts, ()),
                                     ("spec_num_draft_tokens", self.spec_draft_tokens, ()),
                                     ("spec_num_accepted_tokens", self.spec_accepted_tokens, ()),
                                     ("lone_chain_rounds", self.spec_own_cache_rounds, ()),
                                     ("lone_decode_rounds", self.lone_decode_rounds, ()),
                                     ("prompt_tokens_computed", self.prompt_tokens_by_source, ("local_compute",)),
                                     ("prompt_tokens_cache_hit", self.prompt_tokens_by_source, ("local_cache_hit",)),
                                     ("prompt_tokens_cached", self.prompt_tokens_cached, ()),
                                     ("prompt_tokens_recomputed", self.prompt_tokens_recomputed, ()),
                                     *((f"{p}_seconds", self.engine_phase_seconds, (p,))
                                       for p in ("schedule", "forward", "sample", "output", "io"))):
            if key not in stats:
                continue
            delta = stats[key] - self._last_engine.get(key, 0)
            if delta > 0:
                counter.labels(m, e, *labels).inc(delta)
            self._last_engine[key] = stats[key]

    def render(self) -> bytes:
        return generate_latest(self.registry)
