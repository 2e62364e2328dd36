"""Output processing: a sampled token becomes a request's delta (token ids, text, logprobs)
and, when it ends the request, a finish reason.

Stop tokens (eos unless ignore_eos, stop_token_ids) and stop strings are checked here, text
is detokenized incrementally, and text that may begin a stop string is held back until it
cannot. It touches only the request's output state: freeing the request's blocks is the
engine's business once a StepOutput says finished.
"""
from __future__ import annotations

import time

from vtool.runtime.engine.request import Request, StepOutput
from vtool.runtime.sampling.host import SampleResult


class OutputProcessor:
    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len

    def process(self, request: Request, result: SampleResult) -> StepOutput:
        now = time.monotonic()
        token = result.token_id
        request.output_ids.append(token)
        request.cumulative_logprob += result.logprob
        new_logprobs = [result.logprobs_dict()] if request.params.logprobs is not None else []
        request.output_logprobs.extend(new_logprobs)
        request.first_token_time = request.first_token_time or now
        request.last_token_time = now

        stop_token = request.sampler.is_stop_token(token)
        text = "" if stop_token else request.detokenizer.push(token)  # a stop token's text is never shown
        finish, stop_reason = None, None
        if stop_token:
            finish = "stop"
            stop_reason = token if token in request.params.stop_token_ids else None  # eos reports None
        elif len(request.output_ids) >= request.max_tokens or request.num_tokens >= self.max_model_len:
            finish = "length"
        if finish is not None:
            text += request.detokenizer.flush()
        delta, matched = self._apply_stop_strings(request, text, final=finish is not None)
        if matched is not None:
            finish, stop_reason = "stop", matched
        request.text += delta
        return StepOutput(
            request_id=request.request_id, new_token_ids=[token], new_text=delta, new_logprobs=new_logprobs,
            finished=finish is not None, finish_reason=finish, stop_reason=stop_reason,
            num_prompt_tokens=len(request.prompt_ids), num_output_tokens=len(request.output_ids),
            num_cached_tokens=request.cached_prompt_tokens,
            prompt_logprobs=request.prompt_logprobs if len(request.output_ids) == 1 else None,
            cumulative_logprob=request.cumulative_logprob)

    @staticmethod
    def _apply_stop_strings(request: Request, text: str, final: bool) -> tuple[str, str | None]:
        """(text to emit now, the stop string that ended the request or None). Stop strings
        only count once min_tokens are out, as in vLLM."""
        matcher = request.stop_matcher
        if matcher is None:
            return text, None
        if len(request.output_ids) < request.params.min_tokens:
            return text + (matcher.flush() if final else ""), None
        emitted, hit = matcher.push(text)
        if hit:
            return emitted, matcher.matched
        return emitted + (matcher.flush() if final else ""), None
