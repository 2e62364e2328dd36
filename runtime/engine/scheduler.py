"""Which requests run in the next step, and how many of their tokens: a SchedulerOutput.

vLLM v1's shape: one token budget per step (max_num_batched_tokens) shared by decodes
and prefill chunks; running requests first, then waiting ones while the budget, the
sequence limit and the KV blocks last. When blocks run out, prefix-cache entries are
evicted first, then the lowest-priority running request is preempted: its sequence is
handed to the prefix cache (or dropped) and it goes back to the queue to be recomputed,
so nothing is ever corrupted and no request fails for lack of memory.
"""
from __future__ import annotations

import dataclasses
import itertools

from vtool.runtime.engine.kv_cache import PagedKVCache
from vtool.runtime.engine.prefix_cache import PrefixCache
from vtool.runtime.engine.request import Request, Status
from vtool.runtime.engine.step_types import ScheduledSequence, SchedulerOutput

POLICIES = ("fcfs", "priority")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str = "fcfs"
    # the most tokens of one sequence in a step (a sliding window: kv_cache.sliding_window); 0: no limit
    max_chunk: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: PagedKVCache, prefix_cache: PrefixCache | None):
        self.config = config
        self.kv = kv
        self.prefix_cache = prefix_cache
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._seq_ids = itertools.count()
        self._reserved = 0  # blocks promised to items already scheduled in this step
        self.num_preemptions = 0

    # -- queue management -----------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)
        self._order(self.waiting)

    def _order(self, queue: list[Request]) -> None:
        if self.config.policy == "priority":
            queue.sort(key=Request.sort_key)

    def release(self, request: Request, keep_cached: bool = True) -> None:
        """Take a finished or aborted request off the queues and let go of its sequence."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._drop_sequence(request, keep_cached)

    def detach(self, request: Request) -> None:
        """Hand a request to a way of running outside the paged cache (engine/lone_chain.py): off
        the queues, its sequence to the prefix cache, nothing of it computed here any more."""
        self.release(request)
        request.num_computed = 0
        request.status = Status.RUNNING

    def requeue(self, request: Request) -> None:
        """Take a detached request back: first in the queue, as a preempted one, so the next
        step recomputes its tokens (from the prefix cache where it still holds them)."""
        request.status = Status.WAITING
        self.waiting.insert(0, request)
        self._order(self.waiting)

    def _drop_sequence(self, request: Request, keep_cached: bool) -> None:
        if request.seq_id is None:
            return
        if keep_cached and self.prefix_cache is not None and request.num_computed > 0:
            # Its K/V stays for later prompts sharing the prefix; evicted only under pressure.
            self.prefix_cache.insert(request.seq_id, request.all_ids[: request.num_computed])
        else:
            self.kv.remove(request.seq_id)
        request.seq_id = None

    # -- block budget -----------------------------------------------------------------
    def _ensure_free(self, blocks: int, keep: int | None = None) -> bool:
        """Evict prefix-cache entries (never `keep`) until `blocks` are free; False if even
        that is not enough."""
        while self.kv.blocks.num_free_blocks - self._reserved < blocks:
            victim = self.prefix_cache.pop_lru(exclude=keep) if self.prefix_cache is not None else None
            if victim is None:
                return False
            self.kv.remove(victim)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._drop_sequence(request, keep_cached=True)
        request.num_computed = 0
        request.num_preemptions += 1
        request.status = Status.WAITING
        self.num_preemptions += 1
        self.waiting.insert(0, request)
        self._order(self.waiting)

    # -- the step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        items: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        scheduled: set[int] = set()
        self._reserved = 0
        self._order(self.running)

        blocks = self.kv.blocks
        for request in list(self.running):
            if budget == 0:
                break
            if preempted and request not in self.running:  # preempted below as someone's victim
                continue
            n = self._chunk(request, budget)
            if n == 1 and request.draft_ids:
                # Verify the drafts too when the budget and the free blocks allow (never
                # preempting anyone for them); else the request decodes one token.
                n = 1 + min(len(request.draft_ids), budget - 1, (self.config.max_chunk or budget) - 1)
                if n > 1 and not self._ensure_free(self.kv.blocks.blocks_needed(request.seq_id, n)):
                    n = 1
            need = blocks.blocks_needed(request.seq_id, n)  # preempting others leaves it as it is
            while not self._ensure_free(need):
                victim = self._lowest_priority_unscheduled(scheduled)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if not preempted or request in self.running:
                items.append((request, n))
                scheduled.add(id(request))
                self._reserved += need
                budget -= n

        if not preempted:  # as vLLM: no new admissions in a step that had to preempt
            self._admit(items, budget)
        return SchedulerOutput(tuple([self._scheduled(request, n) for request, n in items]),
                               tuple([r.request_id for r in preempted]))

    @staticmethod
    def _scheduled(request: Request, n: int) -> ScheduledSequence:
        """The request's share of this step, as the model runner sees it."""
        start = request.num_computed
        if start + 1 == request.num_tokens and n > 1:  # its last token and n - 1 drafts
            drafts = tuple(request.draft_ids[: n - 1])
            probs = request.draft_probs[: n - 1] if request.draft_probs is not None else None
            return ScheduledSequence(
                request_id=request.request_id, seq_id=request.seq_id,
                token_ids=(request.output_ids[-1] if request.output_ids else request.prompt_ids[-1], *drafts),
                num_computed=start, num_logit_rows=n, sample=True, sampler=request.sampler,
                logits_processors=request.sampler.logits_processors, draft_ids=drafts, draft_probs=probs)
        completes = start + n == request.num_tokens
        # prompt_logprobs needs the logits at every prompt position it computes.
        wants_prompt = request.params.prompt_logprobs is not None and request.prompt_logprobs is None
        return ScheduledSequence(
            request_id=request.request_id, seq_id=request.seq_id, token_ids=request.token_slice(start, n),
            num_computed=start, num_logit_rows=n if wants_prompt else int(completes), sample=completes,
            sampler=request.sampler if completes else None, return_logits=wants_prompt,
            logits_processors=request.sampler.logits_processors)

    def _lowest_priority_unscheduled(self, scheduled: set[int]) -> Request:
        candidates = [r for r in self.running if id(r) not in scheduled] or self.running
        return max(candidates, key=lambda r: (r.priority, r.arrival_time)) if self.config.policy == "priority" \
            else candidates[-1]

    def _admit(self, items: list[tuple[Request, int]], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.seq_id is None and not self._start_sequence(request):
                break
            n = self._chunk(request, budget)
            if not self._ensure_free(self.kv.blocks.blocks_needed(request.seq_id, n)):
                if self.running:
                    break  # wait for running requests to finish and free their blocks
                # Alone in the engine: run the largest chunk that fits (admission already
                # refused prompts larger than the whole cache, so this makes progress).
                n = self._largest_fitting_chunk(request, n)
                if n == 0:
                    break
            self.waiting.pop(0)
            request.status = Status.RUNNING
            self.running.append(request)
            items.append((request, n))
            self._reserved += self.kv.blocks.blocks_needed(request.seq_id, n)
            budget -= n

    def _chunk(self, request: Request, budget: int) -> int:
        """The request's tokens still to compute, within the budget and max_chunk."""
        n = min(request.num_tokens - request.num_computed, budget)
        return min(n, self.config.max_chunk) if self.config.max_chunk else n

    def _largest_fitting_chunk(self, request: Request, n: int) -> int:
        while n > 0 and self.kv.blocks.blocks_needed(request.seq_id, n) > self.kv.blocks.num_free_blocks - self._reserved:
            n -= 1
        return n

    def _start_sequence(self, request: Request) -> bool:
        """Give the request a KV sequence, forked from the longest cached prefix if any."""
        seq_id = next(self._seq_ids)
        # prompt_logprobs needs the logits of every prompt position, so such a request
        # computes its whole prompt (as vLLM, which skips the cache for it).
        wants_all_logits = request.params.prompt_logprobs is not None and request.prompt_logprobs is None
        hit = self.prefix_cache.lookup(request.all_ids) \
            if self.prefix_cache is not None and not wants_all_logits else None
        if hit is not None:
            if not self._ensure_free(self.kv.blocks.blocks_for_fork(hit.num_tokens), keep=hit.seq_id):
                return False
            self.kv.fork(hit.seq_id, seq_id, hit.num_tokens)
            request.num_computed = hit.num_tokens
            if request.num_preemptions == 0:
                request.cached_prompt_tokens = min(hit.num_tokens, len(request.prompt_ids))
        else:
            self.kv.add(seq_id)
            request.num_computed = 0
        request.seq_id = seq_id
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

