"""engine/chain_rule.py: one-sequence steps chain once the host is seen waiting on the device longer
than it takes to queue a step, judged on medians of a window of steps."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtool.runtime.engine.chain_rule import WINDOW, OneSequenceChains

seconds = st.floats(min_value=0.0, max_value=0.05, allow_nan=False)


@given(st.lists(st.tuples(seconds, seconds), min_size=1, max_size=40), st.integers(1, 12))
@settings(max_examples=200, deadline=None)
def test_the_decision_comes_once_and_stays(timings, window):
    rule = OneSequenceChains(window)
    said = [rule.observe(q, w) for q, w in timings]
    assert sum(said) <= 1 and said.count(True) == int(rule.device_bound)
    if rule.device_bound:
        assert said.index(True) >= window - 1  # never before a full window
    assert rule.observed == min(len(timings), window) or rule.device_bound


@given(st.lists(st.tuples(seconds, seconds), min_size=WINDOW, max_size=30))
@settings(max_examples=200, deadline=None)
def test_a_host_that_never_waits_longer_than_it_queues_never_chains(timings):
    rule = OneSequenceChains()
    for queued, waited in timings:
        rule.observe(queued, min(waited, queued))
    assert not rule.device_bound


@given(st.lists(st.tuples(seconds, st.floats(1e-6, 0.01)), min_size=WINDOW, max_size=30))
@settings(max_examples=200, deadline=None)
def test_a_host_always_waiting_longer_decides_at_the_window(timings):
    rule = OneSequenceChains()
    said = [rule.observe(q, q + extra) for q, extra in timings]
    assert said.index(True) == WINDOW - 1


def test_a_few_slow_steps_do_not_decide():
    """A window of host-bound steps (the first calls of a fresh library can be slow on the device)
    with three outliers: the medians still say host-bound."""
    rule = OneSequenceChains()
    steps = [(1.3e-3, 0.1e-3)] * (WINDOW - 3) + [(1.3e-3, 40e-3)] * 3
    assert not any(rule.observe(q, w) for q, w in steps)
    assert not rule.device_bound


def test_the_measured_shapes_are_told_apart():
    """Figures of docs/BENCHMARKS.md (an H100): SmolLM2's ~1.3 ms of queueing for a ~1.2 ms step
    leaves no wait; the 8B's ~1.5 ms for a ~6 ms step leaves ~4 ms."""
    small, large = OneSequenceChains(), OneSequenceChains()
    for _ in range(WINDOW):
        small.observe(1.31e-3, 0.02e-3)
        large.observe(1.5e-3, 4.2e-3)
    assert not small.device_bound and large.device_bound
    assert large.medians() == (1.5e-3, 4.2e-3) and OneSequenceChains().medians() == (0.0, 0.0)


def test_a_window_below_one_is_refused():
    with pytest.raises(ValueError, match="window must be at least 1"):
        OneSequenceChains(0)
