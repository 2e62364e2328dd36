"""RequestStream: what a consumer reads equals what the engine sent, however the deltas
were coalesced while the consumer was behind (hypothesis over arrival patterns)."""
from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from vtool.runtime.engine.async_engine import EngineDeadError, RequestStream
from vtool.runtime.engine.request import StepOutput


class _Aborts:
    def __init__(self):
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _delta(i: int, n: int, reason: str = "length") -> StepOutput:
    last = i == n - 1
    return StepOutput(request_id="r", new_token_ids=[i], new_text=f"<{i}>", new_logprobs=[{i: i}],
                      finished=last, finish_reason=reason if last else None, stop_reason=None,
                      num_prompt_tokens=3, num_output_tokens=i + 1, num_cached_tokens=0,
                      prompt_logprobs=[None, {1: -1.0}] if i == 0 else None, cumulative_logprob=-float(i))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 40), bursts=st.lists(st.integers(1, 8), min_size=1, max_size=40))
def test_coalesced_deltas_add_up_to_what_was_sent(n, bursts):
    async def main() -> list[StepOutput]:
        q: asyncio.Queue = asyncio.Queue()
        stream = RequestStream(_Aborts(), "r", q, 0.0)
        got: list[StepOutput] = []
        sent, b = 0, 0
        iterator = stream.__aiter__()
        while sent < n or not stream.finished:
            for _ in range(bursts[b % len(bursts)]):  # the engine gets ahead by a burst
                if sent < n:
                    q.put_nowait(_delta(sent, n))
                    sent += 1
            b += 1
            if not stream.finished:
                got.append(await iterator.__anext__())
        return got

    got = asyncio.run(main())
    assert [t for g in got for t in g.new_token_ids] == list(range(n))
    assert "".join(g.new_text for g in got) == "".join(f"<{i}>" for i in range(n))
    assert [lp for g in got for lp in g.new_logprobs] == [{i: i} for i in range(n)]
    assert [g.finished for g in got] == [False] * (len(got) - 1) + [True]
    assert got[-1].finish_reason == "length" and got[-1].num_output_tokens == n
    assert got[0].prompt_logprobs == [None, {1: -1.0}]
    assert len(got) <= n
    if n >= 2 and bursts[0] >= 2:
        assert len(got) < n  # what waited was taken in one piece


def test_an_engine_failure_after_queued_tokens_still_raises():
    async def main() -> None:
        q: asyncio.Queue = asyncio.Queue()
        stream = RequestStream(_Aborts(), "r", q, 0.0)
        q.put_nowait(_delta(0, 5))
        q.put_nowait(EngineDeadError("gone"))
        async for _ in stream:
            pass

    try:
        asyncio.run(main())
    except EngineDeadError as err:
        assert "gone" in str(err)
    else:
        raise AssertionError("the failure was swallowed")
