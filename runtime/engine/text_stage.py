"""From token ids to text, per request: incremental detokenization, stop strings, and the
StepOutput a caller streams.

The engine core reports token ids (CoreOutput); this stage turns each into text. It is
cheap Python per token, which is why it stays off the engine core's loop when the core has
its own process: the API server runs it as the outputs arrive (vLLM v1's frontend
detokenizer). A stop string found here ends the request: the caller must then tell the core
(Engine.finish_request), which may already have computed a token or two more; those are
never shown, as in vLLM.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from vtool.runtime.engine.request import CoreOutput, StepOutput
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.sampling.stop_strings import StopStringMatcher

if TYPE_CHECKING:
    from vtool.runtime.text.tokenizer import Tokenizer


class TextStage:
    """One request's text state. Building it validates the stop strings (a VtoolError
    names a bad one), so a refusal comes before the request reaches the engine."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.params = params
        self.detokenizer = tokenizer.incremental(params.skip_special_tokens, prompt_ids)
        self.stop_matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        self.num_output_tokens = 0
        self.finished = False

    def process(self, out: CoreOutput) -> StepOutput:
        """The StepOutput for one CoreOutput; finished with reason "stop" and the string as
        stop_reason when a stop string completes (out.finish_reason was None then)."""
        finish, stop_reason = out.finish_reason, out.stop_reason
        tokens = out.new_token_ids
        push = self.detokenizer.push
        self.num_output_tokens += len(tokens)
        if len(tokens) == 1 and not out.stop_token:  # a decode step's one token
            text = push(tokens[0])
        else:
            shown = tokens[:-1] if out.stop_token else tokens  # a stop token's text is never shown
            text = "".join([push(token) for token in shown])
        if finish is not None:
            text += self.detokenizer.flush()
        if self.stop_matcher is None:
            delta = text
        else:
            delta, matched = self._apply_stop_strings(text, final=finish is not None)
            if matched is not None:
                finish, stop_reason = "stop", matched
        self.finished = finish is not None
        return StepOutput(
            request_id=out.request_id, new_token_ids=out.new_token_ids, new_text=delta,
            new_logprobs=out.new_logprobs, finished=self.finished, finish_reason=finish, stop_reason=stop_reason,
            num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
            num_cached_tokens=out.num_cached_tokens, prompt_logprobs=out.prompt_logprobs,
            cumulative_logprob=out.cumulative_logprob)

    def _apply_stop_strings(self, text: str, final: bool) -> tuple[str, str | None]:
        """(text to emit now, the stop string that ended the request or None). Stop strings
        only count once min_tokens are out, as in vLLM."""
        matcher = self.stop_matcher
        if matcher is None:
            return text, None
        if self.num_output_tokens < self.params.min_tokens:
            return text + (matcher.flush() if final else ""), None
        emitted, hit = matcher.push(text)
        if hit:
            return emitted, matcher.matched
        return emitted + (matcher.flush() if final else ""), None
