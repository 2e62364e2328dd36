"""Request and response bodies of the OpenAI-compatible HTTP API, with vLLM's extra fields.

Unknown fields are ignored, as vLLM does (its request models allow extra fields and log the names
they ignored): a field no request model here declares, at the top level or inside a message, a
content part or stream_options, is dropped before anything reads the request, and one warning per
request names every such field (with its path, e.g. "messages[0].cache_control"). A value of the
wrong JSON type or out of range in a declared field is refused by name (pydantic raises;
serving/errors.py turns that into a 400 with an OpenAI error body). A few fields that vLLM or OpenAI
define but this server does not implement are refused with a message saying so, unless they carry
their no-op value (`"use_beam_search": false` is accepted).

Structured output: response_format (json_object, json_schema, structural_tag), structured_outputs
and the older guided_* fields, and a forced tool choice, become one grammar spec
(serving/structured_output.py) in SamplingParams.structured_outputs; more than one constraint,
or one the grammar engine cannot use, is a 400 naming the field.

`to_sampling_kwargs()` maps a request onto keyword arguments for runtime.sampling_params.
SamplingParams, following vLLM's `to_sampling_params`: fields the request leaves unset take the
model's generation_config defaults (passed in as `defaults`), then vLLM's fallbacks.

max_tokens, as vLLM's serving code and SamplingParams treat it:
- /v1/completions: absent means 16 (vLLM's CompletionRequest default). /v1/chat/completions:
  absent means unset; max_completion_tokens, when not null, is used instead of max_tokens
  (even when it is 0 or negative: then it is refused, whatever max_tokens says).
- null means unset: up to max_model_len minus the prompt, or generation_config's max_new_tokens
  when the model has one (a default the request overrides, as vLLM's get_max_tokens uses it,
  not a cap).
- 0 or negative is refused with a 400 ("max_tokens: must be at least 1, got 0"), as vLLM's
  SamplingParams refuses it. The one exception is vLLM's prompt scoring idiom on
  /v1/completions: echo=true with max_tokens=0 generates nothing visible (the engine runs one
  token, so that prompt_logprobs get computed, and the server returns only the prompt; see
  CompletionRequest.echo_without_generation).
"""
from __future__ import annotations

import json
import logging
import math
import time
import uuid
from typing import Any, ClassVar, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vtool.runtime.serving.structured_output import request_grammar, tool_call_grammar

log = logging.getLogger("vtool.server")

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: the most logprobs / top_logprobs / prompt_logprobs
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
MAX_LOGIT_BIAS = 100.0  # vLLM clamps logit_bias values into [-100, 100], as OpenAI bounds them
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

# vLLM's fallbacks for sampling fields that neither the request nor generation_config set.
DEFAULT_SAMPLING: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def random_uuid() -> str:
    return uuid.uuid4().hex


def completion_id() -> str:
    return f"cmpl-{random_uuid()}"


def chat_completion_id() -> str:
    return f"chatcmpl-{random_uuid()}"


def _now() -> int:
    return int(time.time())


# ============================================================================ request bodies


