"""Prometheus metrics under vLLM's `vllm:` names (prometheus-client).

Gauges are read from the engine when /metrics is scraped; counters and latency
histograms are recorded as outputs reach the HTTP side (TTFT from arrival to the first
token, inter-token gaps per engine step, end-to-end at finish), as vLLM's frontend does.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's bucket boundaries (seconds)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed (cache hits included)",
                                     labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted (recomputed)", labels, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   labels, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests", labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between engine outputs of a request",
                             labels, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish", labels,
                             buckets=_E2E_BUCKETS, registry=r)
        self.model_name = model_name
        self._last_engine: dict[str, int] = {}

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def observe_finished(self, reason: str, e2e_seconds: float) -> None:
        self.success.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(e2e_seconds)

    def update_from_engine(self, stats: dict[str, Any]) -> None:
        """Gauges from a fresh engine snapshot; counters advance by what changed since."""
        m = self.model_name
        self.running.labels(m).set(stats["num_running"])
        self.waiting.labels(m).set(stats["num_waiting"])
        self.kv_usage.labels(m).set(stats["kv_cache_usage"])
        for key, counter in (("prompt_tokens", self.prompt_tokens), ("generation_tokens", self.generation_tokens),
                             ("num_preemptions", self.preemptions), ("prefix_cache_queries", self.prefix_queries),
                             ("prefix_cache_hits", self.prefix_hits)):
            delta = stats[key] - self._last_engine.get(key, 0)
            if delta > 0:
                counter.labels(m).inc(delta)
            self._last_engine[key] = stats[key]

    def render(self) -> bytes:
        return generate_latest(self.registry)
