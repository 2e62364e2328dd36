"""The engine core's side of structured output (issue 14): the grammar compiler of the served
model, grammars compiled off the engine loop, the gate that starts a grammar after the
reasoning section, and jump-forward over the tokens a grammar forces.

- A request whose grammar is in the compile cache gets its processor at once. Any other waits
  apart from the scheduler while a worker thread compiles it (llguidance drops the GIL while it
  builds), as vLLM's requests wait for their grammar: the loop keeps stepping the others.
- Jump-forward: after a sampled token, the tokens the grammar forces next (the rest of a JSON
  key, `": "`, a closing brace) are appended without a decode step each; the next step runs
  them through the model as one chunk. The text is what step-by-step masking would give; its
  tokenization may differ (the forced bytes are tokenized canonically). Requests that report
  logprobs do not jump (every token needs its own).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any, Mapping

from vtool.runtime.engine.request import Request
from vtool.runtime.sampling.reasoning_gate import ReasoningGate

log = logging.getLogger("vtool.engine")

COMPILE_THREADS = 2


class GrammarStage:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Any, jump_forward: bool = True):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self.jump_forward = jump_forward
        self._compiler: Any = None  # sampling/grammar.GrammarCompiler, made once (0.2-1.5 s)
        self._compiler_lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict[str, tuple[Request, concurrent.futures.Future]] = {}
        self.num_jumped_tokens = 0

    # -- the compiler ------------------------------------------------------------------
    def prepare(self) -> None:
        """Build the compiler's vocabulary on a worker now (a server calls this at start), so
        the first structured-output request does not wait for it."""
        self._submit(self._warm)

    def _warm(self) -> None:
        try:
            self.compiler()
        except Exception:  # a request that needs it tries again and gets the error
            log.exception("building the grammar vocabulary failed")

    def compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                from vtool.runtime.sampling.grammar import GrammarCompiler

                self._compiler = GrammarCompiler(self.tokenizer, vocab_size=self.vocab_size,
                                                 eos_token_ids=self.stop_ids)
            return self._compiler

    # -- processors ----------------------------------------------------------------------
    def processor_now(self, fields: Mapping[str, Any]) -> Any | None:
        """The request's processor when its grammar is cached (ready now), else None."""
        from vtool.runtime.sampling.grammar import GrammarProcessor, spec_of

        compiler = self._compiler
        compiled = compiler.cached(spec_of(fields)) if compiler is not None else None
        return self._wrap(GrammarProcessor(compiled, tokenizer=compiler), fields) if compiled is not None else None

    def processor(self, fields: Mapping[str, Any]) -> Any:
        """The request's processor, compiling its grammar if need be (blocks: a worker's job,
        or a caller with no loop to keep going)."""
        from vtool.runtime.sampling.grammar import spec_of

        return self._wrap(self.compiler().processor(spec_of(fields)), fields)

    def _wrap(self, processor: Any, fields: Mapping[str, Any]) -> Any:
        marker = fields.get("starts_after")
        if not marker:
            return processor
        end_ids = self.tokenizer.encode(marker, add_special_tokens=False)
        return ReasoningGate(processor, end_ids, ended=bool(fields.get("reasoning_ended", False)))

    # -- compiling off the loop ---------------------------------------------------------------
    def submit(self, request: Request, fields: Mapping[str, Any]) -> None:
        self._pending[request.request_id] = (request, self._submit(self.processor, fields))

    def _submit(self, fn: Any, *args: Any) -> concurrent.futures.Future:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="vtool-grammar")
        return self._pool.submit(fn, *args)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def discard(self, request_id: str) -> None:
        """A waiting request ended (aborted): its grammar, when done, is dropped."""
        self._pending.pop(request_id, None)

    def ready(self) -> list[tuple[Request, Any, Exception | None]]:
        """The waiting requests whose grammar is done: (request, processor or None, error)."""
        done = []
        for request_id, (request, future) in list(self._pending.items()):
            if future.done():
                del self._pending[request_id]
                error = future.exception()
                done.append((request, None if error else future.result(), error))
        return done

    def wait(self, timeout: float) -> None:
        """Sleep until a waiting grammar is done (or timeout): an engine with nothing else to
        run should not spin while a compile takes a core."""
        futures = [future for _, future in self._pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    # -- jump-forward --------------------------------------------------------------------------
    def forced_tokens(self, request: Request, room: int) -> list[int]:
        """Up to `room` tokens the request's grammar forces next, already accepted by it (and
        recorded as generated by its sampler); [] when it has none or does not jump."""
        if not self.jump_forward or room <= 0 or request.params.logprobs is not None:
            return []
        grammars = [p for p in request.sampler.logits_processors if hasattr(p, "forced_tokens")]
        if len(grammars) != 1 or grammars[0].is_terminated():
            return []
        forced = grammars[0].forced_tokens()[:room]
        for token in forced:
            request.sampler.append_token(token)  # the grammar accepts it
        self.num_jumped_tokens += len(forced)
        return forced

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