class _Request(BaseModel):
    """A request body: unknown fields ignored (and named in a warning), declared fields strict
    (no str->number or bool->int coercion, no NaN)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    # name -> (no-op values that are silently accepted, why any other value is refused)
    _UNSUPPORTED: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {}
    # True for the body of an endpoint: it logs, once, every ignored field of the request
    _LOG_IGNORED: ClassVar[bool] = False
    _ignored: tuple[str, ...] = ()  # this object's own unknown keys, as sent

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored(cls, data: Any, handler: Any) -> Any:
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, _Request):
            known = _known_names(cls)
            model._ignored = tuple(str(k) for k in data if k not in known)
            if cls._LOG_IGNORED:
                names = model.ignored_fields()
                if names:
                    log.warning("Request fields ignored (not parameters this server reads): %s", ", ".join(names))
        return model

    def ignored_fields(self) -> list[str]:
        """Every field of the request as sent that was ignored, nested ones with their path."""
        out = list(self._ignored)
        for name in type(self).model_fields:
            out += _nested_ignored(getattr(self, name, None), name)
        return out

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls._UNSUPPORTED:
            return data
        problems, kept = [], dict(data)
        for name, (noops, why) in cls._UNSUPPORTED.items():
            if name not in data:
                continue
            value = data[name]
            if any(value is v or (type(value) is type(v) and value == v) for v in noops):
                del kept[name]
            else:
                problems.append(f"{name}: {why}")
        if problems:
            raise ValueError("; ".join(problems))
        return kept


_KNOWN_NAMES: dict[type, frozenset[str]] = {}


def _known_names(model: type[_Request]) -> frozenset[str]:
    """The keys `model` reads: its fields, their aliases and the refused-unless-no-op names."""
    names = _KNOWN_NAMES.get(model)
    if names is None:
        found = set(model._UNSUPPORTED)
        for name, field in model.model_fields.items():
            found.add(name)
            if field.alias:
                found.add(field.alias)
        names = _KNOWN_NAMES[model] = frozenset(found)
    return names


def _nested_ignored(value: Any, path: str) -> list[str]:
    if isinstance(value, _Request):
        return [f"{path}.{name}" for name in value.ignored_fields()]
    if isinstance(value, list):
        out: list[str] = []
        for i, item in enumerate(value):
            out += _nested_ignored(item, f"{path}[{i}]")
        return out
    return []


_BEAM = "beam search is not supported by this server"
_MULTIMODAL = "this server is text-only"

_COMMON_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "guided_whitespace_pattern": ((None,), "a custom JSON whitespace pattern is not supported by this server "
                                           "(structured_outputs.disable_any_whitespace gives compact JSON)"),
    "structural_tag": ((None,), "the top-level structural_tag field is not supported; send it as "
                                "response_format {\"type\": \"structural_tag\", ...} or structured_outputs.structural_tag"),
    "use_beam_search": ((None, False), _BEAM),
    "length_penalty": ((None, 1.0, 1), _BEAM),
    "logits_processors": ((None, []), "custom logits processors are not supported by this server"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported by this server yet"),
    "bad_words": ((None, []), "bad_words is not supported by this server yet"),
    "cache_salt": ((None,), "cache_salt is not supported by this server"),
    "kv_transfer_params": ((None,), "KV transfer is not supported by this server"),
    "vllm_xargs": ((None,), "vllm_xargs is not supported by this server"),
    "mm_processor_kwargs": ((None,), _MULTIMODAL),
    "prompt_embeds": ((None,), "prompt embeddings are not supported by this server"),
    # OpenAI fields with nothing to do here
    "store": ((None, False), "storing completions is not supported by this server"),
    "metadata": ((None,), "metadata is only meaningful with store, which this server does not support"),
    "service_tier": ((None, "auto", "default"), "service tiers are not supported by this server"),
}


class StreamOptions(_Request):
    include_usage: Optional[bool] = True
    continuous_usage_stats: Optional[bool] = False


class ResponseFormat(_Request):
    """OpenAI's response_format: text, json_object, json_schema ({name, schema, strict}), or vLLM's
    structural_tag ({structures, triggers}). Checked as a whole by structured_output.request_grammar."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[dict[str, Any]] = None
    structures: Optional[list[Any]] = None
    triggers: Optional[list[str]] = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: Optional[Union[dict[str, Any], str, bool]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Union[dict[str, Any], str]] = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None


def _check_response_format(value: Any) -> Any:
    if isinstance(value, dict) and "type" in value and value["type"] not in (
            "text", "json_object", "json_schema", "structural_tag"):
        raise ValueError(f"unknown type {value['type']!r}; one of text, json_object, json_schema, structural_tag")
    return value


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        items = [] if value is None else [value]
    elif isinstance(value, list) and all(isinstance(s, str) for s in value):
        items = value
    else:
        raise ValueError("must be a string or a list of strings")
    if any(s == "" for s in items):
        raise ValueError("stop cannot contain an empty string")
    return value


def _check_token_ids(value: Any, what: str = "token ids") -> Any:
    if value is None:
        return value
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"must be a list of integer {what}")
    if any(t < 0 for t in value):
        raise ValueError(f"{what} must be >= 0, got {min(value)}")
    return value


