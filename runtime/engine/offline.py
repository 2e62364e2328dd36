"""Offline batch inference shaped like vLLM's `LLM`: generate() and chat() over the engine, and
embed() over an embedding model (manifest task "embed": runtime/engine/embed.py), which has no
engine and refuses generate()/chat() by name, as a generation model refuses embed().

`vtool.LLM` (in vtool.toolchain.api) builds the model on first use and hands the loaded
session to OfflineLLM; a runtime-only install can construct OfflineLLM from an artifact.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any, Sequence

from vtool import VtoolError
from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.sampling.params import SamplingParams

if TYPE_CHECKING:  # the session composes an engine's parts; the engine only reads it
    from vtool.runtime.session import Session


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[Any] | None
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[Any] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0


Prompt = str | list[int] | dict[str, Any]


class OfflineLLM:
    def __init__(self, session: Session, engine_config: EngineConfig = EngineConfig()):
        self.session = session
        self._ids = itertools.count()
        self.embedder: Any = None
        if session.task == "embed":  # an encoder: no KV cache, no engine
            from vtool.runtime.engine.embed import Embedder

            self.engine: Any = None
            self.embedder = Embedder(session)
            return
        self.engine = Engine(session, engine_config)

    def get_tokenizer(self) -> Any:
        return self.session.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is text, a list of token ids,
        or {"prompt": text} / {"prompt_token_ids": [...]} as in vLLM."""
        self._require_generation("generate")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = self._params_for(sampling_params, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        return self._run([(text, ids, p) for (text, ids), p in zip(encoded, params)])

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: `tools` go to the chat template (as transformers'
        apply_chat_template(tools=...)); the answer is text, as in vLLM (a grammar in the
        SamplingParams' structured_outputs can make it a call)."""
        self._require_generation("chat")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = self._params_for(sampling_params, len(conversations))
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        jobs = []
        for conversation, p in zip(conversations, params):
            text = self.session.render_chat(list(conversation), add_generation_prompt=add_generation_prompt, **kwargs)
            jobs.append((text, self.session.tokenizer.encode(text, add_special_tokens=False), p))
        return self._run(jobs)

    def embed(self, prompts: Prompt | Sequence[Prompt], dimensions: int | None = None) -> list[list[float]]:
        """One vector per prompt, in order (the checkpoint's pooling, Dense layers and normalization:
        runtime/engine/pooling.py). A prompt is text, a list of token ids, or {"prompt": text} /
        {"prompt_token_ids": [...]}; `dimensions` truncates a Matryoshka model's vectors (and
        renormalizes them), and is refused for other models. Every input goes through the model
        in batches. A generation model refuses, by name."""
        if self.embedder is None:
            raise VtoolError(f"LLM.embed() needs an embedding model; {self.session.checkpoint.path} is a generation "
                             f"model ({self.session.model.manifest.get('arch')}, task 'generate'): use generate() "
                             "or chat()")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = [self._encode(p)[1] for p in prompts]  # type: ignore[union-attr]
        if dimensions is not None:
            self.embedder.pooler.check_dimensions(dimensions, str(self.session.checkpoint.path))
        return [v.tolist() for v in self.embedder.embed(ids, dimensions)]

    # -- internals ---------------------------------------------------------------------------
    def _require_generation(self, what: str) -> None:
        if self.engine is None:
            raise VtoolError(f"LLM.{what}() is only supported for generative models; {self.session.checkpoint.path} "
                             f"is an embedding model ({self.session.model.manifest.get('arch')}, task 'embed'): "
                             "use LLM.embed()")

    def _params_for(self, given: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
        if given is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(given, SamplingParams):
            return [given] * count
        given = list(given)
        if len(given) != count:
            raise VtoolError(f"got {len(given)} SamplingParams for {count} prompts; give one, or one per prompt")
        return given

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.session.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.session.tokenizer.encode(prompt["prompt"])
            raise VtoolError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise VtoolError(f"a prompt is text, token ids or a dict, got {type(prompt).__name__}")

    def _run(self, jobs: list[tuple[str | None, list[int], SamplingParams]]) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        children: dict[str, tuple[int, int]] = {}
        try:
            for job_index, (text, ids, params) in enumerate(jobs):
                rid = str(next(self._ids))
                results.append(RequestOutput(rid, text, ids, None, [
                    CompletionOutput(j, "", [], None if params.logprobs is None else 0.0,
                                     [] if params.logprobs is not None else None, None)
                    for j in range(params.n)]))
                for j in range(params.n):
                    child = params.for_child(j) if params.n > 1 else params
                    self.engine.add_request(f"{rid}-{j}", ids, child)
                    children[f"{rid}-{j}"] = (job_index, j)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    job, j = children[out.request_id]
                    result, choice = results[job], results[job].outputs[j]
                    choice.text += out.new_text
                    choice.token_ids.extend(out.new_token_ids)
                    choice.cumulative_logprob = out.cumulative_logprob
                    if choice.logprobs is not None:
                        choice.logprobs.extend(out.new_logprobs)
                    if out.prompt_logprobs is not None:
                        result.prompt_logprobs = out.prompt_logprobs
                    result.num_cached_tokens = out.num_cached_tokens
                    if out.finished:
                        choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
        except BaseException:
            for rid in children:  # leave the engine clean for the next call
                self.engine.abort(rid)
            raise
        return results
