"""A greedy request alone in the engine decodes on the library's own cache, several steps a round.

A library built with `vtool build --draft-cache-len N` has `draft_step`: one decode step over a
cache of its own (one sequence, contiguous positions) whose every input stays at one address, so
a CUDA build captures the whole step, attention included, in one graph, and the step's token is
the argmax of its logits, written to a state tensor on the device (models/draft_chain.py). Queued
k at a time they run back to back with nothing on the host between them, where `decode` over the
paged cache leaves the GPU idle at each layer's KV-cache kernels, which TVM launches from the host
between the captured pieces (docs/BENCHMARKS.md, "Where a decode step's GPU sits idle").

Speculation's lone-request rounds (engine/lone_chain.py) use these steps to draft; here the
library drafts for itself and every token is kept: they are its greedy decode. The engine's rule
is the same as for those rounds (engine.py `_lone_request`): a request alone whose next token is
the rows' argmax (greedy; no logprobs, penalties, logit bias, pending min_tokens, grammar or other
logits processors, prompt logprobs) leaves the scheduler; when another request arrives it goes
back to the queue and the scheduler recomputes what its paged cache lacks. Its first round feeds
the prompt (draft_extend) and gives one token, so the time to it is a prefill; every later round
gives up to `steps` tokens at once (a stop id or a length limit ends the request inside a round;
the steps past it are wasted, nothing else). Opt-in (EngineConfig.lone_decode, `--lone-decode`)
until it is timed on a GPU against `decode` (tests/bench/gpu_decode_8b.py times both,
tests/bench/chained_steps_ab.py --modes default,lone the engine's tokens): on the CPU it is slower,
since the cache's attention there is plain serial TIR (docs/BENCHMARKS.md, session 38).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vtool import VtoolError
from vtool.runtime.artifact.draft_state import LONE_DECODE_STEPS
from vtool.runtime.engine.draft_chain import DraftChain, has_draft_chain
from vtool.runtime.engine.request import Request
from vtool.runtime.sampling.device import can_sample_on_device

if TYPE_CHECKING:
    from vtool.runtime.engine.engine import Engine

log = logging.getLogger("vtool.engine")


class LoneDecode:
    """The library's own cache, used as the decode of a greedy request alone."""

    rounds_counter = "lone_decode_rounds"  # the engine's counter of these rounds

    def __init__(self, chain: DraftChain, steps: int = LONE_DECODE_STEPS):
        self.chain = chain
        # a round runs at most max_steps steps, max_forced - 1 of them feeding tokens
        self.steps = max(1, min(steps, chain.max_steps - chain.max_forced + 1))

    @classmethod
    def open(cls, engine: Engine) -> LoneDecode | None:
        """None unless the config asks for it and the engine does not speculate (a request alone
        then has speculation's own-cache rounds, engine/lone_chain.py). Asked for on a library
        without the cache: refused by name."""
        if not engine.config.lone_decode:
            return None
        if engine.speculator is not None:
            log.info("lone decode: with speculation a greedy request alone takes speculation's rounds instead "
                     "(its own-cache rounds where both libraries have the cache)")
            return None
        if not has_draft_chain(engine.model):
            raise VtoolError("lone_decode needs a library built with --draft-cache-len (it has no draft_step "
                             "over a cache of its own); rebuild with --draft-cache-len N or leave it off")
        return cls(DraftChain(engine.model), engine.config.lone_decode_steps)

    def takes(self, request: Request) -> bool:
        """Whether the request's next tokens are the argmax of its rows, with nothing reading or
        editing them, and the cache has room for one more."""
        p = request.params
        return (p.greedy and not request.sampler.logits_processors and p.prompt_logprobs is None
                and can_sample_on_device(p, len(request.output_ids)) and self.chain.fits(request.num_tokens, 1))

    def round(self, request: Request, room: int) -> tuple[list[int], int]:
        """The request's next tokens (at most `room`, at least one) and the drafts scored (none:
        every token is the library's own greedy decode). The first round gives one token."""
        k = min(self.steps, room, self.chain.cache_len - request.num_tokens) if request.output_ids else 1
        return self.chain.propose(request.request_id, request.all_ids, max(k, 1)), 0

    def release(self, request: Request) -> None:
        self.chain.release(request.request_id)
