"""One generation request inside the engine, and what the engine reports about it."""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from vtool.runtime.sampling.host import Logprob, SequenceSampler
from vtool.runtime.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# eq=False: a request is itself, not its fields. The scheduler's `request in self.running`
# would otherwise build and compare tuples of every field, 4 ms a step at 64 requests.
@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never None, never past the context
    sampler: SequenceSampler
    priority: int = 0
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[Any] = dataclasses.field(default_factory=list)
    # vLLM v1's: the sum of the output tokens' logprobs for a request that asked for logprobs,
    # None for one that did not (its sampler computes no logprobs: engine.add_request sets it).
    cumulative_logprob: float | None = None
    prompt_logprobs: list[Any] | None = None
    prompt_logit_chunks: list[Any] = dataclasses.field(default_factory=list)  # until the prompt is through
    num_computed: int = 0  # tokens whose K/V is in the cache
    # Speculative proposals for the next step (set before each schedule; [] for none), and
    # the distributions they were drawn from, [k, V] (None: proposed deterministically).
    draft_ids: list[int] = dataclasses.field(default_factory=list)
    draft_probs: Any = None
    seq_id: int | None = None  # the KV-cache sequence while scheduled
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_preemptions: int = 0
    cached_prompt_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # One of n parallel samples (vLLM's ParentRequest): (the parent's id, its n); None for a
    # request of its own. The metrics observe n and the longest child once, for the parent.
    parent: tuple[str, int] | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, n: int) -> tuple[int, ...]:
        """tuple(all_ids[start:start + n]) without building all_ids (a decode step's one token
        would otherwise copy the whole context)."""
        p = len(self.prompt_ids)
        if start >= p:
            return tuple(self.output_ids[start - p:start - p + n])
        if start + n <= p:
            return tuple(self.prompt_ids[start:start + n])
        return tuple(self.prompt_ids[start:]) + tuple(self.output_ids[:start + n - p])

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def in_prefill(self) -> bool:
        return self.num_tokens - self.num_computed > 1

    def sort_key(self) -> tuple:
        """Scheduling order: lower priority value first (vLLM), then arrival."""
        return (self.priority, self.arrival_time)


@dataclasses.dataclass(frozen=True)
class FinishedRequestStats:
    """One finished request's timeline and sizes, for vLLM's request-level metrics
    (serving/metrics.py). Times are time.monotonic() (CLOCK_MONOTONIC: one clock for every
    process on the host, so an API server and the engine core can compare them)."""

    finish_reason: str  # "stop" | "length" | "abort"
    arrival_time: float
    first_scheduled_time: float | None  # None: never scheduled (aborted while waiting)
    first_token_time: float | None  # None: no token was generated
    finished_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int  # the resolved limit (the request's, or what the context left)
    n: int  # the request's SamplingParams.n (a child of parallel sampling: its parent's n)
    num_preemptions: int = 0
    parent_id: str | None = None  # a child of parallel sampling: its parent's id (Request.parent)
    num_cached_tokens: int = 0  # prompt tokens its prefill took from the prefix cache


@dataclasses.dataclass
class CoreOutput:
    """What one step produced for one request inside the engine core: token ids and their
    logprobs, and a finish the core can see (a stop token, the length limit). Text, stop
    strings and everything else about presentation happen after it, in TextStage, which
    may run in another process (plain fields: msgspec encodes it as it is)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob] | None]  # one per new token when the request asked, else []
    finish_reason: str | None  # "stop" (a stop token) | "length" | None
    stop_reason: int | None  # the stop_token_ids entry that ended it (eos reports None)
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    cumulative_logprob: float | None  # None unless the request asked for logprobs
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # with the first token only
    stop_token: bool = False  # the last new token is a stop token (its text is never shown)


@dataclasses.dataclass
class StepOutput:
    """What one engine step produced for one request (deltas since the last report)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[Any]
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list[Any] | None = None
    cumulative_logprob: float | None = None  # None unless the request asked for logprobs

    def merged(self, later: StepOutput) -> StepOutput:
        """This delta and the next one of the same request as one (a consumer that fell
        behind takes what is waiting in one piece, as vLLM's output collector does)."""
        return StepOutput(
            request_id=self.request_id, new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text, new_logprobs=self.new_logprobs + later.new_logprobs,
            finished=later.finished, finish_reason=later.finish_reason, stop_reason=later.stop_reason,
            num_prompt_tokens=later.num_prompt_tokens, num_output_tokens=later.num_output_tokens,
            num_cached_tokens=later.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            cumulative_logprob=later.cumulative_logprob)
