"""serving/metrics.py: vLLM's metric names, HELP texts, labels and buckets, and what each
recording method puts in them, read back from the Prometheus text through prometheus_client's
own parser."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vtool.runtime.engine.request import FinishedRequestStats
from vtool.runtime.serving.metrics import STEP_KINDS, ServerMetrics, one_two_five_buckets

SETTINGS = settings(max_examples=80, deadline=None)
LABELS = {"model_name": "m", "engine": "0"}

# vLLM v1's loggers.py: name -> (type, HELP)
VLLM_METRICS = {
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
    "vllm:num_requests_waiting_by_reason": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:prefix_cache_queries": ("counter", "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": ("counter", "Prefix cache hits, in terms of number of cached tokens."),
    "vllm:num_preemptions": ("counter", "Cumulative number of preemption from the engine."),
    "vllm:prompt_tokens": ("counter", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("counter", "Number of generation tokens processed."),
    "vllm:request_success": ("counter", "Count of successfully processed requests."),
    "vllm:prompt_tokens_by_source": ("counter", "Number of prompt tokens by source."),
    "vllm:prompt_tokens_cached": ("counter", "Number of cached prompt tokens (local + external)."),
    "vllm:prompt_tokens_recomputed": ("counter", "Number of cached tokens recomputed for forward pass."),
    "vllm:request_prefill_kv_computed_tokens": (
        "histogram", "Histogram of new KV tokens computed during prefill (excluding cached tokens)."),
    "vllm:request_prompt_tokens": ("histogram", "Number of prefill tokens processed."),
    "vllm:request_generation_tokens": ("histogram", "Number of generation tokens processed."),
    "vllm:iteration_tokens_total": ("histogram", "Histogram of number of tokens per engine_step."),
    "vllm:request_max_num_generation_tokens": ("histogram",
                                               "Histogram of maximum number of requested generation tokens."),
    "vllm:request_params_n": ("histogram", "Histogram of the n request parameter."),
    "vllm:request_params_max_tokens": ("histogram", "Histogram of the max_tokens request parameter."),
    "vllm:time_to_first_token_seconds": ("histogram", "Histogram of time to first token in seconds."),
    "vllm:inter_token_latency_seconds": ("histogram", "Histogram of inter-token latency in seconds."),
    "vllm:request_time_per_output_token_seconds": ("histogram",
                                                   "Histogram of time_per_output_token_seconds per request."),
    "vllm:e2e_request_latency_seconds": ("histogram", "Histogram of e2e request latency in seconds."),
    "vllm:request_queue_time_seconds": ("histogram", "Histogram of time spent in WAITING phase for request."),
    "vllm:request_inference_time_seconds": ("histogram", "Histogram of time spent in RUNNING phase for request."),
    "vllm:request_prefill_time_seconds": ("histogram", "Histogram of time spent in PREFILL phase for request."),
    "vllm:request_decode_time_seconds": ("histogram", "Histogram of time spent in DECODE phase for request."),
}
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
TIMELINE = ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
            "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds")


def scrape(metrics: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def histogram(families: dict, name: str, labels: dict = LABELS) -> tuple[dict[float, float], float, float]:
    """({le: cumulative count}, count, sum) of one histogram series."""
    samples = [s for s in families[name].samples if s.labels.items() >= labels.items()]
    buckets = {float(s.labels["le"]): s.value for s in samples if s.name == f"{name}_bucket"}
    count = next(s.value for s in samples if s.name == f"{name}_count")
    total = next(s.value for s in samples if s.name == f"{name}_sum")
    return buckets, count, total


def value(families: dict, name: str, sample: str | None = None, **labels: str) -> float:
    want = {**LABELS, **labels}
    found = [s.value for s in families[name].samples
             if s.name == (sample or name) and s.labels == want]
    assert len(found) == 1, (name, want, families[name].samples)
    return found[0]


def assert_histogram(families: dict, name: str, observed: list[float]) -> None:
    buckets, count, total = histogram(families, name)
    assert count == len(observed), name
    assert total == pytest.approx(sum(observed), rel=1e-9, abs=1e-9), name
    for le, cumulative in buckets.items():
        assert cumulative == sum(1 for v in observed if v <= le), (name, le)


# ============================================================================ names, HELP, labels, buckets


def test_every_vllm_metric_is_there_from_the_start():
    families = scrape(ServerMetrics("m", max_model_len=100))
    for name, (kind, doc) in VLLM_METRICS.items():
        family = families[name]
        assert family.type == kind, name
        if doc is not None:
            assert family.documentation == doc, name
        assert family.samples, name
        for sample in family.samples:
            assert sample.labels.items() >= LABELS.items(), (name, sample)
    assert "vllm:cache_config_info" not in families  # until set_cache_config
    assert {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
            if s.name == "vllm:request_success_total"} == {"stop": 0, "length": 0, "abort": 0}
    assert {s.labels["reason"]: s.value for s in families["vllm:num_requests_waiting_by_reason"].samples} == {
        "capacity": 0, "deferred": 0}
    assert {s.labels["source"]: s.value for s in families["vllm:prompt_tokens_by_source"].samples
            if s.name == "vllm:prompt_tokens_by_source_total"} == {
        "local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}


def test_bucket_boundaries_are_vllms():
    families = scrape(ServerMetrics("m", max_model_len=100))

    def bounds(name):
        return sorted(histogram(families, name)[0])

    for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:request_max_num_generation_tokens", "vllm:request_params_max_tokens",
                 "vllm:request_prefill_kv_computed_tokens"):
        assert bounds(name) == [1, 2, 5, 10, 20, 50, 100, math.inf]
    assert bounds("vllm:iteration_tokens_total") == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                                     16384, math.inf]
    assert bounds("vllm:request_params_n") == [1, 2, 5, 10, 20, math.inf]
    for name in TIMELINE:
        assert bounds(name) == LATENCY_BUCKETS + [math.inf]
    assert bounds("vllm:time_to_first_token_seconds")[:3] == [0.001, 0.005, 0.01]
    assert bounds("vllm:time_to_first_token_seconds")[-2:] == [2560.0, math.inf]
    assert bounds("vllm:inter_token_latency_seconds") == bounds("vllm:request_time_per_output_token_seconds")


@SETTINGS
@given(st.integers(1, 10**9))
def test_one_two_five_buckets(max_value):
    buckets = one_two_five_buckets(max_value)
    assert buckets[0] == 1 and buckets == sorted(set(buckets)) and buckets[-1] <= max_value
    for b in buckets:
        scale = 10 ** (len(str(b)) - 1)
        assert b in (scale, 2 * scale, 5 * scale)
    # the next 1-2-5 value would be past max_value
    last = buckets[-1]
    scale = 10 ** (len(str(last)) - 1)
    following = {1: 2 * scale, 2: 5 * scale, 5: 10 * scale}[last // scale]
    assert following > max_value


# ============================================================================ finished requests

times = st.floats(0, 10_000, allow_nan=False, allow_infinity=False)
gaps = st.floats(0, 600, allow_nan=False, allow_infinity=False)


@st.composite
def finished_request(draw) -> FinishedRequestStats:
    """A finished request whose times come in the order a real one's do: arrival <= first
    scheduled <= first token <= finished, with the later stages possibly never reached (then
    None; only an abort can end a request there, but the metrics must skip None whatever the
    reason)."""
    arrival = draw(times)
    reached = draw(st.sampled_from(["queued", "scheduled", "token"]))
    scheduled = arrival + draw(gaps) if reached != "queued" else None
    first = scheduled + draw(gaps) if reached == "token" else None
    finished = (first if first is not None else scheduled if scheduled is not None else arrival) + draw(gaps)
    generated = draw(st.integers(1 if first is not None else 0, 5000))
    return FinishedRequestStats(
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])), arrival_time=arrival,
        first_scheduled_time=scheduled, first_token_time=first, finished_time=finished,
        num_prompt_tokens=(prompt := draw(st.integers(0, 5000))), num_generation_tokens=generated,
        max_tokens=draw(st.integers(0, 5000)), n=draw(st.integers(1, 30)), num_preemptions=draw(st.integers(0, 3)),
        num_cached_tokens=draw(st.integers(0, max(0, prompt - 1))))


@SETTINGS
@given(st.lists(finished_request(), max_size=8))
def test_finished_requests_fill_vllms_request_histograms(records):
    metrics = ServerMetrics("m", max_model_len=4096)
    for record in records:
        metrics.observe_finished_request(record)
    families = scrape(metrics)
    kept = [r for r in records if r.finish_reason != "abort"]  # an aborted request records nothing

    def spans(start, end):
        return [getattr(r, end) - getattr(r, start) for r in kept
                if getattr(r, start) is not None and getattr(r, end) is not None]

    assert_histogram(families, "vllm:e2e_request_latency_seconds", spans("arrival_time", "finished_time"))
    assert_histogram(families, "vllm:request_queue_time_seconds", spans("arrival_time", "first_scheduled_time"))
    assert_histogram(families, "vllm:request_prefill_time_seconds", spans("first_scheduled_time", "first_token_time"))
    assert_histogram(families, "vllm:request_decode_time_seconds", spans("first_token_time", "finished_time"))
    assert_histogram(families, "vllm:request_inference_time_seconds",
                     spans("first_scheduled_time", "finished_time"))
    assert_histogram(families, "vllm:request_time_per_output_token_seconds",
                     [(r.finished_time - r.first_token_time) / (r.num_generation_tokens - 1)
                      if r.num_generation_tokens > 1 else 0.0 for r in kept if r.first_token_time is not None])
    assert_histogram(families, "vllm:request_prompt_tokens", [r.num_prompt_tokens for r in kept])
    assert_histogram(families, "vllm:request_prefill_kv_computed_tokens",
                     [r.num_prompt_tokens - r.num_cached_tokens for r in kept])
    assert_histogram(families, "vllm:request_generation_tokens", [r.num_generation_tokens for r in kept])
    assert_histogram(families, "vllm:request_max_num_generation_tokens", [r.num_generation_tokens for r in kept])
    assert_histogram(families, "vllm:request_params_n", [r.n for r in kept])
    assert_histogram(families, "vllm:request_params_max_tokens", [r.max_tokens for r in kept if r.max_tokens])
    for reason in ("stop", "length", "abort"):
        assert value(families, "vllm:request_success", "vllm:request_success_total", finished_reason=reason) == sum(
            1 for r in kept if r.finish_reason == reason)


@SETTINGS
@given(finished_request(), st.floats(1e-9, 1.0, allow_nan=False))
def test_clock_noise_never_makes_an_interval_negative(record, noise):
    """Times from two processes on one host share CLOCK_MONOTONIC, yet a float sum can land a
    hair before its start: such an interval counts as 0, never as a negative latency."""
    if record.finish_reason == "abort" or record.first_token_time is None:
        return
    early = FinishedRequestStats(**{**record.__dict__, "finished_time": record.first_token_time - noise})
    metrics = ServerMetrics("m")
    metrics.observe_finished_request(early)
    families = scrape(metrics)
    buckets, count, total = histogram(families, "vllm:request_decode_time_seconds")
    assert count == 1 and total == 0.0 and buckets[0.3] == 1


def test_observe_finished_request_with_a_plain_record():
    metrics = ServerMetrics("m", max_model_len=256)
    metrics.observe_finished_request(FinishedRequestStats(
        finish_reason="length", arrival_time=100.0, first_scheduled_time=100.25, first_token_time=101.0,
        finished_time=104.0, num_prompt_tokens=7, num_generation_tokens=4, max_tokens=4, n=1))
    families = scrape(metrics)
    assert histogram(families, "vllm:request_queue_time_seconds")[1:] == (1, 0.25)
    assert histogram(families, "vllm:request_prefill_time_seconds")[1:] == (1, 0.75)
    assert histogram(families, "vllm:request_decode_time_seconds")[1:] == (1, 3.0)
    assert histogram(families, "vllm:request_inference_time_seconds")[1:] == (1, 3.75)
    assert histogram(families, "vllm:e2e_request_latency_seconds")[1:] == (1, 4.0)
    assert histogram(families, "vllm:request_time_per_output_token_seconds")[1:] == (1, 1.0)
    buckets, _, _ = histogram(families, "vllm:request_prompt_tokens")
    assert buckets[5.0] == 0 and buckets[10.0] == 1
    assert value(families, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 1


# ============================================================================ steps, cache config, engine stats


@SETTINGS
@given(st.lists(st.integers(0, 40_000), max_size=20))
def test_observe_iteration(steps):
    metrics = ServerMetrics("m")
    for n in steps:
        metrics.observe_iteration(n)
    assert_histogram(scrape(metrics), "vllm:iteration_tokens_total", steps)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(STEP_KINDS), st.floats(0, 10, allow_nan=False)), max_size=30))
def test_observe_step_fills_one_series_per_kind(steps):
    metrics = ServerMetrics("m")
    for kind, seconds in steps:
        metrics.observe_step(kind, seconds)
    families = scrape(metrics)
    for kind in STEP_KINDS:  # every kind's series exists from the start
        buckets, count, total = histogram(families, "vtool:engine_step_seconds", {**LABELS, "kind": kind})
        observed = [t for k, t in steps if k == kind]
        assert count == len(observed) and total == pytest.approx(sum(observed), rel=1e-9, abs=1e-9)
        for le, cumulative in buckets.items():
            assert cumulative == sum(1 for v in observed if v <= le), (kind, le)


def test_cache_config_info_carries_the_cache_config_as_labels():
    metrics = ServerMetrics("m")
    metrics.set_cache_config(block_size=16, num_blocks=1234, enable_prefix_caching=True, cache_dtype="auto",
                             gpu_memory_utilization=0.9)
    family = scrape(metrics)["vllm:cache_config_info"]
    assert family.type == "gauge" and family.documentation == "Information of the LLMEngine CacheConfig"
    assert [(s.labels, s.value) for s in family.samples] == [(
        {"block_size": "16", "num_gpu_blocks": "1234", "enable_prefix_caching": "True", "cache_dtype": "auto",
         "gpu_memory_utilization": "0.9", "engine": "0"}, 1.0)]
    # set again: the new configuration replaces the old one
    metrics.set_cache_config(block_size=32, num_blocks=10, enable_prefix_caching=False)
    family = scrape(metrics)["vllm:cache_config_info"]
    assert [s.labels for s in family.samples] == [{"block_size": "32", "num_gpu_blocks": "10",
                                                   "enable_prefix_caching": "False", "engine": "0"}]


def engine_stats(**changes) -> dict:
    stats = {"num_running": 3, "num_waiting": 2, "kv_cache_usage": 0.5, "num_blocks": 100, "block_size": 16,
             "num_preemptions": 1, "prefix_cache_queries": 40, "prefix_cache_hits": 16, "prompt_tokens": 40,
             "generation_tokens": 9, "computed_prefill_tokens": 24, "steps": 7, "finished": {}}
    return {**stats, **changes}


def test_update_from_engine():
    metrics = ServerMetrics("m")
    metrics.update_from_engine(engine_stats())
    metrics.update_from_engine(engine_stats(prompt_tokens=50, generation_tokens=12, num_running=1, num_waiting=4))
    families = scrape(metrics)
    assert value(families, "vllm:num_requests_running") == 1
    assert value(families, "vllm:num_requests_waiting") == 4
    assert value(families, "vllm:num_requests_waiting_by_reason", reason="capacity") == 4
    assert value(families, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    assert value(families, "vllm:kv_cache_usage_perc") == 0.5
    assert value(families, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 50
    assert value(families, "vllm:generation_tokens", "vllm:generation_tokens_total") == 12
    assert value(families, "vllm:num_preemptions", "vllm:num_preemptions_total") == 1
    assert value(families, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 40
    assert value(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 16
    # prompt tokens by source: counters advance by what changed
    metrics.update_from_engine(engine_stats(prompt_tokens_computed=30, prompt_tokens_cache_hit=17,
                                            prompt_tokens_cached=16, prompt_tokens_recomputed=1))
    metrics.update_from_engine(engine_stats(prompt_tokens_computed=45, prompt_tokens_cache_hit=17,
                                            prompt_tokens_cached=16, prompt_tokens_recomputed=1))
    families = scrape(metrics)
    assert value(families, "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_by_source_total",
                 source="local_compute") == 45
    assert value(families, "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_by_source_total",
                 source="local_cache_hit") == 17
    assert value(families, "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_by_source_total",
                 source="external_kv_transfer") == 0
    assert value(families, "vllm:prompt_tokens_cached", "vllm:prompt_tokens_cached_total") == 16
    assert value(families, "vllm:prompt_tokens_recomputed", "vllm:prompt_tokens_recomputed_total") == 1
    metrics.update_from_engine(engine_stats(num_waiting=5, num_waiting_deferred=2))
    families = scrape(metrics)
    assert value(families, "vllm:num_requests_waiting_by_reason", reason="capacity") == 3
    assert value(families, "vllm:num_requests_waiting_by_reason", reason="deferred") == 2


def test_frontend_latencies_and_the_http_finish_record():
    metrics = ServerMetrics("m")
    metrics.observe_first_token(0.02)
    metrics.observe_inter_tokens([0.03, 0.2])
    metrics.observe_inter_tokens([])
    metrics.observe_finished("stop", 1.2)
    families = scrape(metrics)
    assert_histogram(families, "vllm:time_to_first_token_seconds", [0.02])
    assert_histogram(families, "vllm:inter_token_latency_seconds", [0.03, 0.2])
    assert_histogram(families, "vllm:e2e_request_latency_seconds", [1.2])
    assert value(families, "vllm:request_success", "vllm:request_success_total", finished_reason="stop") == 1


def test_engine_label_and_separate_registries():
    a, b = ServerMetrics("a", engine_index=3), ServerMetrics("b")
    a.observe_iteration(5)
    fa, fb = scrape(a), scrape(b)
    assert histogram(fa, "vllm:iteration_tokens_total", {"model_name": "a", "engine": "3"})[1] == 1
    assert histogram(fb, "vllm:iteration_tokens_total", {"model_name": "b", "engine": "0"})[1] == 0


@SETTINGS
@given(st.lists(st.tuples(st.integers(2, 5), st.data()), max_size=4), st.lists(finished_request(), max_size=4),
       st.randoms(use_true_random=False))
def test_parallel_samples_count_once_with_their_longest_child(parents, alone, rng):
    """The n children of a parallel-sampling request (parent_id set, n the parent's) add one
    observation of n and of the longest child to vllm:request_params_n and
    vllm:request_max_num_generation_tokens once the last finishes, none if any was aborted,
    whatever the order they finish in among other requests; every other series counts each child."""
    import dataclasses

    records = list(alone)
    want_n = [r.n for r in alone if r.finish_reason != "abort"]
    want_longest = [r.num_generation_tokens for r in alone if r.finish_reason != "abort"]
    for p, (n, data) in enumerate(parents):
        children = [dataclasses.replace(data.draw(finished_request()), n=n, parent_id=f"parent-{p}") for _ in range(n)]
        records += children
        if all(c.finish_reason != "abort" for c in children):
            want_n.append(n)
            want_longest.append(max(c.num_generation_tokens for c in children))
    rng.shuffle(records)
    metrics = ServerMetrics("m", max_model_len=4096)
    for record in records:
        metrics.observe_finished_request(record)
    families = scrape(metrics)
    assert_histogram(families, "vllm:request_params_n", want_n)
    assert_histogram(families, "vllm:request_max_num_generation_tokens", want_longest)
    assert_histogram(families, "vllm:request_generation_tokens",
                     [r.num_generation_tokens for r in records if r.finish_reason != "abort"])
    assert not metrics._parents  # every parent settled


# ============================================================================ one pass over many values

values_st = st.lists(st.one_of(st.floats(-1.0, 200.0, allow_nan=False),
                               st.sampled_from([0.0, 0.01, 0.025, 80.0, math.inf, -math.inf, math.nan])), max_size=80)


@SETTINGS
@given(values_st)
def test_observe_many_counts_as_observe_does(values):
    """histogram_batch.observe_many against prometheus-client's own observe, value by value:
    the same bucket counts (a value on a bound counts in that bucket; NaN in none) and sum."""
    from prometheus_client import CollectorRegistry, Histogram

    from vtool.runtime.serving.histogram_batch import batchable, observe_many

    registry = CollectorRegistry()
    one = Histogram("one", "h", ["m"], buckets=(0.01, 0.025, 0.05, 1.0, 80.0), registry=registry).labels("x")
    many = Histogram("many", "h", ["m"], buckets=(0.01, 0.025, 0.05, 1.0, 80.0), registry=registry).labels("x")
    assert batchable(many)  # else this would only test the fallback
    for v in values:
        one.observe(v)
    observe_many(many, values)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}

    def series(name):
        buckets = {s.labels["le"]: s.value for s in families[name].samples if s.name.endswith("_bucket")}
        total = next(s.value for s in families[name].samples if s.name.endswith("_sum"))
        return buckets, total

    (b1, s1), (b2, s2) = series("one"), series("many")
    assert b1 == b2
    assert (math.isnan(s1) and math.isnan(s2)) or s1 == pytest.approx(s2, rel=1e-12, abs=1e-12)
