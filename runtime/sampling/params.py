"""Per-request sampling parameters with vLLM's field names, defaults and accepted ranges.

A request sent to vLLM and to vtool with the same fields should be accepted or refused
the same way, and sample from the same distribution. Every refusal names the field, the
value seen and the range accepted (SamplingParamsError, a VtoolError).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from typing import Any

from vtool import VtoolError

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: below this temperature, sampling is greedy
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: smaller positive temperatures are raised to it
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
MAX_LOGIT_BIAS = 100.0  # the OpenAI API's bound on a logit_bias value
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


class SamplingParamsError(VtoolError):
    """One invalid sampling parameter; `field` names it."""

    def __init__(self, field: str, value: Any, accepted: str, seen: str | None = None):
        self.field, self.value = field, value
        seen = seen or f"{field}={value!r} is invalid"
        super().__init__(f"sampling parameter {seen}: {field} must be {accepted}")


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None or <= 0: up to the context length (the engine resolves it)
    min_tokens: int = 0
    logprobs: int | None = None  # -1: the whole vocabulary
    prompt_logprobs: int | None = None  # -1: the whole vocabulary
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # A grammar the output must follow (vLLM's structured_outputs). Given as vLLM's
    # StructuredOutputsParams fields ({"json": schema} or regex, choice, grammar, json_object,
    # structural_tag; disable_any_whitespace), it is kept as the fields of a
    # runtime.sampling.grammar.GrammarSpec (kind, source, any_whitespace, field): plain data that
    # crosses to the engine core, which compiles it.
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # The same normalisations vLLM applies before checking.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))  # vLLM drops repeats
        if self.seed == -1 and not isinstance(self.seed, bool):
            self.seed = None
        # Booleans as vLLM reads them: True asks for the sampled token's logprob plus the top 1.
        if isinstance(self.logprobs, bool):
            self.logprobs = 1 if self.logprobs else None
        if isinstance(self.prompt_logprobs, bool):
            self.prompt_logprobs = 1 if self.prompt_logprobs else None
        if isinstance(self.structured_outputs, dict) and "kind" not in self.structured_outputs:
            self.structured_outputs = grammar_spec_fields(self.structured_outputs)
        if self.logit_bias is not None and isinstance(self.logit_bias, dict):
            # JSON object keys arrive as strings ("50256": 5.0), as in vLLM's from_optional.
            self.logit_bias = {_int_key(k): v for k, v in self.logit_bias.items()}
        self.validate()

    # ---- derived values -------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_temperature(self) -> float:
        """The temperature random sampling divides by (vLLM raises tiny ones to 0.01)."""
        return max(float(self.temperature), MIN_TEMPERATURE)

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    def for_child(self, index: int) -> SamplingParams:
        """Params of the index-th of n parallel samples, as vLLM's ParentRequest makes them:
        n=1 and, when seeded, seed + index so the n samples differ but stay reproducible."""
        child = copy.deepcopy(self)
        child.n = 1
        child.best_of = None
        if self.seed is not None:
            child.seed = self.seed + index
        return child

    # ---- validation -------------------------------------------------------------------

    def validate(self, vocab_size: int | None = None, max_logprobs: int | None = None) -> None:
        """Raise SamplingParamsError for the first invalid field.

        `vocab_size` enables the checks that need the model (token ids inside the
        vocabulary, logprobs no larger than it); `max_logprobs` is the server's cap on
        logprobs/prompt_logprobs (vLLM's --max-logprobs, -1 = the vocabulary).
        """
        so = self.structured_outputs
        if so is not None and not (isinstance(so, dict) and isinstance(so.get("kind"), str)
                                   and isinstance(so.get("source", ""), str)):
            raise SamplingParamsError("structured_outputs", so, "None or a grammar spec {kind, source, ...}")
        _int("n", self.n, low=1, high=MAX_N)
        if self.best_of is not None:
            _int("best_of", self.best_of, low=1)
            if self.best_of != self.n:
                # best_of > n keeps the n best of best_of samples: not implemented (nor in vLLM V1);
                # best_of < n is refused by vLLM too.
                raise SamplingParamsError("best_of", self.best_of, f"None or equal to n={self.n}")
        _real("presence_penalty", self.presence_penalty, "a number in [-2, 2]", -2.0, 2.0)
        _real("frequency_penalty", self.frequency_penalty, "a number in [-2, 2]", -2.0, 2.0)
        _real("repetition_penalty", self.repetition_penalty, "a finite number > 0", 0.0, math.inf,
              low_open=True)
        _real("temperature", self.temperature, "a number in [0, 2] (0 = greedy)", 0.0, 2.0)
        _real("top_p", self.top_p, "a number in (0, 1]", 0.0, 1.0, low_open=True)
        _int("top_k", self.top_k, low=-1, accepted="an integer: 0 or -1 (off), or at least 1")
        _real("min_p", self.min_p, "a number in [0, 1]", 0.0, 1.0)
        if self.greedy and self.n > 1:
            raise SamplingParamsError("n", self.n, "1 when sampling is greedy (temperature < 1e-5)")
        if self.seed is not None:
            _int("seed", self.seed, low=_SEED_RANGE[0], high=_SEED_RANGE[1])
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, accepted="an integer or None (None or <= 0: up to the context)")
        _int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.max_tokens > 0 and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens", self.min_tokens, f"<= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _int(name, value, low=-1, accepted="None, -1 (the whole vocabulary) or an integer >= 0")
            if vocab_size is not None and value > vocab_size:
                raise SamplingParamsError(name, value, f"-1 or at most the vocabulary size {vocab_size}")
            if max_logprobs is not None and max_logprobs != -1:
                over = value > max_logprobs or (value == -1 and (vocab_size is None or vocab_size > max_logprobs))
                if over:
                    raise SamplingParamsError(name, value, f"at most the server's max_logprobs={max_logprobs}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise SamplingParamsError("stop", self.stop, "a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise SamplingParamsError("stop", self.stop, "non-empty strings (an empty stop string matches at once)")
        if not isinstance(self.stop_token_ids, list):
            raise SamplingParamsError("stop_token_ids", self.stop_token_ids, "a list of token ids")
        for token in self.stop_token_ids:
            _token_id("stop_token_ids", token, vocab_size)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingParamsError("logit_bias", self.logit_bias, "None or a dict {token_id: bias}")
            for token, bias in self.logit_bias.items():
                _token_id("logit_bias", token, vocab_size)
                _real(f"logit_bias[{token}]", bias, f"a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                      -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, getattr(self, name), "True or False")


# ---- field checks ---------------------------------------------------------------------


def _int_key(key: Any) -> Any:
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            return key  # validate() refuses it by name
    return key


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int(name: str, value: Any, low: int | None = None, high: int | None = None,
         accepted: str | None = None) -> None:
    if accepted is None:
        accepted = "an integer" + (f" >= {low}" if low is not None and high is None else "")
        if low is not None and high is not None:
            accepted = f"an integer in [{low}, {high}]"
    if not _is_int(value) or (low is not None and value < low) or (high is not None and value > high):
        raise SamplingParamsError(name, value, accepted)


def _real(name: str, value: Any, accepted: str, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        raise SamplingParamsError(name, value, accepted)


def _token_id(name: str, token: Any, vocab_size: int | None) -> None:
    ok = _is_int(token) and token >= 0 and (vocab_size is None or token < vocab_size)
    if not ok:
        accepted = ("integer token ids >= 0" if vocab_size is None
                    else f"token ids inside the vocabulary [0, {vocab_size - 1}]")
        raise SamplingParamsError(name, token, accepted, seen=f"{name} holds token id {token!r}")


def check_token_ids(ids: Any, vocab_size: int, what: str = "token id", error: type[VtoolError] = VtoolError) -> None:
    """Every id inside 0..vocab_size-1, else `error` naming the first one outside. The compiled
    embedding gather does no bounds check (an id past the table would read, or crash on,
    memory outside it) and the sampler indexes rows by these ids, so they are checked by value."""
    import numpy as np

    array = np.asarray(ids, dtype=np.int64).reshape(-1)
    if array.size and (array.min() < 0 or array.max() >= vocab_size):
        bad = int(array[(array < 0) | (array >= vocab_size)][0])
        raise error(f"{what} {bad} is outside the vocabulary (0..{vocab_size - 1})")


def grammar_spec_fields(given: dict[str, Any]) -> dict[str, Any]:
    """vLLM's StructuredOutputsParams fields -> GrammarSpec fields (checked: a SamplingParamsError
    names what is wrong). Exactly one constraint."""
    from vtool.runtime.sampling.grammar import VLLM_KINDS, GrammarError, spec_fields, spec_from_vllm

    asked = [k for k in VLLM_KINDS if given.get(k) not in (None, False)]
    unknown = sorted(set(given) - set(VLLM_KINDS) - {"disable_any_whitespace"})
    if unknown or len(asked) != 1:
        raise SamplingParamsError("structured_outputs", given, "one of json, regex, choice, grammar, json_object "
                                  "or structural_tag (plus disable_any_whitespace)")
    kind, value = asked[0], given[asked[0]]
    try:
        spec = spec_from_vllm(kind, value, any_whitespace=not given.get("disable_any_whitespace", False))
    except GrammarError as err:
        raise SamplingParamsError("structured_outputs", value, "a grammar the engine can use",
                                  seen=str(err)) from None
    return spec_fields(spec)
