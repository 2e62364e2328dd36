"""A greedy request alone in the engine speculates with both models on their own caches.

When the target library and the draft model's library were both built with `--draft-cache-len`,
a round of speculation needs no paged KV cache at all: the draft proposes k tokens from its own
cache (draft_step, k steps queued without a wait) and the target scores them in one chain_verify
call over its own (runtime/engine/draft_chain.py). On an H100 that round gave the Qwen2.5-Coder
pair 1.59x against 1.34x for the engine's verification through the paged cache
(docs/BENCHMARKS.md, session 37). Those caches hold one sequence each, so the engine takes this
way only for a request alone: nothing else running, waiting or compiling a grammar; and by default
only on a GPU (spec_config.uses_own_caches: on the CPU chain_verify's eight rows and its serial
attention cost more than the engine's verification; "own_caches": true in --speculative-config
takes this way there too).

The rule, in the engine (engine.py step_core): a request alone that asks for nothing the rows'
argmax cannot give (greedy; no logprobs, penalties, logit bias, min_tokens still pending, grammar
or other logits processors, prompt logprobs) leaves the scheduler, and its paged sequence goes to
the prefix cache. Its first round, when it has no token yet, scores no drafts: the prompt goes
into the target's cache and the first token comes alone, so the time to it is the target's
prefill. Every round after speculates. When another request arrives (or the sequence outgrows a
cache) it goes back to the front of the queue as a preempted request does and the scheduler
recomputes what its paged cache lacks (a prompt-sized step once, from the prefix cache where it
still holds the prompt). The tokens are the target's greedy decode either way.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from vtool.runtime.engine.draft_chain import ChainVerifier, DraftChain, chain_round, has_chain_verify
from vtool.runtime.engine.request import Request
from vtool.runtime.engine.spec_config import uses_own_caches
from vtool.runtime.sampling.device import can_sample_on_device

if TYPE_CHECKING:
    from vtool.runtime.engine.engine import Engine


class LoneChain:
    """The target's ChainVerifier and the draft's DraftChain, and the engine's draft length."""

    rounds_counter = "lone_chain_rounds"  # the engine's counter of these rounds

    def __init__(self, verifier: ChainVerifier, draft: DraftChain, k: int):
        self.verifier, self.draft = verifier, draft
        self.k = min(k, verifier.max_verify - 1)

    @classmethod
    def open(cls, engine: Engine) -> LoneChain | None:
        """None unless speculation has a draft model whose library has its own cache and the
        target's library has chain_verify."""
        spec = engine.speculator
        draft = getattr(spec.proposer, "chain", None) if spec is not None else None
        if draft is None or not has_chain_verify(engine.model) or not uses_own_caches(spec.config, engine.model):
            return None
        return cls(ChainVerifier(engine.model), draft, spec.config.num_speculative_tokens)

    def takes(self, request: Request) -> bool:
        """Whether a round of this request's can go through the two caches: its next token is the
        rows' argmax, nothing reads or edits the rows, and the target's cache has room for it."""
        p = request.params
        # past the draft's cache a round would only decode, slower than the engine's captured step
        drafts_fit = not request.output_ids or self.draft.fits(request.num_tokens, 1)
        return (p.greedy and not request.sampler.logits_processors and p.prompt_logprobs is None
                and can_sample_on_device(p, len(request.output_ids))
                and self.verifier.fits(request.num_tokens, 0) and drafts_fit)

    def round(self, request: Request, room: int) -> tuple[list[int], int]:
        """The request's next tokens (at most room) and the number of drafts scored: none in the
        round that gives a request its first token."""
        k = min(self.k, room - 1) if request.output_ids else 0
        return chain_round(self.verifier, self.draft, request.request_id, request.all_ids, k)

    def release(self, request: Request) -> None:
        self.verifier.release(request.request_id)
        self.draft.release(request.request_id)
