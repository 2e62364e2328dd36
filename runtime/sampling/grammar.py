"""Grammar-constrained decoding: what a request asks for (GrammarSpec), the per-model compiler that
turns it into a token matcher (GrammarCompiler, cached), and the logits processor that masks each
step to the tokens the grammar allows (GrammarProcessor).

The grammar engine is llguidance (MIT, no dependencies): xgrammar declares torch, transformers and
triton as dependencies and imports torch at module level, and a default vtool install must never
pull torch. llguidance fills the packed int32 bitmask in the layout logits_processors.py uses (bit j
of word i allows token 32*i + j), so the same words can cross to a device.

Request kinds, as vLLM's structured outputs name them:
- json_object: any JSON object;  json_schema: a JSON schema (dict or its JSON text);
- regex: a Rust-`regex`-syntax pattern the whole output must match;
- choice: one of a list of strings, exactly;
- grammar: a Lark grammar, or GBNF / EBNF as llama.cpp writes it (converted to Lark);
- structural_tag: vLLM's `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`, free text
  with constrained tool-call segments that start at a trigger.

Once the grammar is complete the mask allows only the end-of-sequence token(s), so a request whose
stop ids include them finishes on its own, one step later; is_terminated() says when nothing but the
end can follow (an engine can finish the request then and skip that step).
"""
from __future__ import annotations

import copy
import functools
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field as _field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from vtool import VtoolError
from vtool.runtime.sampling.logits_processors import bitmask_words

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")
_DEFAULT_FIELD = {"json_object": "response_format", "json_schema": "response_format.json_schema",
                  "regex": "structured_outputs.regex", "choice": "structured_outputs.choice",
                  "grammar": "structured_outputs.grammar", "structural_tag": "structured_outputs.structural_tag"}


class GrammarError(VtoolError):
    """A grammar a request asked for that cannot be used (names the request field), or a token the
    grammar does not allow."""


def _llg():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a dependency of vtool
        raise GrammarError("structured output needs the llguidance package (pip install llguidance)") from e
    return llguidance


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asks: `kind` (one of KINDS) and its `source` in a canonical text form (JSON text
    for json_schema, choice and structural_tag; the pattern or grammar text otherwise). `field` is
    the request field named in errors; it is not part of the identity (the compile cache's key).
    `any_whitespace`: JSON may carry flexible whitespace between tokens (vLLM's default; False is
    vLLM's disable_any_whitespace: compact JSON). Validated on construction: GrammarError if unusable."""

    kind: str
    source: str = ""
    any_whitespace: bool = True
    field: str = _field(default="", compare=False)
    grammar: str = _field(default="", init=False, repr=False, compare=False)  # llguidance's grammar text

    def __post_init__(self) -> None:
        name = self.field or _DEFAULT_FIELD.get(self.kind, "structured_outputs")
        object.__setattr__(self, "field", name)
        if self.kind not in KINDS:
            raise GrammarError(f"{name}: unknown structured-output kind {self.kind!r} (expected one of "
                               f"{', '.join(KINDS)})")
        if not isinstance(self.source, str):
            raise GrammarError(f"{name}: the {self.kind} must be given as text, got {type(self.source).__name__}")
        grammar = self._to_grammar(name)
        llg = _llg()
        error = llg.LLMatcher.validate_grammar(grammar)
        if error:
            raise GrammarError(f"{name}: invalid {self.kind.replace('_', ' ')}: {error.strip()}")
        object.__setattr__(self, "grammar", grammar)

    # --- constructors from the values a request carries ---

    @classmethod
    def json_object(cls, *, any_whitespace: bool = True, field: str = "") -> "GrammarSpec":
        return cls("json_object", "", any_whitespace, field=field)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | bool, *, any_whitespace: bool = True,
                    field: str = "") -> "GrammarSpec":
        name = field or _DEFAULT_FIELD["json_schema"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"{name}: not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"{name}: a JSON schema is an object (or true/false), got {type(schema).__name__}")
        try:  # property order is kept: it is the order the JSON is generated in
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"{name}: not serialisable as JSON ({e})") from None
        return cls("json_schema", text, any_whitespace, field=name)

    @classmethod
    def regex(cls, pattern: str, *, field: str = "") -> "GrammarSpec":
        return cls("regex", pattern, field=field)

    @classmethod
    def choice(cls, choices: Sequence[str], *, field: str = "") -> "GrammarSpec":
        name = field or _DEFAULT_FIELD["choice"]
        if isinstance(choices, str) or not all(isinstance(c, str) for c in choices):
            raise GrammarError(f"{name}: choice is a list of strings")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False), field=name)

    @classmethod
    def grammar_text(cls, text: str, *, field: str = "") -> "GrammarSpec":
        """A Lark, GBNF or EBNF grammar."""
        return cls("grammar", text, field=field)

    @classmethod
    def structural_tag(cls, tag: Mapping[str, Any] | str, *, field: str = "") -> "GrammarSpec":
        name = field or _DEFAULT_FIELD["structural_tag"]
        if not isinstance(tag, str):
            try:
                tag = json.dumps(tag, ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise GrammarError(f"{name}: not serialisable as JSON ({e})") from None
        return cls("structural_tag", tag, field=name)

    # --- to llguidance's grammar ---

    def _to_grammar(self, name: str) -> str:
        llg = _llg()
        options = {"whitespace_flexible": bool(self.any_whitespace)}
        if self.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except ValueError as e:
                raise GrammarError(f"{name}: not valid JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(f"{name}: a JSON schema is an object (or true/false)")
            try:
                return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
            except (ValueError, TypeError) as e:
                raise GrammarError(f"{name}: invalid json schema: {e}") from None
        if self.kind == "regex":
            if not self.source:
                raise GrammarError(f"{name}: the regex is empty")
            return llg.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            try:
                choices = json.loads(self.source)
            except ValueError as e:
                raise GrammarError(f"{name}: choice is a JSON list of strings ({e})") from None
            if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
                raise GrammarError(f"{name}: choice is a list of strings")
            if not choices:
                raise GrammarError(f"{name}: choice needs at least one string")
            if "" in choices:
                raise GrammarError(f"{name}: a choice may not be the empty string")
            return llg.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices)))
        if self.kind == "grammar":
            if not self.source.strip():
                raise GrammarError(f"{name}: the grammar is empty")
            try:
                return llg.grammar_from("grammar", self.source)
            except ValueError as e:
                raise GrammarError(f"{name}: invalid grammar: {e}") from None
        return _structural_tag_grammar(llg, self.source, name)


