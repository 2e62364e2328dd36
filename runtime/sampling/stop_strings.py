"""Incremental stop-string handling for streamed text.

Text that could still turn into a stop string is held back until it either completes one
(the stream stops there) or can no longer match (it is released). The concatenation of
everything emitted is therefore the same however the text was split into deltas:

    the full text cut at the stop string that completes first (the smallest end index;
    of several ending there, the longest), before it, or after it with
    include_stop_str_in_output.

This is vLLM's final text: vLLM checks stop strings after every detokenized token and
stops at the first that appears. (vLLM, given several stop strings completing inside one
multi-character delta, takes the first in list order; we take the first in the text.)
"""
from __future__ import annotations

from collections.abc import Sequence

from vtool import VtoolError


def find_stop(text: str, stop: Sequence[str]) -> tuple[int, int, str] | None:
    """(start, end, stop string) of the first stop string to complete in `text`, or None."""
    best: tuple[int, int, str] | None = None
    for s in stop:
        start = text.find(s)
        if start < 0:
            continue
        end = start + len(s)
        if best is None or (end, start) < (best[1], best[0]):
            best = (start, end, s)
    return best


class StopStringMatcher:
    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        if isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise VtoolError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.stop = list(dict.fromkeys(stop))
        self.include = include_stop_str_in_output
        self._pending = ""  # received, not yet emitted: a possible start of a stop string
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream (vLLM's stop_reason)

    def push(self, delta_text: str) -> tuple[str, bool]:
        """Feed newly decoded text; returns (text safe to emit now, whether a stop string matched)."""
        if self.stopped:
            return "", True  # nothing after a stop string is ever emitted
        if not self.stop:
            return delta_text, False
        buf = self._pending + delta_text
        # Every earlier position was released because no stop string could start there,
        # so a match lies wholly inside buf.
        hit = find_stop(buf, self.stop)
        if hit is not None:
            start, end, s = hit
            self.stopped, self.matched, self._pending = True, s, ""
            return buf[: end if self.include else start], True
        hold = self._held_suffix(buf)
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """End of stream without a stop string: release what was held back."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out

    def _held_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        return hold
