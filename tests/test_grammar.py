"""Grammar-constrained decoding (runtime/sampling/grammar.py, llguidance) on real tokenizers: the
tiny chat model's SmolLM2 tokenizer and Qwen3's (tests/support/assets.py fetches it once).

Random logits drive greedy decoding through GrammarProcessor: whatever the "model" prefers, the
output must satisfy the grammar. Schemas in the random strategy are bounded (string maxLength,
integer ranges, maxItems, no additional properties, compact whitespace) so every path ends."""
from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtool.runtime.sampling.grammar import GrammarCompiler, GrammarError, GrammarProcessor, GrammarSpec
from vtool.runtime.sampling.logits_processors import LogitsProcessor, bitmask_words, unpack_allowed
from vtool.runtime.text.tokenizer import Tokenizer

@pytest.fixture(scope="module")
def smol(tiny_model_dir):
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    return tokenizer, GrammarCompiler(tokenizer)


@pytest.fixture(scope="module")
def qwen3():
    # fetched when missing (an asset that cannot be had fails the test, never skips it: these
    # tests were skipped on any machine where no other test had fetched it first)
    import assets

    tokenizer = Tokenizer.from_dir(assets.required(assets.qwen3_tokenizer_dir))
    return tokenizer, GrammarCompiler(tokenizer)


@pytest.fixture(scope="module", params=["smollm2", "qwen3"])
def model_tok(request):
    return request.getfixturevalue("smol" if request.param == "smollm2" else "qwen3")


def drive(compiler: GrammarCompiler, spec: GrammarSpec, seed: int, max_steps: int = 400) -> tuple[list[int], GrammarProcessor]:
    """Greedy decoding over random logits, masked by the grammar, until it terminates."""
    processor = compiler.processor(spec)
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    for _ in range(max_steps):
        logits = rng.standard_normal(compiler.vocab_size).astype(np.float32)
        processor.apply(logits, ids)
        token = int(np.argmax(logits))
        assert np.isfinite(logits[token]), "the grammar allowed no token"
        processor.accept(token)
        ids.append(token)
        if processor.is_terminated():
            break
    assert processor.is_terminated(), f"no end after {max_steps} tokens"
    # Complete: only the end token is allowed now, and it is accepted (the engine's stop token).
    row = np.zeros(compiler.vocab_size, dtype=np.float32)
    processor.apply(row)
    assert set(np.flatnonzero(np.isfinite(row))) == set(compiler.eos_token_ids)
    if ids[-1] not in compiler.eos_token_ids:
        processor.accept(compiler.eos_token_ids[0])
        assert processor.is_terminated()
    return ids, processor


