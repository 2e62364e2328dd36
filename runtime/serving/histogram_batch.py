"""Many observations of one prometheus-client histogram series in one pass.

prometheus-client's Histogram.observe takes a lock for the sum and walks the bucket list in
Python for every value, about 3 us a call. The engine core observes an inter-token latency for
every running sequence on every step, on the step's critical path: 0.2 ms a step at 64
sequences. observe_many gives the same bucket counts and sum with one increment per bucket
touched and one for the sum.

It reads three attributes of the labelled series that prometheus-client has kept stable for
years (`_upper_bounds`, `_buckets`, `_sum`); where they are missing (another version), it falls
back to observe() per value, so the counts are right either way.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from typing import Any


def batchable(series: Any) -> bool:
    """Whether observe_many can update this labelled histogram series in one pass."""
    return all(hasattr(series, name) for name in ("_upper_bounds", "_buckets", "_sum", "_raise_if_not_observable"))


def observe_many(series: Any, values: Sequence[float]) -> None:
    """series.observe(v) for every v in values: each value counts in the first bucket whose upper
    bound is >= it (a NaN in none, as observe() does), and the sum grows by their total."""
    if not values:
        return
    if not batchable(series):
        for v in values:
            series.observe(v)
        return
    series._raise_if_not_observable()
    bounds = series._upper_bounds  # ascending, the last one +Inf
    counts = Counter(bisect_left(bounds, v) for v in values if v == v)  # NaN != NaN: no bucket
    for index, n in counts.items():
        series._buckets[index].inc(n)
    series._sum.inc(sum(values))
