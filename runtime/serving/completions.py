"""POST /v1/completions and /v1/chat/completions: prompts in, choices out (JSON or SSE).

Each prompt x n becomes one engine request per choice (n > 1 uses SamplingParams.for_child,
so seeded choices differ yet reproduce). Outputs of all choices are merged as they come.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vtool.runtime.engine.async_engine import AsyncEngine, RequestStream
from vtool.runtime.serving.errors import BadRequestError, NotFoundError
from vtool.runtime.serving.protocol import (
    SSE_DONE, ChatCompletionLogProb, ChatCompletionLogProbs, ChatCompletionLogProbsContent, ChatCompletionRequest,
    ChatCompletionResponse, ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse, ChatResponseMessage, CompletionLogProbs, CompletionRequest, CompletionResponse,
    CompletionResponseChoice, CompletionResponseStreamChoice, CompletionStreamResponse, DeltaMessage,
    PromptTokenUsageInfo, UsageInfo, chat_completion_id, completion_id, sse_event)
from vtool.runtime.engine.request import StepOutput
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.serving.core_client import CoreClient
from vtool.runtime.serving.reasoning import ReasoningParser
from vtool.runtime.serving.chat_output import ChoiceShaper, tool_mode
from vtool.runtime.serving.reasoning import END as REASONING_END
from vtool.runtime.text.tokenizer import Tokenizer

log = logging.getLogger("vtool.server")


class ClientDisconnected(Exception):
    """The client of a non-streaming request left; its requests were aborted."""


@dataclasses.dataclass
class ServingState:
    # The engine core's client: CoreClient (its own process) or AsyncEngine (a thread here).
    engine: CoreClient | AsyncEngine
    tokenizer: Tokenizer
    served_names: list[str]
    max_model_len: int
    metrics_enabled: bool  # /metrics answers (the engine core renders them)
    sampling_defaults: dict[str, Any]
    enable_log_requests: bool = False
    enable_log_outputs: bool = False
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser
    tool_parser: Any = None  # --tool-call-parser: a serving/tool_parsers class
    grammar_in_reasoning: bool = False  # --structured-outputs-config enable_in_reasoning
    default_chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_log_len: int | None = None
    force_include_usage: bool = False
    # "generate", or "embed": `engine` is then a serving/embeddings.py EmbeddingService, and only
    # /v1/embeddings (not completions or chat) answers
    task: str = "generate"
    # --return-tokens-as-token-ids: logprobs name tokens "token_id:N" unless a request says
    return_tokens_as_token_ids: bool = False

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.served_names:
            return self.served_names[0]
        raise NotFoundError(f"The model `{model}` does not exist; this server serves {', '.join(self.served_names)}",
                            param="model")

    def truncate_prompt(self, prompt_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len of
        them); more than max_model_len is refused with vLLM's message."""
        if keep is None:
            return prompt_ids
        if keep == -1:
            keep = self.max_model_len
        if keep > self.max_model_len:
            raise BadRequestError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                                  f"({self.max_model_len}). Please, select a smaller truncation size.",
                                  param="truncate_prompt_tokens")
        return prompt_ids[-keep:] if len(prompt_ids) > keep else prompt_ids

    def tokens_as_ids(self, requested: bool | None) -> bool:
        """Whether logprobs name tokens "token_id:N": the request's return_tokens_as_token_ids,
        else the server's flag."""
        return self.return_tokens_as_token_ids if requested is None else requested

    def clip(self, text: Any) -> str:
        text = str(text)
        return text if self.max_log_len is None else text[: self.max_log_len]


@dataclasses.dataclass
class Choice:
    """Accumulated state of one choice while its request runs."""

    index: int
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Any] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cached_tokens: int = 0
    started: bool = False


async def _admit(state: ServingState, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 priority: int) -> tuple[list[RequestStream], list[Choice]]:
    streams, choices = [], []
    try:
        for p, prompt_ids in enumerate(prompts):
            # n > 1: each child names its parent (this prompt's request), whose n and longest
            # child the metrics observe once, as vLLM's ParentRequest has them
            parent = (f"{request_id}-{p}", params.n) if params.n > 1 else None
            for j in range(params.n):
                child = params.for_child(j) if params.n > 1 else params
                streams.append(await state.engine.add(f"{request_id}-{p}-{j}", prompt_ids, child, priority, parent))
                choices.append(Choice(len(choices), prompt_ids))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    if state.enable_log_requests:
        log.info("Received request %s: prompt_token_ids=%s, params=%s", request_id,
                 state.clip(prompts[0] if len(prompts) == 1 else prompts), state.clip(params))
    return streams, choices