def text_of(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The text before the end token (the grammar may finish with or without one)."""
    return tokenizer.decode(ids, skip_special_tokens=True)


# --- random JSON schemas ---------------------------------------------------------------------------

_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)


def _leaf():
    return st.one_of(
        st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
        st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(
            lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
        st.just({"type": "boolean"}),
        st.lists(st.one_of(st.text(alphabet="abcxyz é-", min_size=0, max_size=5), st.integers(-50, 50),
                           st.booleans(), st.none()), min_size=1, max_size=4, unique_by=lambda v: json.dumps(v)
                 ).map(lambda values: {"enum": values}),
    )


def _object(children):
    return st.dictionaries(_NAMES, children, min_size=0, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False}) if props else
        st.just({"type": "object", "properties": {}, "additionalProperties": False}))


def _array(children):
    return st.tuples(children, st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "maxItems": t[1]})


SCHEMAS = _object(st.recursive(_leaf(), lambda inner: st.one_of(_object(inner), _array(inner)), max_leaves=6))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**32 - 1))
def test_random_schema_greedy_over_random_logits_gives_valid_json(smol, schema, seed):
    tokenizer, compiler = smol
    ids, _ = drive(compiler, GrammarSpec.json_schema(schema, any_whitespace=False), seed)
    value = json.loads(text_of(tokenizer, ids))
    jsonschema.validate(value, schema)


def test_typical_tool_schema_on_both_tokenizers(model_tok):
    tokenizer, compiler = model_tok
    for seed in range(3):
        ids, _ = drive(compiler, GrammarSpec.json_schema(TOOL_SCHEMA, any_whitespace=False), seed)
        jsonschema.validate(json.loads(text_of(tokenizer, ids)), TOOL_SCHEMA)


def test_json_object_allows_a_real_object_token_by_token_then_only_the_end(smol):
    """json_object is unbounded (random logits rarely close it): feed a real object instead. Every
    token is allowed by the mask; once the object closes nothing but the end token can follow."""
    tokenizer, compiler = smol
    processor = compiler.processor(GrammarSpec.json_object())
    text = '{"city": "Paris", "n": [1, 2.5, true, null], "o": {}}'
    for token in tokenizer.encode(text, add_special_tokens=False):
        row = np.zeros(compiler.vocab_size, dtype=np.float32)
        processor.apply(row)
        assert np.isfinite(row[token])
        processor.accept(token)
        assert not processor.is_terminated() or token == tokenizer.encode("}", add_special_tokens=False)[0]
    assert processor.is_accepting() and processor.is_terminated()
    row = np.zeros(compiler.vocab_size, dtype=np.float32)
    processor.apply(row)
    assert set(np.flatnonzero(np.isfinite(row))) == set(compiler.eos_token_ids)
    processor.accept(tokenizer.eos_id)
    assert processor.is_terminated()
    with pytest.raises(GrammarError, match="rejected"):
        processor.accept(tokenizer.encode("x", add_special_tokens=False)[0])


# --- regex and choice -----------------------------------------------------------------------------

REGEXES = [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no|maybe)", r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}",
           r"-?(0|[1-9][0-9]{0,4})(\.[0-9]{1,3})?", r"\(([a-f0-9]{2}, ?){1,3}\)", r"é+ü?"]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_output_fullmatches(model_tok, pattern):
    tokenizer, compiler = model_tok
    for seed in range(5):
        ids, _ = drive(compiler, GrammarSpec.regex(pattern), seed)
        assert re.fullmatch(pattern, text_of(tokenizer, ids)), text_of(tokenizer, ids)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# SmolLM2's byte-level vocabulary has no token for some lead bytes of 4-byte UTF-8 (U+40000 encodes as
# three unrelated tokens): text the tokenizer cannot spell is out of scope, so the BMP plus emoji.
@given(choices=st.lists(st.text(alphabet=st.one_of(st.characters(max_codepoint=0xFFFF, exclude_categories=["Cs", "Cc"]),
                                                   st.characters(min_codepoint=0x1F600, max_codepoint=0x1F64F)),
                                min_size=1, max_size=8), min_size=1, max_size=5, unique=True),
       seed=st.integers(0, 2**32 - 1))
def test_choice_output_is_exactly_one_choice(smol, choices, seed):
    tokenizer, compiler = smol
    ids, _ = drive(compiler, GrammarSpec.choice(choices), seed)
    assert text_of(tokenizer, ids) in choices


def test_gbnf_and_lark_grammars_constrain(smol):
    tokenizer, compiler = smol
    gbnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'
    lark = 'start: "ok" | "err:" CODE\nCODE: /[0-9]{3}/'
    for seed in range(5):
        ids, _ = drive(compiler, GrammarSpec.grammar_text(gbnf), seed, max_steps=2000)
        assert re.fullmatch(r"\((?:[0-9]|[1-9][0-9])(?:,(?:[0-9]|[1-9][0-9]))*\)", text_of(tokenizer, ids))
        ids, _ = drive(compiler, GrammarSpec.grammar_text(lark), seed)
        assert re.fullmatch(r"ok|err:[0-9]{3}", text_of(tokenizer, ids))


def test_structural_tag_constrains_the_tagged_segment(smol):
    tokenizer, compiler = smol
    schema = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["x"], "additionalProperties": False}
    spec = GrammarSpec.structural_tag({"type": "structural_tag", "triggers": ["<function="],
                                       "structures": [{"begin": "<function=f>", "schema": schema,
                                                       "end": "</function>"}]})
    processor = compiler.processor(spec)
    text = 'Sure. <function=f>{"x": 7}</function> done'
    for token in tokenizer.encode(text, add_special_tokens=False):
        processor.accept(token)
    bad = compiler.processor(spec)
    with pytest.raises(GrammarError):
        for token in tokenizer.encode('Sure. <function=f>{"x": "seven"}', add_special_tokens=False):
            bad.accept(token)


# --- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("make, field", [
    (lambda: GrammarSpec.json_schema({"type": "strin"}), "response_format.json_schema"),
    (lambda: GrammarSpec.json_schema("{not json", field="guided_json"), "guided_json"),
    (lambda: GrammarSpec.json_schema(["a"]), "response_format.json_schema"),
    (lambda: GrammarSpec.json_schema({"properties": {"a": {"$ref": "#/nope"}}}), "response_format.json_schema"),
    (lambda: GrammarSpec.json_schema({"type": "string", "format": "wobbly"}), "response_format.json_schema"),
    (lambda: GrammarSpec.regex("a(b"), "structured_outputs.regex"),
    (lambda: GrammarSpec.regex("", field="guided_regex"), "guided_regex"),
    (lambda: GrammarSpec.regex("[z-a]"), "structured_outputs.regex"),
    (lambda: GrammarSpec.choice([]), "structured_outputs.choice"),
    (lambda: GrammarSpec.choice(["a", 3]), "structured_outputs.choice"),
    (lambda: GrammarSpec.choice("ab", field="guided_choice"), "guided_choice"),
    (lambda: GrammarSpec.grammar_text("start: undefined_rule"), "structured_outputs.grammar"),
    (lambda: GrammarSpec.grammar_text('root ::= "a" ( '), "structured_outputs.grammar"),
    (lambda: GrammarSpec.grammar_text("   ", field="guided_grammar"), "guided_grammar"),
    (lambda: GrammarSpec.structural_tag({"structures": [{"begin": "<x>", "schema": {}, "end": "</x>"}],
                                         "triggers": ["<y"]}), "structured_outputs.structural_tag"),
    (lambda: GrammarSpec.structural_tag({"format": {}}), "structured_outputs.structural_tag"),
    (lambda: GrammarSpec("xml", "<a/>"), "structured_outputs"),
])
def test_a_bad_spec_is_a_grammar_error_naming_the_field(make, field):
    with pytest.raises(GrammarError) as info:
        make()
    assert str(info.value).startswith(field + ":") or str(info.value).startswith(field + "."), str(info.value)


def test_a_token_the_grammar_rejects_raises(smol):
    tokenizer, compiler = smol
    processor = compiler.processor(GrammarSpec.regex("[0-9]+"))
    with pytest.raises(GrammarError, match="rejected by the regex grammar of structured_outputs.regex"):
        processor.accept(tokenizer.encode("abc", add_special_tokens=False)[0])


# --- the processor contract, cache and timings ----------------------------------------------------

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include_hourly": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}


def test_processor_is_a_logits_processor_and_its_bitmask_matches_apply(smol):
    tokenizer, compiler = smol
    processor = compiler.processor(GrammarSpec.choice(["alpha", "beta"]))
    assert isinstance(processor, LogitsProcessor)
    words = np.zeros(bitmask_words(compiler.vocab_size) + 3, dtype=np.int32)
    processor.fill_bitmask(words)
    assert not words[bitmask_words(compiler.vocab_size):].any()
    row = np.zeros(compiler.vocab_size + 64, dtype=np.float32)  # a padded logits row
    processor.apply(row)
    allowed = unpack_allowed(words, compiler.vocab_size)
    assert np.array_equal(np.isfinite(row[: compiler.vocab_size]), allowed)
    assert not np.isfinite(row[compiler.vocab_size:]).any()
    assert 0 < allowed.sum() < 10


def test_forced_tokens_jump_forward(smol):
    tokenizer, compiler = smol
    processor = compiler.processor(GrammarSpec.json_schema(TOOL_SCHEMA, any_whitespace=False))
    forced = processor.forced_tokens()
    assert tokenizer.decode(forced).startswith('{"')
    for token in forced:
        processor.accept(token)
    processor.rollback(len(forced))
    assert processor.num_accepted == 0


def test_compile_is_cached_thread_safe_and_fast(model_tok, capsys):
    tokenizer, compiler = model_tok
    start = time.perf_counter()
    spec = GrammarSpec.json_schema({**TOOL_SCHEMA, "title": f"weather {tokenizer.vocab_size}"})
    spec_s = time.perf_counter() - start
    start = time.perf_counter()
    first = compiler.compile(spec)
    first_s = time.perf_counter() - start
    misses, hits = compiler.misses, compiler.hits
    same = GrammarSpec.json_schema({**TOOL_SCHEMA, "title": f"weather {tokenizer.vocab_size}"}, field="guided_json")
    start = time.perf_counter()
    again = compiler.compile(same)
    hit_s = time.perf_counter() - start
    assert again is first and compiler.hits == hits + 1 and compiler.misses == misses
    assert first_s < 1.0

    results, errors = [], []

    def work(i):
        try:
            results.append(compiler.compile(GrammarSpec.regex(f"[a-z]{{{i % 4 + 1}}}")))
        except Exception as e:  # pragma: no cover
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len({id(compiler.compile(GrammarSpec.regex(f"[a-z]{{{i}}}"))) for i in range(1, 5)}) == 4

    processor = compiler.processor(GrammarSpec.json_schema(TOOL_SCHEMA))
    row = np.zeros(compiler.vocab_size, dtype=np.float32)
    ids = tokenizer.encode('{"location": "Paris, France", "unit": "celsius", "days": 3}', add_special_tokens=False)
    start = time.perf_counter()
    for token in ids:
        processor.apply(row)
        processor.accept(token)
    per_token = (time.perf_counter() - start) / len(ids)
    with capsys.disabled():
        print(f"\n[grammar timings] vocab {compiler.vocab_size}: tool-schema spec (validated) {spec_s * 1e3:.2f} ms, compile {first_s * 1e3:.2f} ms, "
              f"cache hit {hit_s * 1e6:.1f} us, mask+apply per token {per_token * 1e3:.3f} ms")


# --- end to end on the engine (no engine change) --------------------------------------------------

def test_engine_generates_json_with_a_grammar_processor(tiny_session):
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.sampling.params import SamplingParams

    tokenizer = tiny_session.tokenizer
    compiler = GrammarCompiler(tokenizer, vocab_size=tiny_session.model.vocab_size,
                               eos_token_ids=sorted(tiny_session.stop_ids))
    engine = Engine(tiny_session, EngineConfig())
    prompt = tokenizer.encode("Answer in JSON:", add_special_tokens=True)
    specs = {"obj": GrammarSpec.json_object(any_whitespace=False),
             "tool": GrammarSpec.json_schema(TOOL_SCHEMA, any_whitespace=False),
             "choice": GrammarSpec.choice(["left", "right"])}
    processors = {name: compiler.processor(spec) for name, spec in specs.items()}
    for name, processor in processors.items():
        engine.add_request(name, prompt, SamplingParams(temperature=0, max_tokens=120),
                           logits_processors=[processor])
    tokens = {name: [] for name in specs}
    finish = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
    for name in ("tool", "choice"):
        assert finish[name] == "stop" and processors[name].is_terminated(), (name, finish, tokenizer.decode(tokens[name]))
    jsonschema.validate(json.loads(tokenizer.decode(tokens["tool"])), TOOL_SCHEMA)
    assert tokenizer.decode(tokens["choice"]) in ("left", "right")
    # json_object is unbounded: either it ended (and parses) or it ran out of tokens, every one accepted.
    text = tokenizer.decode(tokens["obj"])
    print(f"\n[engine json_object] {finish['obj']}: {text!r}")
    if finish["obj"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish["obj"] == "length" and text.startswith("{") and processors["obj"].num_accepted == 120
