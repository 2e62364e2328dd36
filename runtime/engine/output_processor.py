"""Output processing inside the engine core: a sampled token becomes the request's
CoreOutput (token ids, logprobs) and, when a stop token or the length limit ends the
request, its finish reason.

Only what the core must know before it schedules the next step is decided here. Text,
stop strings and the held-back tail of a possible stop string are TextStage's business
(engine/text_stage.py), which runs beside the HTTP server when the engine core has its own
process (as vLLM v1 detokenizes in the frontend). Freeing the request's blocks is the
engine's business once a CoreOutput says finished.
"""
from __future__ import annotations

import time

from vtool.runtime.engine.request import CoreOutput, Request
from vtool.runtime.sampling.host import SampleResult


class OutputProcessor:
    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len

    def process(self, request: Request, result: SampleResult, now: float | None = None) -> CoreOutput:
        """update() then record(): the token taken and its CoreOutput."""
        finish, stop_reason = self.update(request, result, time.monotonic() if now is None else now)
        return self.record(request, result, finish, stop_reason)

    def update(self, request: Request, result: SampleResult, now: float) -> tuple[str | None, int | None]:
        """Take the sampled token into the request; (finish reason, stop token id) when it
        ends the request. All the scheduler needs before the next step."""
        token = result.token_id
        request.output_ids.append(token)
        if request.params.logprobs is not None:  # else the sampler computed no logprob
            request.cumulative_logprob += result.logprob
            request.output_logprobs.append(result.logprobs_dict())
        request.first_token_time = request.first_token_time or now
        request.last_token_time = now
        if request.sampler.is_stop_token(token):
            # eos reports no stop reason; a stop_token_ids entry reports itself
            return "stop", token if token in request.params.stop_token_ids else None
        return self._limits(request)

    def _limits(self, request: Request) -> tuple[str | None, int | None]:
        processors = request.sampler.logits_processors
        if processors and any(getattr(p, "is_terminated", None) and p.is_terminated() for p in processors):
            # A grammar that is complete allows nothing but the end token: stop here, also under
            # min_tokens or ignore_eos, where drawing the end token is not possible or not an end.
            return "stop", None
        if len(request.output_ids) >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def room(self, request: Request) -> int:
        """How many more tokens the request may take before a length limit."""
        return min(request.max_tokens - len(request.output_ids), self.max_model_len - request.num_tokens)

    def extend(self, request: Request, forced: list[int]) -> tuple[str | None, int | None]:
        """Take tokens a grammar forced (jump-forward; its sampler has recorded them) into the
        request after a sampled token; the finish they bring, as update()."""
        request.output_ids.extend(forced)
        return self._limits(request)

    def ended(self, request: Request) -> CoreOutput:
        """The CoreOutput of a request the core ended outside a step (no new token)."""
        return CoreOutput(
            request_id=request.request_id, new_token_ids=[], new_logprobs=[], finish_reason=request.finish_reason,
            stop_reason=request.stop_reason, num_prompt_tokens=len(request.prompt_ids),
            num_output_tokens=len(request.output_ids), num_cached_tokens=request.cached_prompt_tokens,
            cumulative_logprob=request.cumulative_logprob)

    def record(self, request: Request, result: SampleResult | list[SampleResult], finish: str | None,
               stop_reason: int | None, forced: list[int] = ()) -> CoreOutput:
        """The CoreOutput for the token(s) update() took (one sampled token, or the tokens a
        speculative step kept), and the tokens a grammar forced after them (the request may
        have moved on since: its counts are read as of those tokens)."""
        results = result if isinstance(result, list) else [result]
        num_output = len(request.output_ids)
        taken = len(results) + len(forced)
        last = results[-1].token_id
        return CoreOutput(
            request_id=request.request_id, new_token_ids=[r.token_id for r in results] + list(forced),
            new_logprobs=request.output_logprobs[num_output - taken:num_output]
            if request.params.logprobs is not None else [],
            finish_reason=finish, stop_reason=stop_reason, num_prompt_tokens=len(request.prompt_ids),
            num_output_tokens=num_output, num_cached_tokens=request.cached_prompt_tokens,
            cumulative_logprob=request.cumulative_logprob,
            prompt_logprobs=request.prompt_logprobs if num_output == taken else None,
            stop_token=finish == "stop" and not forced and request.sampler.is_stop_token(last))