async def _merged(state: ServingState, streams: list[RequestStream]) -> AsyncIterator[tuple[int, StepOutput]]:
    """(choice index, output) from every stream as it arrives. Leaving early (a client that
    went away, an error) aborts whatever has not finished, which frees its blocks. Latency
    metrics are recorded by the engine core, where every API server's requests pass."""
    if len(streams) == 1:  # the common case: no pump task, no second queue
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await q.put((i, out))
        except BaseException as err:  # surfaced to the consumer
            await q.put((i, err))
            return
        await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


def _apply(choice: Choice, out: StepOutput) -> None:
    choice.text += out.new_text
    choice.token_ids.extend(out.new_token_ids)
    choice.logprobs.extend(out.new_logprobs)
    if out.prompt_logprobs is not None:
        choice.prompt_logprobs = out.prompt_logprobs
    choice.cached_tokens = out.num_cached_tokens
    if out.finished:
        choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason


def _usage(prompts: list[list[int]], choices: list[Choice]) -> UsageInfo:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.cached_tokens for c in choices[:: max(1, len(choices) // max(1, len(prompts)))])
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                     prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached) if cached else None)


async def _collect(raw: Request, state: ServingState, streams: list[RequestStream], choices: list[Choice]) -> None:
    """Run every choice to the end; stop (and abort) if the client disconnects."""

    async def consume() -> None:
        async for i, out in _merged(state, streams):
            _apply(choices[i], out)

    task = asyncio.create_task(consume())
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await raw.is_disconnected():
            task.cancel()  # _merged's cleanup aborts the requests
            try:
                await task
            except asyncio.CancelledError:
                pass
            raise ClientDisconnected("client went away; request aborted")
    task.result()  # re-raise an engine failure


def _log_outputs(state: ServingState, request_id: str, choices: list[Choice]) -> None:
    if state.enable_log_outputs:
        for c in choices:
            log.info("Finished request %s choice %d (%s): %s", request_id, c.index, c.finish_reason, state.clip(c.text))


# ------------------------------------------------------------------------------ response shaping
def _usage_flags(state: ServingState, req: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage on every chunk), as vLLM's should_include_usage: the
    server's --enable-force-include-usage turns both on; continuous_usage_stats needs
    include_usage (true by default once stream_options is given)."""
    if state.force_include_usage:
        return True, True
    options = req.stream_options
    if options is None:
        return False, False
    include = bool(options.include_usage)
    return include, include and bool(options.continuous_usage_stats)


def _choice_usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """The usage a chunk carries with continuous_usage_stats: that choice's prompt and its
    tokens so far (vLLM's per-choice figures, not the request's totals)."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _token_text(tokenizer: Tokenizer, token_id: int, entry: Any = None, as_id: bool = False) -> str:
    """A token as logprobs name it: its text, or "token_id:N" (return_tokens_as_token_ids, as
    vLLM: a token that is not valid UTF-8 alone stays identifiable)."""
    if as_id:
        return f"token_id:{token_id}"
    decoded = getattr(entry, "decoded_token", None)
    return decoded if decoded is not None else tokenizer.decode([token_id], skip_special_tokens=False)


def _clamp(logprob: float) -> float:
    return max(logprob, -9999.0)  # -inf is not JSON; OpenAI's floor


def _completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], entries: list[Any], offset: int,
                         num: int, as_ids: bool = False) -> CompletionLogProbs:
    """OpenAI's legacy logprobs, as vLLM builds them. Each entry is the engine's dict for one
    position: the chosen token first, then the top-`num` (a chosen token among them appears
    once). top_logprobs keeps the first num + 1 of the dict, so it always holds the chosen
    token: with logprobs=0 it is {chosen: logprob}."""
    result = CompletionLogProbs()
    for token_id, entry in zip(token_ids, entries):
        chosen = None if entry is None else entry.get(token_id)
        text = _token_text(tokenizer, token_id, chosen, as_ids)
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
        if chosen is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_clamp(chosen.logprob))
        result.top_logprobs.append({_token_text(tokenizer, t, lp, as_ids): _clamp(lp.logprob)
                                    for rank, (t, lp) in enumerate(entry.items()) if rank <= num})
    return result


