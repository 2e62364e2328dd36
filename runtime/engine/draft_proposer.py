"""Drafts from a smaller model that shares the target's vocabulary ("model" in
--speculative-config): the draft runs its own compiled library with its own paged KV cache.

Per proposal round the draft first computes the tokens of each sequence it has not seen (the
whole prompt the first time; afterwards the target's last token and the drafts it accepted),
then decodes one token at a time up to the request's draft limit. Its cache is kept in step
by common prefix: tokens it holds that the request no longer has (rejected drafts) are popped
first. Greedy requests take the draft's argmax (on the host from the logits row; with
`argmax_on_device`, on a GPU when every request of the round is greedy, on the device: only
token ids come back); random ones draw from the draft's own
distribution after the request's temperature, top-k, top-p and min-p, which verification
needs (sampling/spec_verify.py). When the draft's cache is full the least recently used
sequences leave it; a request that still does not fit gets no drafts that step.

A draft library built with `--draft-cache-len` has another way for the common case, one greedy
request alone: runtime/engine/draft_chain.py drafts its k tokens through the library's own cache,
with no host work between them (on CUDA one graph launch a token: 1.34x against 1.02x for the
engine's way on the Qwen2.5-Coder pair on an H100, docs/BENCHMARKS.md, session 37). Other rounds
take the engine's way above; the two caches are kept apart, each in step with the requests it served.
By default only on a GPU (spec_config.uses_own_caches: on the CPU the engine's way measured faster).
"""
from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from vtool import VtoolError
from vtool.runtime.engine.draft_chain import DraftChain, has_draft_chain
from vtool.runtime.engine.kv_cache import PagedKVCache
from vtool.runtime.engine.request import Request
from vtool.runtime.engine.runner import ModelRunner
from vtool.runtime.engine.spec_config import SpeculativeConfig, uses_own_caches
from vtool.runtime.engine.step_types import ScheduledSequence, SchedulerOutput
from vtool.runtime.sampling.host import draw_index, make_generator, scratch_buffers, target_probs

if TYPE_CHECKING:
    from vtool.runtime.engine.engine import Engine
    from vtool.runtime.session import Session

log = logging.getLogger("vtool.engine")


@dataclasses.dataclass
class _DraftSequence:
    seq_id: int
    tokens: list[int]  # what the draft's cache holds for the request, in order
    rng: np.random.Generator


