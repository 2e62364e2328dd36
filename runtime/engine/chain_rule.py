"""Whether a decode step of one sequence is chained (engine/chained_steps.py): only where the
device, not the host, sets the pace.

Chaining queues step N+1 before step N is collected, so the host's work between two steps (taking
the token, stop checks, scheduling, building and sending outputs) runs while the device computes
instead of in a gap between the steps. That pays when a step takes the device longer than its host
work (a Llama-3-8B shape at one user: a ~6 ms step against ~1.5 ms of host time), and loses when
the host is the bottleneck anyway: a SmolLM2-135M step takes the device ~1.2 ms and the host
~1.3 ms to queue, and the hand-off to the model thread only adds to that (4-10% slower at one
sequence, docs/BENCHMARKS.md "The model thread"). Steps of two or more sequences chain by default
(faster at 2-64 sequences there).

So the engine times the one-sequence decode steps it does not chain: how long the host took to
queue each (its launch) and how long it then waited for the step's tokens (its collection). When
over the last WINDOW such steps the median wait exceeds the median queueing time, the device is
the bottleneck, and from then on one-sequence steps chain too. The decision stays: what makes a
model's step device-bound (its weights, then its context) only grows while it runs.
"""
from __future__ import annotations

import statistics
from collections import deque

WINDOW = 8  # one-sequence steps timed before deciding (a median: a slow first call does not decide)


class OneSequenceChains:
    """The timings of unchained one-sequence decode steps, and the decision they lead to."""

    def __init__(self, window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.window = window
        self._queued: deque[float] = deque(maxlen=window)
        self._waited: deque[float] = deque(maxlen=window)
        self.device_bound = False

    def observe(self, queued_seconds: float, waited_seconds: float) -> bool:
        """One unchained one-sequence step: the host's time to queue it, then its wait for the
        tokens. True exactly when this step decides that one-sequence steps chain from now on."""
        if self.device_bound:
            return False
        self._queued.append(queued_seconds)
        self._waited.append(waited_seconds)
        if len(self._queued) < self.window:
            return False
        self.device_bound = statistics.median(self._waited) > statistics.median(self._queued)
        return self.device_bound

    def medians(self) -> tuple[float, float]:
        """(queueing, waiting) seconds: the medians the decision compares (0 before any step)."""
        if not self._queued:
            return 0.0, 0.0
        return statistics.median(self._queued), statistics.median(self._waited)

    @property
    def observed(self) -> int:
        """How many timings the decision rests on so far (at most the window)."""
        return len(self._queued)