def _check_logit_bias(value: Any) -> Any:
    if value is None:
        return value
    if not isinstance(value, dict):
        raise ValueError('must be an object mapping token ids to biases, e.g. {"50256": -100}')
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"key {key!r} is not an integer token id") from None
        if token < 0:
            raise ValueError(f"key {key!r}: token ids must be >= 0")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(f"value for token {key!r} must be a finite number, got {bias!r}")
    return value


def check_truncate_prompt_tokens(value: Optional[int]) -> Optional[int]:
    """vLLM's truncate_prompt_tokens: -1 (the context) or a positive count of the prompt's last
    tokens; 0 is refused here (it would leave no prompt), as are counts below -1."""
    if value is not None and (value == 0 or value < -1):
        raise ValueError(f"truncate_prompt_tokens: must be -1 (keep as much as the context holds) or a positive "
                         f"number of the prompt's last tokens to keep, got {value}")
    return value


def _check_max_tokens(field: str, value: Optional[int]) -> None:
    """vLLM's SamplingParams check, which its serving code reaches with the request's value."""
    if value is not None and value < 1:
        raise ValueError(f"{field}: must be at least 1, got {value}")


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's)."""

    model: Optional[str] = None
    frequency_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    max_tokens: Optional[int] = None  # null: unset; < 1: refused (see the module docstring)
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: Optional[int] = Field(None, ge=1)
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    user: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    # vLLM's extra sampling parameters
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0)
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    priority: int = 0
    request_id: Optional[str] = None
    # vLLM: the response carries token_ids (generated) and prompt_token_ids
    return_token_ids: Optional[bool] = None
    # vLLM: only the prompt's last k tokens (-1: as many as the context holds); checked against
    # max_model_len by the server (ServingState.truncate_prompt)
    truncate_prompt_tokens: Optional[int] = None
    # vLLM: logprobs name each token "token_id:N" (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: Optional[bool] = None
    # structured output: vLLM's structured_outputs, and the guided_* fields older clients send
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    _UNSUPPORTED = _COMMON_UNSUPPORTED
    _grammar: Optional[dict[str, Any]] = None  # the GrammarSpec's fields, set by _check_common

    _check_stop = field_validator("stop", mode="before")(_check_stop)
    _check_stop_ids = field_validator("stop_token_ids", mode="before")(_check_token_ids)
    _check_bias = field_validator("logit_bias", mode="before")(_check_logit_bias)
    _check_format = field_validator("response_format", mode="before")(_check_response_format)
    _check_truncate = field_validator("truncate_prompt_tokens")(check_truncate_prompt_tokens)

    @model_validator(mode="after")
    def _check_common(self):
        self._check_max_tokens()
        self._grammar = request_grammar(self)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.prompt_logprobs and self.stream:
            raise ValueError("prompt_logprobs: not available when stream is true")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: must be unset or equal to n={self.n}, got {self.best_of} "
                             "(best_of > n is not supported, as in vLLM V1)")
        limit = self.effective_max_tokens
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens: must be <= max_tokens={limit}, got {self.min_tokens}")
        return self

    def _check_max_tokens(self) -> None:
        _check_max_tokens("max_tokens", self.max_tokens)

    @property
    def effective_max_tokens(self) -> Optional[int]:
        """The requested generation limit; None when unset."""
        return self.max_tokens

    def _logprob_kwargs(self) -> tuple[Optional[int], Optional[int]]:
        raise NotImplementedError

    def to_sampling_kwargs(self, defaults: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
        """Keyword arguments for SamplingParams.

        `defaults` is the model's generation_config-derived defaults (keys temperature, top_p,
        top_k, min_p, repetition_penalty; max_tokens or max_new_tokens). A field the request
        leaves unset takes defaults[field], then vLLM's fallback (DEFAULT_SAMPLING). A default
        max_tokens is used when the request's is unset (null), as vLLM's get_max_tokens falls
        back to it; it does not cap a limit the request sets.
        """
        defaults = dict(defaults or {})
        resolved = {}
        for name, fallback in DEFAULT_SAMPLING.items():
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            resolved[name] = fallback if value is None else value
        max_tokens = self.effective_max_tokens
        default_max = defaults.get("max_tokens", defaults.get("max_new_tokens"))
        if max_tokens is None and default_max is not None and default_max > 0:
            max_tokens = default_max
        logprobs, prompt_logprobs = self._logprob_kwargs()
        stop = self.stop
        return {
            "n": self.n,
            "best_of": self.best_of,
            "presence_penalty": 0.0 if self.presence_penalty is None else self.presence_penalty,
            "frequency_penalty": 0.0 if self.frequency_penalty is None else self.frequency_penalty,
            "repetition_penalty": resolved["repetition_penalty"],
            "temperature": resolved["temperature"],
            "top_p": resolved["top_p"],
            "top_k": resolved["top_k"],
            "min_p": resolved["min_p"],
            "seed": self.seed,
            "stop": [] if stop is None else [stop] if isinstance(stop, str) else list(stop),
            "stop_token_ids": list(self.stop_token_ids or []),
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "ignore_eos": self.ignore_eos,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "logit_bias": (None if self.logit_bias is None else
                           {int(k): max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(v)))
                            for k, v in self.logit_bias.items()}),
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "structured_outputs": self._grammar,
        }


