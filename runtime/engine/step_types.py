"""The named types one engine step passes between its rooms, as vLLM v1's SchedulerOutput
and ModelRunnerOutput: the scheduler decides, the model runner computes, output processing
turns results into per-request deltas. None of them holds another's state.

A scheduled sequence may carry several tokens (a prefill chunk today; speculative drafts
or tokens forced by a grammar later) and asks for logits at as many trailing positions as
it needs; per-request logits processors (e.g. grammar masks) travel with it to the sampler.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vtool.runtime.sampling.host import SampleResult, SequenceSampler
    from vtool.runtime.sampling.logits_processors import LogitsProcessor


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step."""

    request_id: str
    seq_id: int  # the KV-cache sequence
    token_ids: tuple[int, ...]  # the tokens whose K/V this step computes, in order
    num_computed: int  # tokens already in the KV cache before this step
    # Logits wanted at the last `num_logit_rows` of token_ids (0: none, e.g. a middle prefill
    # chunk; len(token_ids): every position, e.g. for prompt logprobs).
    num_logit_rows: int
    sample: bool  # draw the next token from the last row (the sequence is complete after this step)
    return_logits: bool = False  # hand the wanted rows back to the host (prompt logprobs, verification)
    sampler: "SequenceSampler | None" = None  # the request's sampling state when `sample`
    logits_processors: tuple["LogitsProcessor", ...] = ()
    # Speculative tokens: the trailing len(draft_ids) of token_ids are proposals the step
    # verifies (logits at every position from the last committed token on).
    draft_ids: tuple[int, ...] = ()
    # The distribution each draft was drawn from, [k, V] (None: proposed deterministically).
    draft_probs: "np.ndarray | None" = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"request {self.request_id}: a scheduled sequence needs at least one token")
        if not 0 <= self.num_logit_rows <= len(self.token_ids):
            raise ValueError(f"request {self.request_id}: num_logit_rows {self.num_logit_rows} is outside "
                             f"0..{len(self.token_ids)}")
        if self.sample and (self.num_logit_rows == 0 or self.sampler is None):
            raise ValueError(f"request {self.request_id}: sampling needs the last row's logits and a sampler")
        if self.draft_ids and (not self.sample or self.num_logit_rows != len(self.draft_ids) + 1
                               or tuple(self.token_ids[-len(self.draft_ids):]) != tuple(self.draft_ids)):
            raise ValueError(f"request {self.request_id}: drafts are verified from the logits of the last "
                             f"{len(self.draft_ids) + 1} tokens, which must end with the drafts")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def decode_row(cls, request_id: str, seq_id: int, token_id: int, num_computed: int,
                   sampler: "SequenceSampler") -> "ScheduledSequence":
        """A plain one-token row that samples (a chained step has one per sequence, every step,
        on the critical path before its model call): the fields __init__ would set, without its
        frozen per-field setattr (64 rows: 115 -> ~30 us on a Zen 4 core). Such a row passes
        every __post_init__ check by construction (test_chained_steps.py holds it equal to
        __init__'s)."""
        row = object.__new__(cls)
        row.__dict__.update(request_id=request_id, seq_id=seq_id, token_ids=(token_id,), num_computed=num_computed,
                            num_logit_rows=1, sample=True, return_logits=False, sampler=sampler,
                            logits_processors=(), draft_ids=(), draft_probs=None)
        return row


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """What runs in one step: the sequences in batch order, and who was preempted to make room."""

    sequences: tuple[ScheduledSequence, ...]
    preempted_request_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences

    @property
    def all_decode(self) -> bool:
        """Every sequence computes exactly one token (the decode entry points serve it)."""
        return all(s.num_tokens == 1 for s in self.sequences)

    @property
    def kind(self) -> str:
        """"decode" (every sequence decodes one token or verifies drafts), "prefill" (prompt
        chunks only) or "mixed" (prompt chunks beside decoding sequences): steps of one kind
        cost alike, so the server times them apart (vtool:engine_step_seconds)."""
        prompts = sum(1 for s in self.sequences if s.num_computed == 0 or s.num_tokens > 1 + len(s.draft_ids))
        return "decode" if prompts == 0 else "prefill" if prompts == len(self.sequences) else "mixed"


@dataclasses.dataclass
class SequenceResult:
    """The runner's result for one scheduled sequence."""

    request_id: str
    sampled: "SampleResult | None" = None  # the drawn token when the sequence asked to sample
    logits: np.ndarray | None = None  # [num_logit_rows, vocab] float32 on the host, when return_logits
    # Speculation: the tokens taken after `sampled` (kept drafts, then the target's own
    # token), and how many of all taken tokens are accepted drafts.
    more: list["SampleResult"] = dataclasses.field(default_factory=list)
    num_accepted: int = 0


@dataclasses.dataclass
class ModelRunnerOutput:
    """What the runner hands back, one entry per scheduled sequence, in the same order."""

    results: list[SequenceResult]

    def by_request(self) -> dict[str, SequenceResult]:
        return {r.request_id: r for r in self.results}
