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
        now = time.monotonic() if now is None else now
        token = result.token_id
        request.output_ids.append(token)
        request.cumulative_logprob += result.logprob
        new_logprobs = [result.logprobs_dict()] if request.params.logprobs is not None else []
        if new_logprobs:
            request.output_logprobs.extend(new_logprobs)
        request.first_token_time = request.first_token_time or now
        request.last_token_time = now

        finish, stop_reason = None, None
        if request.sampler.is_stop_token(token):
            finish = "stop"
            stop_reason = token if token in request.params.stop_token_ids else None  # eos reports None
        elif len(request.output_ids) >= request.max_tokens or request.num_tokens >= self.max_model_len:
            finish = "length"
        return CoreOutput(
            request_id=request.request_id, new_token_ids=[token], new_logprobs=new_logprobs,
            finish_reason=finish, stop_reason=stop_reason, num_prompt_tokens=len(request.prompt_ids),
            num_output_tokens=len(request.output_ids), num_cached_tokens=request.cached_prompt_tokens,
            cumulative_logprob=request.cumulative_logprob,
            prompt_logprobs=request.prompt_logprobs if len(request.output_ids) == 1 else None)