# ---------------------------------------------------------------------------- /v1/completions


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    _LOG_IGNORED = True

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16  # vLLM's CompletionRequest default; null: unset
    echo: Optional[bool] = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Optional[str] = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        shape = ("must be a string, a list of strings, a list of token ids, "
                 "or a list of token-id lists")
        if isinstance(value, str):
            if value == "":
                raise ValueError("must not be empty")
            return value
        if not isinstance(value, list):
            raise ValueError(shape)
        if not value:
            raise ValueError("must not be an empty list")
        if all(isinstance(p, str) for p in value):
            if any(p == "" for p in value):
                raise ValueError(f"prompt {[p for p in value].index('')} of the list is empty")
            return value
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            _check_token_ids(value)
            return value
        if all(isinstance(p, list) for p in value):
            for i, ids in enumerate(value):
                if not ids:
                    raise ValueError(f"token-id list {i} is empty")
                try:
                    _check_token_ids(ids)
                except ValueError as e:
                    raise ValueError(f"token-id list {i}: {e}") from None
            return value
        raise ValueError(shape)

    @field_validator("suffix", mode="after")
    @classmethod
    def _refuse_suffix(cls, value: Optional[str]) -> Optional[str]:
        if value:
            raise ValueError("suffix (insertion / fill-in-the-middle) is not supported by this server")
        return value

    @property
    def echo_without_generation(self) -> bool:
        """echo=true with max_tokens=0: vLLM's prompt-scoring idiom. The engine runs with
        max_tokens=1 (so prompt_logprobs get computed) and the server returns only the prompt."""
        return bool(self.echo) and self.max_tokens == 0

    def _check_max_tokens(self) -> None:
        if not self.echo_without_generation:
            _check_max_tokens("max_tokens", self.max_tokens)

    @property
    def effective_max_tokens(self) -> Optional[int]:
        # echo without generation: the one token vLLM runs (min_tokens is checked against it)
        return 1 if self.echo_without_generation else self.max_tokens

    @property
    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt as a list of prompts (each a string or a list of token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def _logprob_kwargs(self) -> tuple[Optional[int], Optional[int]]:
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return self.logprobs, prompt_logprobs



# ----------------------------------------------------------------------- /v1/chat/completions

_MEDIA_PARTS = {
    "image_url": "images are", "input_image": "images are", "image": "images are",
    "image_embeds": "images are", "image_pil": "images are", "input_audio": "audio is",
    "audio_url": "audio is", "audio": "audio is", "video_url": "video is", "video": "video is",
    "file": "files are", "input_file": "files are",
}


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


def _check_content(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts like {'type': 'text', 'text': '...'}")
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise ValueError(f"part {i} must be an object like {{'type': 'text', 'text': '...'}}")
        kind = part.get("type")
        if kind == "text":
            continue
        if kind in _MEDIA_PARTS:
            raise ValueError(f"part {i} has type {kind!r}: {_MEDIA_PARTS[kind]} not supported "
                             f"({_MULTIMODAL}; only 'text' parts are accepted)")
        if kind == "refusal":
            raise ValueError(f"part {i} has type 'refusal', which is not supported; only 'text' parts are accepted")
        raise ValueError(f"part {i} has unknown type {kind!r}; only 'text' parts are accepted")
    return value


class ChatMessage(_Request):
    """One message of a chat conversation (request side)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # replayed assistant turns; rendered by the template
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    # What the openai client echoes back when a response message is appended to the history.
    refusal: Optional[str] = None
    annotations: Optional[list[Any]] = None
    audio: None = None
    function_call: None = None

    _check_content = field_validator("content", mode="before")(_check_content)

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: required for a {self.role!r} message")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only allowed on an 'assistant' message, not {self.role!r}")
        return self

    def text(self) -> Optional[str]:
        """The content as one string (text parts joined with newlines, as vLLM does)."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def to_template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (content flattened to a string; tool-call
        arguments given as JSON strings decoded to objects, as vLLM does for HF templates)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            calls = []
            for call in self.tool_calls:
                call = dict(call)
                fn = call.get("function")
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    fn = dict(fn)
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                    call["function"] = fn
                calls.append(call)
            out["tool_calls"] = calls
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        return out


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [m.to_template_dict() for m in messages]


def _check_messages(value: Any) -> Any:
    if isinstance(value, list) and not value:
        raise ValueError("must contain at least one message")
    return value


class _ChatTemplateFields(_Request):
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="before")
    @classmethod
    def _generation_prompt(cls, data: Any) -> Any:
        # vLLM refuses both set to true; with add_generation_prompt left at its default,
        # continue_final_message wins (the default is only a default).
        if isinstance(data, dict) and data.get("continue_final_message") is True:
            if data.get("add_generation_prompt") is True:
                raise ValueError("continue_final_message: cannot be true together with "
                                 "add_generation_prompt=true")
            if "add_generation_prompt" not in data:
                data = {**data, "add_generation_prompt": False}
        return data


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    """POST /v1/chat/completions."""

    _LOG_IGNORED = True

    messages: list[ChatMessage]
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: Optional[int] = None  # used instead of max_tokens when not null
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None
    echo: bool = False  # vLLM: prepend the last message when it has the response's role
    add_special_tokens: bool = False

    _UNSUPPORTED = {
        **_COMMON_UNSUPPORTED,
        "chat_template": ((None,), "a per-request chat_template is not supported by this server"),
        "documents": ((None,), "documents (RAG templates) are not supported by this server"),
        "reasoning_effort": ((None,), "reasoning_effort is not supported by this server"),
        "modalities": ((None, ["text"]), _MULTIMODAL),
        "audio": ((None,), _MULTIMODAL),
        "prediction": ((None,), "predicted outputs are not supported by this server"),
        "web_search_options": ((None,), "web search is not supported by this server"),
    }

    include_reasoning: Optional[bool] = True  # vLLM: False leaves the reasoning out of the answer

    _check_messages = field_validator("messages", mode="before")(_check_messages)

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.functions:
            raise ValueError("functions: function calling is not supported by this server")
        if self.function_call not in (None, "none"):
            raise ValueError("function_call: function calling is not supported by this server")
        self._tool_grammar()
        return self

    def tool_functions(self) -> dict[str, dict[str, Any]]:
        """The request's tools by name (their `function` objects), checked."""
        functions: dict[str, dict[str, Any]] = {}
        for i, tool in enumerate(self.tools or []):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., "
                                 "'parameters': {...}}}}")
            params = fn.get("parameters", {"type": "object"})
            if not isinstance(params, dict):
                raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")
            functions[fn["name"]] = fn
        return functions

    @property
    def effective_tool_choice(self) -> Union[str, dict[str, Any]]:
        """vLLM's default: "auto" with tools, "none" without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def named_tool(self) -> Optional[str]:
        choice = self.tool_choice
        return choice.get("function", {}).get("name") if isinstance(choice, dict) else None

    def _tool_grammar(self) -> None:
        grammar = tool_call_grammar(self)
        if grammar is not None:
            self._grammar = grammar

    def _check_max_tokens(self) -> None:
        if self.max_completion_tokens is not None:
            _check_max_tokens("max_completion_tokens", self.max_completion_tokens)
        else:
            _check_max_tokens("max_tokens", self.max_tokens)

    @property
    def effective_max_tokens(self) -> Optional[int]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return messages_to_dicts(self.messages)

    @property
    def response_role(self) -> str:
        """The role of the answer, as vLLM's get_chat_request_role: the assistant's after a
        generation prompt; without one (continue_final_message, or add_generation_prompt=false)
        the model goes on with the last message, so the answer has that message's role."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    @property
    def echo_text(self) -> str:
        """What echo=true puts before the generated text: the last message's content when that
        message has the response's role (with continue_final_message: the message being
        continued), else nothing."""
        last = self.messages[-1]
        if not self.echo or last.role != self.response_role:
            return ""
        return last.text() or ""

    def _logprob_kwargs(self) -> tuple[Optional[int], Optional[int]]:
        top = self.top_logprobs or 0
        logprobs = top if self.logprobs else None
        prompt_logprobs = self.prompt_logprobs
        # vLLM asks for prompt logprobs (top_logprobs of them, 0 by default) whenever echo is
        # set and returns them in a non-streamed response; a stream never carries them.
        if prompt_logprobs is None and self.echo and not self.stream:
            prompt_logprobs = top
        return logprobs, prompt_logprobs