def _chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], entries: list[Any], num: int,
                   as_ids: bool = False) -> ChatCompletionLogProbs:
    """Chat logprobs, as vLLM builds them: top_logprobs is the first `num` entries of the
    engine's dict in its order (the chosen token first, then the most likely), none for 0."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = None if entry is None else entry.get(token_id)
        text = _token_text(tokenizer, token_id, chosen, as_ids)
        if chosen is None:
            content.append(ChatCompletionLogProbsContent(token=text, bytes=list(text.encode())))
            continue
        top = []
        for rank, (t, lp) in enumerate(entry.items()):
            if rank >= num:
                break
            t_text = _token_text(tokenizer, t, lp, as_ids)
            top.append(ChatCompletionLogProb(token=t_text, logprob=_clamp(lp.logprob), bytes=list(t_text.encode())))
        content.append(ChatCompletionLogProbsContent(token=text, logprob=_clamp(chosen.logprob),
                                                     bytes=list(text.encode()), top_logprobs=top))
    return ChatCompletionLogProbs(content=content)


# ------------------------------------------------------------------------------ completions
async def create_completion(req: CompletionRequest, raw: Request, state: ServingState):
    model = state.check_model(req.model)
    prompts = [state.truncate_prompt(state.tokenizer.encode(p, add_special_tokens=req.add_special_tokens)
                                     if isinstance(p, str) else list(p), req.truncate_prompt_tokens)
               for p in req.prompts]
    params = SamplingParams(**req.to_sampling_kwargs(state.sampling_defaults))
    request_id = completion_id()
    streams, choices = await _admit(state, request_id, prompts, params, req.priority or 0)
    echo, echo_only, want_ids = bool(req.echo), req.echo_without_generation, bool(req.return_token_ids)
    num_logprobs = req.logprobs
    as_ids = state.tokens_as_ids(req.return_tokens_as_token_ids)
    per_prompt = max(1, params.n)

    def echo_text(c: Choice) -> str:
        # vLLM echoes a text prompt as sent and a token prompt decoded; with return_token_ids
        # it echoes no prompt text (the ids say what the prompt was)
        if want_ids:
            return ""
        sent = req.prompts[c.index // per_prompt]
        return sent if isinstance(sent, str) else state.tokenizer.decode(c.prompt_ids, skip_special_tokens=False)

    def prompt_entries(c: Choice) -> list[Any]:
        return list(c.prompt_logprobs) if c.prompt_logprobs is not None else [None] * len(c.prompt_ids)

    def finish_choice(c: Choice) -> CompletionResponseChoice:
        if echo and echo_only:
            text, ids, entries = echo_text(c), c.prompt_ids, prompt_entries(c)
        elif echo:
            text, ids = echo_text(c) + c.text, c.prompt_ids + c.token_ids
            entries = prompt_entries(c) + list(c.logprobs)
        else:
            text, ids, entries = c.text, c.token_ids, c.logprobs
        logprobs = None
        if num_logprobs is not None:
            logprobs = _completion_logprobs(state.tokenizer, ids, entries, 0, num_logprobs, as_ids)
        return CompletionResponseChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                                        stop_reason=c.stop_reason, token_ids=list(c.token_ids) if want_ids else None,
                                        prompt_logprobs=_plain(c.prompt_logprobs),
                                        prompt_token_ids=list(c.prompt_ids) if want_ids else None)

    if not req.stream:
        await _collect(raw, state, streams, choices)
        _log_outputs(state, request_id, choices)
        return JSONResponse(CompletionResponse(id=request_id, model=model, choices=[finish_choice(c) for c in choices],
                                               usage=_usage(prompts, choices)).model_dump())

    include_usage, continuous = _usage_flags(state, req)

    async def events() -> AsyncIterator[str]:
        created = int(time.time())
        text_offsets = [0] * len(choices)  # vLLM: generated text so far (the echoed prompt not counted)
        try:
            async for i, out in _merged(state, streams):
                c = choices[i]
                first = not c.started
                earlier = len(c.token_ids)
                _apply(c, out)
                prompt_ids = None
                if echo and first:
                    # the first chunk of a choice echoes its prompt (vLLM sends the prompt's ids
                    # with it, asked or not)
                    if echo_only:
                        text, ids, entries = echo_text(c), c.prompt_ids, prompt_entries(c)
                    else:
                        text, ids = echo_text(c) + out.new_text, c.prompt_ids + out.new_token_ids
                        entries = prompt_entries(c) + list(out.new_logprobs)
                    prompt_ids = list(c.prompt_ids)
                else:
                    text, ids, entries = out.new_text, out.new_token_ids, out.new_logprobs
                    if first and want_ids:
                        prompt_ids = list(c.prompt_ids)
                    if not text and not ids and not earlier and not out.finished:
                        continue  # nothing to say yet (a prefill step); the choice has not started
                c.started = True
                logprobs = None
                if num_logprobs is not None:
                    logprobs = _completion_logprobs(state.tokenizer, ids, entries, text_offsets[i], num_logprobs,
                                                    as_ids)
                text_offsets[i] += len(out.new_text)
                chunk = CompletionStreamResponse(
                    id=request_id, created=created, model=model,
                    choices=[CompletionResponseStreamChoice(
                        index=i, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason, prompt_token_ids=prompt_ids,
                        token_ids=list(out.new_token_ids) if want_ids else None)])
                if continuous:
                    chunk.usage = _choice_usage(len(c.prompt_ids), len(c.token_ids))
                yield sse_event(chunk)
            if include_usage:
                final = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                 usage=_usage(prompts, choices))
                yield sse_event(final.model_dump_json(exclude_none=True))
            _log_outputs(state, request_id, choices)
        except Exception as err:  # mid-stream failure: report it in-band, as vLLM does
            log.exception("stream %s failed", request_id)
            yield sse_event({"error": {"message": str(err), "type": "InternalServerError", "code": 500}})
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream")


def _plain(entries: list[Any] | None) -> list[Any] | None:
    """prompt_logprobs as JSON: [None, {token_id: {logprob, rank, decoded_token}}, ...]."""
    if entries is None:
        return None
    return [None if e is None else {str(t): dataclasses.asdict(lp) for t, lp in e.items()} for e in entries]


# ------------------------------------------------------------------------------ chat
def render_chat_prompt(state: ServingState, req: ChatCompletionRequest) -> list[int]:
    return state.tokenizer.encode(render_chat_text(state, req), add_special_tokens=req.add_special_tokens)


def render_chat_text(state: ServingState, req: ChatCompletionRequest) -> str:
    messages = req.template_messages()
    kwargs = {**state.default_chat_template_kwargs, **dict(req.chat_template_kwargs or {})}
    if req.tools:  # as transformers' apply_chat_template(tools=...): the template writes them
        kwargs["tools"] = req.tools
    text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
    if req.continue_final_message:
        # As transformers: cut the render right after the final message's own text, so
        # the model continues that message instead of closing the turn.
        final = messages[-1].get("content") or ""
        if isinstance(final, str) and final and final.strip() in text:
            text = text[: text.rindex(final.strip()) + len(final.strip())]
    return text


def chat_sampling_params(state: ServingState, req: ChatCompletionRequest, prompt_text: str) -> SamplingParams:
    """The request's SamplingParams, with what the server's parsers add: a grammar starts after
    the reasoning section (as vLLM), and a tool parser whose call markers are special tokens
    keeps them in the text."""
    kwargs = req.to_sampling_kwargs(state.sampling_defaults)
    mode = tool_mode(req, state.tool_parser)
    if mode == "none" and req.tools and req.effective_tool_choice == "auto" and req.tool_functions():
        # named by what the request sent: tools alone get vLLM's default tool_choice, "auto"
        field = "tool_choice" if req.tool_choice is not None else "tools"
        raise BadRequestError(f'{field}: "auto" tool choice (vLLM\'s default with tools) requires '
                              "--enable-auto-tool-choice and --tool-call-parser to be set; use tool_choice "
                              "'required', a named function or 'none', or start the server with both", param=field)
    if mode == "auto" and state.tool_parser.needs_special_tokens:
        kwargs["skip_special_tokens"] = False
    grammar = kwargs.get("structured_outputs")
    if grammar is not None and state.reasoning_parser is not None and not state.grammar_in_reasoning:
        # the thinking is free; the grammar takes the answer (a prompt that closed the section,
        # Qwen3 with thinking off, has no reasoning to wait for)
        kwargs["structured_outputs"] = {**grammar, "starts_after": REASONING_END,
                                        "reasoning_ended": prompt_text.rstrip().endswith(REASONING_END)}
    return SamplingParams(**kwargs)


async def create_chat_completion(req: ChatCompletionRequest, raw: Request, state: ServingState):
    model = state.check_model(req.model)
    prompt_text = render_chat_text(state, req)
    prompt_ids = state.truncate_prompt(state.tokenizer.encode(prompt_text, add_special_tokens=req.add_special_tokens),
                                       req.truncate_prompt_tokens)
    params = chat_sampling_params(state, req, prompt_text)
    request_id = chat_completion_id()
    streams, choices = await _admit(state, request_id, [prompt_ids], params, req.priority or 0)
    num_top = req.top_logprobs or 0
    as_ids = state.tokens_as_ids(req.return_tokens_as_token_ids)
    role, echo_text, want_ids = req.response_role, req.echo_text, bool(req.return_token_ids)
    include_reasoning = req.include_reasoning is not False
    shapers = [ChoiceShaper(req, state.reasoning_parser, state.tool_parser, include_reasoning) for _ in choices]

    if not req.stream:
        await _collect(raw, state, streams, choices)
        _log_outputs(state, request_id, choices)
        def message(c: Choice) -> ChatResponseMessage:
            fields, c.finish_reason = shapers[c.index].message(c.text, c.finish_reason)
            if echo_text:
                fields["content"] = echo_text + (fields["content"] or "")
            return ChatResponseMessage(role=role, **fields)

        messages = [message(c) for c in choices]  # before the choices: a forced call may set finish_reason
        result = [ChatCompletionResponseChoice(
            index=c.index, message=messages[c.index],
            logprobs=_chat_logprobs(state.tokenizer, c.token_ids, c.logprobs, num_top, as_ids) if req.logprobs
            else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if want_ids else None) for c in choices]
        return JSONResponse(ChatCompletionResponse(
            id=request_id, model=model, choices=result, usage=_usage([prompt_ids], choices),
            prompt_logprobs=_plain(choices[0].prompt_logprobs),
            prompt_token_ids=list(prompt_ids) if want_ids else None).model_dump())

    include_usage, continuous = _usage_flags(state, req)

    async def events() -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choice: ChatCompletionResponseStreamChoice, completion_tokens: int,
                  with_prompt_ids: bool = False) -> str:
            body = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice])
            if with_prompt_ids:
                body.prompt_token_ids = list(prompt_ids)
            if continuous:
                body.usage = _choice_usage(len(prompt_ids), completion_tokens)
            return sse_event(body, exclude_unset=True)

        started = False
        try:
            async for i, out in _merged(state, streams):
                if not started:
                    # As vLLM, with the request's first output: a role chunk for every choice
                    # (carrying the prompt's ids when asked), then the echoed text for each.
                    started = True
                    for j in range(len(choices)):
                        yield chunk(ChatCompletionResponseStreamChoice(index=j, delta=DeltaMessage(role=role, content="")),
                                    0, with_prompt_ids=want_ids)
                    if echo_text:
                        for j in range(len(choices)):
                            yield chunk(ChatCompletionResponseStreamChoice(index=j, delta=DeltaMessage(content=echo_text)),
                                        0)
                c = choices[i]
                earlier = len(c.token_ids)
                _apply(c, out)
                if not out.new_text and not out.new_token_ids and not earlier and not out.finished:
                    continue  # nothing to say yet (a prefill step)
                logprobs = _chat_logprobs(state.tokenizer, out.new_token_ids, out.new_logprobs, num_top, as_ids) \
                    if req.logprobs else None
                delta = shapers[i].push(out.new_text, final=out.finished)
                if delta is None:
                    if not out.finished and not req.logprobs:
                        continue  # held back: it may still be part of a tag
                    delta = DeltaMessage(content="")
                if out.finished:
                    out.finish_reason = shapers[i].stream_finish(out.finish_reason)
                choice = ChatCompletionResponseStreamChoice(index=i, delta=delta,
                                                            logprobs=logprobs, finish_reason=out.finish_reason)
                if want_ids:
                    choice.token_ids = list(out.new_token_ids)
                if out.finished:
                    choice.stop_reason = out.stop_reason
                yield chunk(choice, len(c.token_ids))
            if include_usage:
                yield sse_event(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                             usage=_usage([prompt_ids], choices)).model_dump_json(
                                                                 exclude_unset=True, exclude_none=True))
            _log_outputs(state, request_id, choices)
        except Exception as err:
            log.exception("stream %s failed", request_id)
            yield sse_event({"error": {"message": str(err), "type": "InternalServerError", "code": 500}})
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream")