def _structural_tag_grammar(llg, source: str, name: str) -> str:
    """vLLM's structural tag: {"type": "structural_tag", "structures": [{"begin", "schema", "end"}],
    "triggers": [...]} -> a Lark grammar of free text with the tagged segments constrained."""
    try:
        tag = json.loads(source)
    except ValueError as e:
        raise GrammarError(f"{name}: not valid JSON ({e})") from None
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) \
            or not isinstance(tag.get("triggers"), list):
        raise GrammarError(f"{name}: expected {{\"structures\": [{{\"begin\", \"schema\", \"end\"}}, ...], "
                           f"\"triggers\": [...]}} (the newer \"format\" form is not supported)")
    triggers = [t for t in tag["triggers"] if isinstance(t, str) and t]
    if not triggers or len(triggers) != len(tag["triggers"]):
        raise GrammarError(f"{name}.triggers: a list of non-empty strings")
    tags = []
    for i, s in enumerate(tag["structures"]):
        where = f"{name}.structures[{i}]"
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end", ""), str):
            raise GrammarError(f"{where}: expected {{\"begin\": str, \"schema\": {{...}}, \"end\": str}}")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"{where}.begin: {s['begin']!r} starts with none of the triggers {triggers}")
        schema = s.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"{where}.schema: a JSON schema is an object")
        tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s.get("end", "")))
    if not tags:
        raise GrammarError(f"{name}.structures: needs at least one structure")
    try:
        return llg.StructTag.to_grammar(tags)
    except (AssertionError, ValueError, TypeError) as e:
        raise GrammarError(f"{name}: {e}") from None


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar ready for requests: a pristine matcher each request copies."""

    spec: GrammarSpec
    matcher: Any  # llguidance.LLMatcher in its start state; never advanced
    vocab_size: int
    compile_s: float


class GrammarCompiler:
    """One per served model: the vocabulary set-up for the grammar engine (about 0.2-1.5 s, so
    build it once), and compile(spec), cached (LRU keyed by the spec) and safe to call from any
    thread (llguidance drops the GIL while it builds), so grammars compile off the engine loop.

    vocab_size: the logits row width if the model pads its vocabulary past the tokenizer's.
    eos_token_ids: the tokens that end a request once the grammar is complete (default: the
    tokenizer's eos); they should be among the engine's stop ids."""

    def __init__(self, tokenizer, *, vocab_size: int | None = None, eos_token_ids: Iterable[int] | None = None,
                 cache_size: int = 256):
        llg = _llg()
        backend = copy.copy(tokenizer.backend)
        backend.no_padding()
        backend.no_truncation()
        eos = list(eos_token_ids) if eos_token_ids is not None else \
            ([tokenizer.eos_id] if getattr(tokenizer, "eos_id", None) is not None else [])
        if not eos:
            raise GrammarError("structured output needs an end-of-sequence token, and this tokenizer names none")
        n_vocab = max(vocab_size or 0, tokenizer.vocab_size)
        try:
            self.ll_tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)
        except Exception as e:  # the Rust side raises plain ValueError/RuntimeError
            raise GrammarError(f"the grammar engine cannot use this tokenizer: {e}") from e
        self.vocab_size = self.ll_tokenizer.vocab_size
        self.eos_token_ids = tuple(eos)
        self.cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        """The spec's compiled grammar if the cache holds it (no compiling): an engine loop
        takes a cached grammar at once and sends the others to be compiled off the loop."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
            return hit

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        hit = self.cached(spec)
        if hit is not None:
            return hit
        with self._lock:
            self.misses += 1
        llg = _llg()
        start = time.perf_counter()
        matcher = llg.LLMatcher(self.ll_tokenizer, spec.grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{spec.field}: invalid {spec.kind.replace('_', ' ')}: {matcher.get_error().strip()}")
        compiled = CompiledGrammar(spec, matcher, self.vocab_size, time.perf_counter() - start)
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def processor(self, spec: GrammarSpec) -> "GrammarProcessor":
        """A fresh per-request processor for `spec` (compiled or from the cache)."""
        return GrammarProcessor(self.compile(spec), tokenizer=self)

    def describe_token(self, token_id: int) -> str:
        try:
            return repr(self.ll_tokenizer.decode_str([int(token_id)]))
        except Exception:  # an id past the vocabulary
            return "?"


class GrammarProcessor:
    """The LogitsProcessor for one request's grammar: apply() masks a float32 logits row to the
    tokens the grammar allows next, accept() advances the matcher (a token the grammar rejects
    raises GrammarError). Also a BitmaskSource (fill_bitmask/accept_token) for a device-side mask.

    The mask of the current state is computed once and kept in `words` until accept() or
    rollback() moves the state (tagged with num_accepted). A batch's masks can be computed
    together on llguidance's threads (runtime/sampling/bitmask_batch.py reads `matcher` and
    `num_words` and hands each processor its words with set_prefilled); apply() and
    fill_bitmask() then use those, and compute their own when none are there."""

    def __init__(self, compiled: CompiledGrammar, tokenizer: GrammarCompiler | None = None):
        self.compiled = compiled
        self.matcher = compiled.matcher.deep_copy()
        self.vocab_size = compiled.vocab_size
        self.words = np.zeros(bitmask_words(self.vocab_size), dtype=np.int32)
        self._compiler = tokenizer
        self.num_accepted = 0
        self._words_at: int | None = None  # the num_accepted whose mask self.words holds (None: none)

    @property
    def num_words(self) -> int:
        """The mask's width in int32 words (llguidance writes exactly this many)."""
        return self.words.size

    def has_current_words(self) -> bool:
        """Whether self.words holds the mask of the current state (prefilled or computed)."""
        return self._words_at == self.num_accepted

    def set_prefilled(self, words: np.ndarray) -> None:
        """The mask of the current state, computed elsewhere (a batch fill): apply() and
        fill_bitmask() use it until the next accept() or rollback()."""
        np.copyto(self.words, words[: self.words.size], casting="no")
        self._words_at = self.num_accepted

    def current_words(self) -> np.ndarray:
        """self.words holding the current state's mask (computed now unless it already does)."""
        self.check()
        if self._words_at != self.num_accepted:
            self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
            self._words_at = self.num_accepted
        return self.words

    # BitmaskSource
    def fill_bitmask(self, words: np.ndarray) -> None:
        """The next token's allowed set into `words` (int32, at least bitmask_words(vocab) long)."""
        if words.dtype != np.int32 or not words.flags["C_CONTIGUOUS"] or words.size < self.words.size:
            raise GrammarError(f"a grammar bitmask is {self.words.size} contiguous int32 words")
        words[: self.words.size] = self.current_words()
        words[self.words.size:] = 0

    def accept_token(self, token_id: int) -> None:
        self.accept(token_id)

    # LogitsProcessor
    def apply(self, logits: np.ndarray, output_ids: Sequence[int] = ()) -> None:
        allowed = np.unpackbits(self.current_words().view(np.uint8), bitorder="little").view(bool)
        n = min(logits.shape[-1], self.vocab_size)
        np.putmask(logits[..., :n], ~allowed[:n], -np.inf)
        if logits.shape[-1] > n:
            logits[..., n:] = -np.inf

    def accept(self, token_id: int) -> None:
        token_id = int(token_id)
        self._words_at = None
        if not self.matcher.consume_token(token_id):
            what = self._compiler.describe_token(token_id) if self._compiler else ""
            reason = "the grammar is already complete" if self.matcher.is_stopped() and "stopped" in \
                (self.matcher.get_error() or "") else "the grammar does not allow it here"
            token = f"token {token_id} {what}" if what else f"token {token_id}"
            raise GrammarError(f"{token} rejected by the {self.compiled.spec.kind.replace('_', ' ')} "
                               f"grammar of {self.compiled.spec.field}: {reason}")
        self.num_accepted += 1

    # state
    def is_terminated(self) -> bool:
        """Nothing can follow but the end: either the grammar took its end token, or the text is a
        complete match no token can extend (a closed JSON object, a choice). From here the mask
        allows only the end token(s), so the request can finish now, one step early."""
        return bool(self.matcher.is_stopped())

    def is_accepting(self) -> bool:
        """The text so far is a complete match (the end token is allowed next)."""
        return bool(self.matcher.is_accepting())

    def forced_tokens(self) -> list[int]:
        """Jump-forward: the tokens the grammar forces next, whatever the model says (may be empty).
        The caller appends them with accept() (or skips their decode steps) as it sees fit."""
        self.check()
        return list(self.matcher.compute_ff_tokens())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculative decoding's rejected drafts)."""
        self._words_at = None
        if not self.matcher.rollback(int(num_tokens)):
            raise GrammarError(f"cannot roll the grammar back {num_tokens} tokens: {self.matcher.get_error()}")
        self.num_accepted -= int(num_tokens)

    def check(self) -> None:
        """GrammarError if the matcher is in an error state (its mask would mean nothing)."""
        if self.matcher.is_error():
            raise GrammarError(f"the grammar of {self.compiled.spec.field} is in an error state: "
                               f"{self.matcher.get_error().strip()}")


# --- vLLM's names for the kinds, and specs as plain data ---------------------------------------

# vLLM's StructuredOutputsParams field -> the GrammarSpec constructor that reads its value
_FROM_VLLM = {
    "json": lambda v, ws, f: GrammarSpec.json_schema(v, any_whitespace=ws, field=f),
    "regex": lambda v, ws, f: GrammarSpec.regex(v, field=f),
    "choice": lambda v, ws, f: GrammarSpec.choice(v, field=f),
    "grammar": lambda v, ws, f: GrammarSpec.grammar_text(v, field=f),
    "json_object": lambda v, ws, f: GrammarSpec.json_object(any_whitespace=ws, field=f),
    "structural_tag": lambda v, ws, f: GrammarSpec.structural_tag(v, field=f),
}
VLLM_KINDS = tuple(_FROM_VLLM)


def spec_from_vllm(kind: str, value: Any, *, any_whitespace: bool = True, field: str = "") -> GrammarSpec:
    """The GrammarSpec for one of vLLM's structured-output fields (`json`, `regex`, `choice`,
    `grammar`, `json_object`, `structural_tag`) and its value; GrammarError names `field`."""
    if kind not in _FROM_VLLM:
        raise GrammarError(f"{field or 'structured_outputs'}: unknown constraint {kind!r} (one of "
                           f"{', '.join(VLLM_KINDS)})")
    return _FROM_VLLM[kind](value, any_whitespace, field or f"structured_outputs.{kind}")


def spec_fields(spec: GrammarSpec) -> dict[str, Any]:
    """A spec as plain data (what SamplingParams.structured_outputs holds and crosses processes)."""
    return {"kind": spec.kind, "source": spec.source, "any_whitespace": spec.any_whitespace, "field": spec.field}


@functools.lru_cache(maxsize=256)
def _cached_spec(kind: str, source: str, any_whitespace: bool, field: str) -> GrammarSpec:
    return GrammarSpec(kind, source, any_whitespace, field=field)


def spec_of(fields: Mapping[str, Any]) -> GrammarSpec:
    """spec_fields back to a GrammarSpec; a spec seen before is not validated again (the API
    server validated it; the engine loop should not pay for it per request)."""
    return _cached_spec(fields["kind"], fields.get("source", ""), bool(fields.get("any_whitespace", True)),
                        fields.get("field", ""))