class DraftModelProposer:
    def __init__(self, session: Session, config: SpeculativeConfig, max_num_seqs: int, max_model_len: int,
                 prefill_chunk: int):
        self.session, self.model = session, session.model
        self.k = config.num_speculative_tokens
        self.prefill_chunk = prefill_chunk
        # Room for every sequence speculation can serve at once (fewer than disable_by_batch_size),
        # each at full context plus its drafts.
        seqs = min(max_num_seqs, config.disable_by_batch_size)
        per_seq = -(-(max_model_len + self.k + 1) // 16)
        self.kv = PagedKVCache(self.model, seqs * per_seq, 16, max(seqs, 1), prefill_chunk)
        # the draft only ever computes tokens the target has decided: decode's numerics throughout
        # device_sampling: a GPU draft's greedy rounds can take their argmax there (argmax_rows)
        self.runner = ModelRunner(self.model, self.kv, device_sampling=True, continuations=True)
        # Off until it measures faster on a GPU: in session 9 a device draw for the draft's
        # greedy tokens ran 0.77-0.91x against copying the row and scanning it on the host
        # (the compiled argmax also computes the row's log-sum-exp in float64); set it by hand
        # to measure again (the bench's variants now compare the draft cache with this path).
        self.argmax_on_device = False
        self._seqs: OrderedDict[str, _DraftSequence] = OrderedDict()  # least recently used first
        self._next_id = 0
        # the library's own draft cache (built with --draft-cache-len), for one greedy request alone
        self.chain: DraftChain | None = DraftChain(self.model) \
            if has_draft_chain(self.model) and uses_own_caches(config, self.model) else None
        self.chain_rounds = 0  # rounds drafted through it

    @classmethod
    def open(cls, config: SpeculativeConfig, engine: Engine) -> DraftModelProposer:
        max_len = min(engine.max_model_len, config.max_model_len or engine.max_model_len)
        session = engine.session.open_draft(config, max_len)
        if session.model.vocab_size != engine.vocab_size:
            raise VtoolError(f"--speculative-config: the draft model's vocabulary has {session.model.vocab_size} "
                             f"entries, the target's {engine.vocab_size}: a draft must share the target's tokens")
        return cls(session, config, engine.config.max_num_seqs, engine.max_model_len,
                   engine.config.max_num_batched_tokens)

    # -- proposer interface -------------------------------------------------------------------
    def propose_batch(self, requests: list[Request], limits: list[int]) -> None:
        if self._chain_takes(requests, limits):
            request = requests[0]
            request.draft_ids = self.chain.propose(request.request_id, request.all_ids, limits[0])
            request.draft_probs = None
            self.chain_rounds += 1
            return
        live = [(r, limit, s) for r, limit in zip(requests, limits) if (s := self._sync(r)) is not None]
        if not live:
            return
        on_device = (self.argmax_on_device and self.runner.device_sampler is not None
                     and all(r.params.greedy for r, _, _ in live))
        last = self._catch_up([(r.all_ids, s) for r, _, s in live], on_device)
        drafts: list[list[int]] = [[] for _ in live]
        probs: list[list[np.ndarray]] = [[] for _ in live]
        for round_ in range(max(limit for _, limit, _ in live)):
            active = [i for i, (_, limit, _) in enumerate(live) if round_ < limit]
            if round_ > 0:
                step = [(live[i][2], drafts[i][-1]) for i in active]
                last = dict(zip(active, self._decode(step, on_device)))
            for i in active:
                if on_device:  # already the argmax's token id
                    drafts[i].append(int(last[i]))
                    continue
                request, _, seq = live[i]
                token, q = self._choose(last[i], request, seq)
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
        for i, (request, _, seq) in enumerate(live):
            request.draft_ids = drafts[i]
            request.draft_probs = np.stack(probs[i]) if probs[i] else None

    def _chain_takes(self, requests: list[Request], limits: list[int]) -> bool:
        """Whether this round drafts through the library's own cache: one greedy request alone
        (the chain draws argmax tokens only, and holds one sequence) that fits it."""
        return (self.chain is not None and len(requests) == 1 and requests[0].params.greedy
                and self.chain.fits(len(requests[0].all_ids), limits[0]))

    def release(self, request: Request) -> None:
        if self.chain is not None:
            self.chain.release(request.request_id)
        seq = self._seqs.pop(request.request_id, None)
        if seq is not None:
            self.kv.remove(seq.seq_id)

    # -- the draft's own cache ----------------------------------------------------------------
    def _sync(self, request: Request) -> _DraftSequence | None:
        """The request's draft sequence, its cache cut back to what the request still holds
        (never its last token, whose logits propose the first draft); None when it cannot fit."""
        ids = request.all_ids
        seq = self._seqs.pop(request.request_id, None)
        if seq is None:
            if len(self._seqs) >= self.kv.max_num_seqs and not self._evict():
                return None
            seq = _DraftSequence(self._next_id, [], make_generator(
                None if request.params.seed is None else request.params.seed + 1))
            self._next_id += 1
            self.kv.add(seq.seq_id)
        self._seqs[request.request_id] = seq  # most recently used
        common = 0
        limit = min(len(seq.tokens), len(ids) - 1)
        while common < limit and seq.tokens[common] == ids[common]:
            common += 1
        self.kv.pop(seq.seq_id, len(seq.tokens) - common)
        del seq.tokens[common:]
        need = self.kv.blocks.blocks_needed(seq.seq_id, len(ids) - common + self.k)
        while self.kv.blocks.num_free_blocks < need:
            if not self._evict(keep=request.request_id):
                return None
        return seq

    def _evict(self, keep: str | None = None) -> bool:
        for rid in self._seqs:
            if rid != keep:
                self.kv.remove(self._seqs.pop(rid).seq_id)
                return True
        return False

    def _catch_up(self, items: list[tuple[list[int], _DraftSequence]], argmax: bool = False) -> dict[int, Any]:
        """Run the tokens each draft sequence lacks, in chunks the step budget allows; the logits
        after each sequence's last token (argmax: their argmax's token id, taken on the device)."""
        last: dict[int, Any] = {}
        pending = {i: ids[len(seq.tokens):] for i, (ids, seq) in enumerate(items)}
        while pending:
            budget, batch = self.prefill_chunk, []
            for i, todo in pending.items():
                if budget <= 0:
                    break
                chunk = todo[:budget]
                batch.append((i, chunk, len(chunk) == len(todo)))
                budget -= len(chunk)
            step = SchedulerOutput(tuple(
                ScheduledSequence(request_id=str(i), seq_id=items[i][1].seq_id, token_ids=tuple(chunk),
                                  num_computed=len(items[i][1].tokens), num_logit_rows=self._rows_wanted(chunk, done),
                                  sample=False, return_logits=done)
                for i, chunk, done in batch))
            if argmax:
                tokens, owners = self.runner.argmax_rows(step)
                rows = [tokens[owners == n] for n in range(len(batch))]
            else:
                rows = [result.logits for result in self.runner.execute(step).results]
            for (i, chunk, done), row in zip(batch, rows):
                items[i][1].tokens.extend(chunk)
                if done:
                    last[i] = row[-1]
                    del pending[i]
                else:
                    pending[i] = pending[i][len(chunk):]
        return last

    def _rows_wanted(self, chunk: list[int], done: bool) -> int:
        """Logit rows for a catch-up chunk: the last one is all the draft needs, but a short
        chunk after a verification (the target's token and the accepted drafts) asks for every
        row, which lets a CUDA library run it as a captured graph (runner._multi_token_entry)."""
        if not done:
            return 0
        return len(chunk) if len(chunk) <= self.k + 1 else 1

    def _decode(self, step: list[tuple[_DraftSequence, int]], argmax: bool = False) -> list[Any]:
        """One token for each sequence: the logits row after it (argmax: its argmax's token id,
        taken on the device)."""
        out = SchedulerOutput(tuple(
            ScheduledSequence(request_id=str(n), seq_id=seq.seq_id, token_ids=(token,), num_computed=len(seq.tokens),
                              num_logit_rows=1, sample=False, return_logits=not argmax)
            for n, (seq, token) in enumerate(step)))
        if argmax:
            tokens, _ = self.runner.argmax_rows(out)
            rows: list[Any] = tokens[:len(step)].tolist()
        else:
            rows = [r.logits[-1] for r in self.runner.execute(out).results]
        for seq, token in step:
            seq.tokens.append(token)
        return rows

    @staticmethod
    def _choose(row: np.ndarray, request: Request, seq: _DraftSequence) -> tuple[int, np.ndarray | None]:
        p = request.params
        if p.greedy:
            return int(np.argmax(row)), None
        scratch = scratch_buffers(row.size)
        x = np.array(row, dtype=np.float32, copy=True)
        q = target_probs(x, p, scratch)
        return draw_index(q, seq.rng.random()), q
