"""Which running requests carry drafts into the next step, and the drafts themselves.

Before each schedule the engine asks for proposals for the requests that are decoding. The
rule for when speculation pays (engine/spec_config.py): it is off for a step whose running
batch has disable_by_batch_size or more sequences, where the batch already keeps the device
busy; a request never gets more drafts than the tokens it may still generate after the next.
Requests asking for prompt logprobs are still in their prompt and get none.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

from vtool.runtime.engine.ngram_proposer import NgramProposer
from vtool.runtime.engine.request import Request
from vtool.runtime.engine.spec_config import SpeculativeConfig, batch_size_limit

if TYPE_CHECKING:
    from vtool.runtime.engine.engine import Engine


class Proposer(Protocol):
    def propose_batch(self, requests: list[Request], limits: list[int]) -> None:
        """Set each request's draft_ids (and draft_probs) with at most limits[i] drafts."""

    def release(self, request: Request) -> None:
        """The request is done: let go of anything kept for it."""


class NgramBatch:
    def __init__(self, config: SpeculativeConfig):
        self.ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)

    def propose_batch(self, requests: list[Request], limits: list[int]) -> None:
        for request, limit in zip(requests, limits):
            request.draft_ids = self.ngram.propose(request.all_ids, limit)

    def release(self, request: Request) -> None:
        pass


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, engine: Engine):
        self.config, self.proposer, self.engine = config, proposer, engine
        self.num_skipped_steps = 0  # steps the batch-size rule ran without drafts

    @classmethod
    def create(cls, config: SpeculativeConfig, engine: Engine) -> Speculator:
        # the batch-size rule as this device resolves it (spec_config.batch_size_limit)
        config = dataclasses.replace(config, disable_by_batch_size=batch_size_limit(config, engine.model))
        if config.method == "ngram":
            return cls(config, NgramBatch(config), engine)
        from vtool.runtime.engine.draft_proposer import DraftModelProposer

        return cls(config, DraftModelProposer.open(config, engine), engine)

    def propose(self, running: list[Request]) -> None:
        for request in running:
            request.draft_ids, request.draft_probs = [], None
        if not running:
            return
        if len(running) >= self.config.disable_by_batch_size:
            self.num_skipped_steps += 1
            return
        room = self.engine.output_processor.room
        decoding, limits = [], []
        for request in running:
            if request.num_tokens - request.num_computed != 1:
                continue  # in its prompt (or recomputing after preemption)
            limit = min(self.config.num_speculative_tokens, room(request) - 1)
            if limit > 0:
                decoding.append(request)
                limits.append(limit)
        if decoding:
            self.proposer.propose_batch(decoding, limits)

    def release(self, request: Request) -> None:
        self.proposer.release(request)
