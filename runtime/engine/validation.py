"""The one place a request's limits are checked: token ids inside the vocabulary, the prompt
against the context and the KV cache, max_tokens against the room left, and the sampling
parameters against the vocabulary. The engine, the one-sequence generator, the sampler and
the HTTP server's /detokenize all ask here, so a limit is stated (and worded) once.

The HTTP protocol layer still checks the *shape* of a body (types, ranges that need no
model); everything that depends on the loaded model is here.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from vtool import VtoolError
from vtool.runtime.sampling.params import SamplingParams, check_token_ids


class RequestError(VtoolError):
    """A request the engine refuses (the server answers 400 with this message)."""


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """The limits of one loaded model and engine."""

    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int | None = None  # None: no paged cache to outgrow (the one-sequence generator)
    max_new_tokens_ceiling: int | None = None  # server-side cap on an unset max_tokens

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        if len(prompt_ids) == 0:
            raise RequestError("the prompt is empty: at least one token is needed")
        check_token_ids(prompt_ids, self.vocab_size, "prompt token id", RequestError)
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise RequestError(f"the prompt has {n} tokens, at or past max_model_len={self.max_model_len}; "
                               f"shorten it to at most {self.max_model_len - 1} tokens")
        if self.kv_capacity_tokens is not None and n >= self.kv_capacity_tokens:
            raise RequestError(f"the prompt has {n} tokens but the KV cache holds {self.kv_capacity_tokens}")

    def resolve_max_tokens(self, max_tokens: int | None, n_prompt: int, strict: bool = True) -> int:
        """The tokens a request may generate: max_tokens, or (unset, <= 0) the room left under
        the server's ceiling. strict: a max_tokens past the room is refused (the engine, as
        vLLM); otherwise it is cut to the room (`vtool run`, the one-sequence generator)."""
        room = self.max_model_len - n_prompt
        if max_tokens is None or max_tokens <= 0:
            ceiling = self.max_new_tokens_ceiling
            return min(room, ceiling) if ceiling else room
        if max_tokens > room:
            if not strict:
                return room
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} to generate)")
        return max_tokens

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams, strict: bool = True) -> int:
        """Everything at once; returns the resolved max_tokens."""
        self.check_prompt(prompt_ids)
        params.validate(self.vocab_size)
        return self.resolve_max_tokens(params.max_tokens, len(prompt_ids), strict)