# ============================================================================ response bodies


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Chunk(_Response):
    """A streamed piece: `_ALWAYS` fields count as set, so that model_dump(exclude_unset=True)
    (how vLLM writes chat chunks, so a delta carries only what it sets) still writes them."""

    _ALWAYS: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _mark_always_set(self):
        self.__pydantic_fields_set__.update(self._ALWAYS)
        return self


class ErrorInfo(_Response):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(_Response):
    error: ErrorInfo


class PromptTokenUsageInfo(_Response):
    cached_tokens: Optional[int] = None


class UsageInfo(_Chunk):
    _ALWAYS = ("prompt_tokens", "total_tokens", "completion_tokens")

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: Optional[int] = 0
    prompt_tokens_details: Optional[PromptTokenUsageInfo] = None


class CompletionLogProbs(_Response):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None  # the stop string or token id that ended it
    token_ids: Optional[list[int]] = None  # return_token_ids: the generated ids
    prompt_logprobs: Optional[list[Optional[dict[str, Any]]]] = None
    prompt_token_ids: Optional[list[int]] = None  # return_token_ids: this choice's prompt


class CompletionResponse(_Response):
    id: str = Field(default_factory=completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    system_fingerprint: Optional[str] = None
    usage: UsageInfo


class CompletionResponseStreamChoice(_Chunk):
    _ALWAYS = ("index", "text", "logprobs", "finish_reason")

    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_token_ids: Optional[list[int]] = None  # the first chunk of a choice (return_token_ids, or echo)
    token_ids: Optional[list[int]] = None  # return_token_ids: this chunk's new ids


class CompletionStreamResponse(_Chunk):
    _ALWAYS = ("id", "object", "created", "model", "choices")

    id: str = Field(default_factory=completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


class ChatCompletionLogProb(_Response):
    token: str
    logprob: float = -9999.0
    bytes: Optional[list[int]] = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(_Response):
    content: Optional[list[ChatCompletionLogProbsContent]] = None


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    reasoning: Optional[str] = None  # current vLLM's field (it was reasoning_content)


class ChatCompletionResponseChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = "stop"
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None  # return_token_ids: the generated ids


class ChatCompletionResponse(_Response):
    id: str = Field(default_factory=chat_completion_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    system_fingerprint: Optional[str] = None
    usage: UsageInfo
    prompt_logprobs: Optional[list[Optional[dict[str, Any]]]] = None
    prompt_token_ids: Optional[list[int]] = None  # return_token_ids


class DeltaMessage(_Response):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseStreamChoice(_Chunk):
    _ALWAYS = ("index", "delta", "logprobs", "finish_reason")

    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None  # return_token_ids: this chunk's new ids


class ChatCompletionStreamResponse(_Chunk):
    _ALWAYS = ("id", "object", "created", "model", "choices")

    id: str = Field(default_factory=chat_completion_id)
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = None  # return_token_ids: on the role chunks


SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: Union[BaseModel, dict, str], exclude_unset: bool = False) -> str:
    """One server-sent event carrying `payload` as JSON ("data: {...}\\n\\n").

    vLLM writes chat chunks with exclude_unset=True (a delta carries only what it sets) and
    completion chunks in full."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude_unset=exclude_unset)
    elif isinstance(payload, str):
        body = payload
    else:
        body = json.dumps(payload, ensure_ascii=False)
    return f"data: {body}\n\n"


# ---------------------------------------------------------------------------- /v1/models


class ModelPermission(_Response):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=_now)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: Optional[str] = None
    is_blocking: bool = False


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "vtool"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------- /tokenize, /detokenize


class TokenizeRequest(_ChatTemplateFields):
    """POST /tokenize: exactly one of `prompt` (text) or `messages` (rendered by the chat template).

    add_special_tokens defaults as in vLLM: true for a prompt, false for messages (the chat
    template adds its own)."""

    _LOG_IGNORED = True

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None
    return_token_strs: Optional[bool] = False
    tools: Optional[list[dict[str, Any]]] = None

    _check_messages = field_validator("messages", mode="before")(_check_messages)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        if self.add_special_tokens is None:
            self.add_special_tokens = self.prompt is not None
        return self

    def template_messages(self) -> Optional[list[dict[str, Any]]]:
        return None if self.messages is None else messages_to_dicts(self.messages)


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(_Request):
    _LOG_IGNORED = True

    model: Optional[str] = None
    tokens: list[int]

    _check_tokens = field_validator("tokens", mode="before")(_check_token_ids)


class DetokenizeResponse(_Response):
    prompt: str


# ----------------------------------------------------------------- allowed ranges, for messages


def _num(x: Any) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _field_ranges() -> dict[str, str]:
    """Field name -> its accepted range ("[0, 2]", "(0, 1]", ">= 0"), from the request models."""
    ranges: dict[str, str] = {}
    for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest):
        for name, field in model.model_fields.items():
            low = high = None
            for m in field.metadata:
                for attr, side in (("ge", "["), ("gt", "("), ("le", "]"), ("lt", ")")):
                    bound = getattr(m, attr, None)
                    if bound is not None:
                        if side in "[(":
                            low = (side, bound)
                        else:
                            high = (side, bound)
            if low and high:
                ranges[name] = f"{low[0]}{_num(low[1])}, {_num(high[1])}{high[0]}"
            elif low:
                ranges[name] = (">= " if low[0] == "[" else "> ") + _num(low[1])
            elif high:
                ranges[name] = ("<= " if high[0] == "]" else "< ") + _num(high[1])
    return ranges


FIELD_RANGES: dict[str, str] = _field_ranges()


__all__ = [
    "FIELD_RANGES", 
    "MAX_LOGPROBS", "DEFAULT_SAMPLING", "SSE_DONE", "random_uuid", "completion_id", "chat_completion_id",
    "sse_event", "messages_to_dicts",
    "StreamOptions", "ResponseFormat", "StructuredOutputs", "TextContentPart", "ChatMessage",
    "CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest",
    "ErrorInfo", "ErrorResponse", "UsageInfo", "PromptTokenUsageInfo",
    "CompletionLogProbs", "CompletionResponseChoice", "CompletionResponse",
    "CompletionResponseStreamChoice", "CompletionStreamResponse",
    "ChatCompletionLogProb", "ChatCompletionLogProbsContent", "ChatCompletionLogProbs",
    "ChatResponseMessage", "ChatCompletionResponseChoice", "ChatCompletionResponse",
    "DeltaMessage", "ChatCompletionResponseStreamChoice", "ChatCompletionStreamResponse",
    "ModelPermission", "ModelCard", "ModelList", "TokenizeResponse", "DetokenizeResponse",
]
