"""A batch's grammar masks (runtime/sampling/bitmask_batch.py) and grammar rows sampled on the
device (runtime/sampling/device.py with the masking functions of schedules/cuda/sampler.py), on
SmolLM2's tokenizer (the tiny chat model's):

- the parallel fill (llguidance's threads) gives the words each processor computes alone, for
  grammars of every kind at many states; rows without a grammar allow every token, a row with
  two processors gets their AND, a wrapper's active grammar is computed with the others;
- the host sampler's prefill: sample_batch over a batch of grammar rows draws what it drew row
  by row, and GrammarProcessor.apply() uses prefilled words only for the state they were
  computed in;
- the DeviceSampler over the CPU build of the sampler library draws, for real grammars, the
  host sampler's tokens (greedy and seeded random), every one accepted by its grammar;
- the engine, given that sampler, sends grammar batches to the device and generates what the
  host path generates; with a library that lacks the mask functions they stay on the host;
- the fill time of 32 JSON-schema grammars, one after another vs in parallel (printed).
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import time

import jsonschema
import numpy as np
import pytest

from test_grammar import TOOL_SCHEMA
from vtool.runtime.sampling import bitmask_batch
from vtool.runtime.sampling.device import DeviceSampler
from vtool.runtime.sampling.grammar import GrammarCompiler, GrammarProcessor, GrammarSpec
from vtool.runtime.sampling.host import SequenceSampler, make_generator, sample_batch
from vtool.runtime.sampling.logits_processors import bitmask_words, pack_allowed
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smol(tiny_model_dir):
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    return tokenizer, GrammarCompiler(tokenizer)


def specs() -> list[GrammarSpec]:
    return [GrammarSpec.json_schema(TOOL_SCHEMA, any_whitespace=False), GrammarSpec.json_schema(TOOL_SCHEMA),
            GrammarSpec.json_object(), GrammarSpec.regex(r"[0-9]{3}-[a-z]{2,4}"),
            GrammarSpec.choice(["alpha", "beta", "gamma delta"]),
            GrammarSpec.grammar_text('start: "ok" | "err:" CODE\nCODE: /[0-9]{3}/')]


EXAMPLES = ['{"location":"Paris, France","unit":"celsius","days":3,"tags":["a","bcd"]}',
            '{"location": "Oslo", "unit": "fahrenheit", "include_hourly": true}',
            '{"city": "Paris", "n": [1, 2.5, true, null], "o": {}}', "123-abcd", "gamma delta", "err:404"]


def advanced(compiler: GrammarCompiler, tokenizer: Tokenizer, n: int) -> list[GrammarProcessor]:
    """n processors over specs(), each moved some way into a valid output of its grammar."""
    out = []
    all_specs = specs()
    for i in range(n):
        k = i % len(all_specs)
        processor = compiler.processor(all_specs[k])
        ids = tokenizer.encode(EXAMPLES[k], add_special_tokens=False)
        for token in ids[: (i * 7) % (len(ids) + 1)]:
            processor.accept(token)
        out.append(processor)
    return out


def alone(processor: GrammarProcessor) -> np.ndarray:
    """The processor's words computed by itself, on a copy (nothing cached)."""
    fresh = GrammarProcessor(processor.compiled)
    fresh.matcher = processor.matcher.deep_copy()
    words = np.zeros(fresh.num_words, np.int32)
    fresh.fill_bitmask(words)
    return words


class Gate:
    """A wrapper that applies its grammar only once open (reasoning_gate.ReasoningGate's shape)."""

    def __init__(self, grammar: GrammarProcessor, open_: bool):
        self.grammar, self.open = grammar, open_

    @property
    def active_grammar(self):  # noqa: ANN201
        return self.grammar if self.open else None

    def fill_bitmask(self, words: np.ndarray) -> None:
        if self.open:
            self.grammar.fill_bitmask(words)
        else:
            words[:] = -1

    def accept_token(self, token_id: int) -> None:
        if self.open:
            self.grammar.accept(token_id)

    def apply(self, logits: np.ndarray, output_ids=()) -> None:  # noqa: ANN001
        if self.open:
            self.grammar.apply(logits, output_ids)

    def accept(self, token_id: int) -> None:
        self.accept_token(token_id)


class Allowed:
    """A plain BitmaskSource (not a grammar): filled by its own fill_bitmask."""

    def __init__(self, token_ids, vocab: int):  # noqa: ANN001
        mask = np.zeros(vocab, bool)
        mask[list(token_ids)] = True
        self.words = pack_allowed(mask)

    def fill_bitmask(self, words: np.ndarray) -> None:
        words[: self.words.size] = self.words


# --- the parallel fill ---------------------------------------------------------------------------

def test_parallel_fill_equals_serial(smol):
    tokenizer, compiler = smol
    processors = advanced(compiler, tokenizer, 40)
    want = np.stack([alone(p) for p in processors])
    words = np.empty((len(processors), bitmask_words(compiler.vocab_size)), np.int32)
    bitmask_batch.fill_batch_bitmask([[p] for p in processors], words)
    np.testing.assert_array_equal(words, want)
    assert all(p.has_current_words() for p in processors)  # kept for their apply()
    # Computed again from the kept words: the same.
    bitmask_batch.fill_batch_bitmask([[p] for p in processors], words)
    np.testing.assert_array_equal(words, want)

    # Copies of one compiled grammar (requests of one schema) are filled in turn: the same words.
    same = [compiler.processor(specs()[0]) for _ in range(8)]
    ids = tokenizer.encode(EXAMPLES[0], add_special_tokens=False)
    for i, p in enumerate(same):
        for token in ids[: 3 * i]:
            p.accept(token)
    words = np.empty((len(same), bitmask_words(compiler.vocab_size)), np.int32)
    bitmask_batch.fill_batch_bitmask([[p] for p in same], words)
    np.testing.assert_array_equal(words, np.stack([alone(p) for p in same]))

    # Rows without a grammar, a closed and an open gate, two processors in one row (AND),
    # a plain BitmaskSource, and one processor appearing twice.
    fresh = advanced(compiler, tokenizer, 6)
    allowed = Allowed(range(0, compiler.vocab_size, 3), compiler.vocab_size)
    rows = [[], [fresh[0]], [Gate(fresh[1], False)], [Gate(fresh[2], True)], [fresh[3], allowed], [allowed],
            [fresh[4]], [fresh[4]], []]
    words = np.empty((len(rows), bitmask_words(compiler.vocab_size)), np.int32)
    bitmask_batch.fill_batch_bitmask(rows, words)
    every = np.full(words.shape[1], -1, np.int32)
    expected = [every, alone(fresh[0]), every, alone(fresh[2]), alone(fresh[3]) & allowed.words, allowed.words,
                alone(fresh[4]), alone(fresh[4]), every]
    np.testing.assert_array_equal(words, np.stack(expected))
    assert not fresh[1].has_current_words()  # a closed gate's grammar is not asked

    # A wider row than the grammar's vocabulary (a model padding its logits): nothing past it.
    wide = np.empty((1, bitmask_words(compiler.vocab_size) + 2), np.int32)
    bitmask_batch.fill_batch_bitmask([[fresh[5]]], wide)
    np.testing.assert_array_equal(wide[0, :-2], alone(fresh[5]))
    assert not wide[0, -2:].any()
    with pytest.raises(ValueError, match="int32"):
        bitmask_batch.fill_batch_bitmask([[fresh[5]]], np.empty((1, 3), np.int64))


def test_host_prefill(smol):
    tokenizer, compiler = smol
    processors = advanced(compiler, tokenizer, 12)
    assert bitmask_batch.prefill_grammars([[p] for p in processors[:1]]) == 0  # a lone one computes its own
    assert bitmask_batch.prefill_grammars([[p] for p in processors]) == 12
    assert all(p.has_current_words() for p in processors)
    assert bitmask_batch.prefill_grammars([[p] for p in processors]) == 0  # nothing left to do
    for p in processors:
        np.testing.assert_array_equal(p.words, alone(p))
    # A prefilled mask is used for its state only: after accept() the processor computes again.
    p = processors[0]
    row = np.zeros(compiler.vocab_size, np.float32)
    p.apply(row)
    token = int(np.flatnonzero(np.isfinite(row))[0])
    p.set_prefilled(np.full(p.num_words, -1, np.int32))  # a wrong mask, "prefilled" for this state
    row = np.zeros(compiler.vocab_size, np.float32)
    p.apply(row)
    assert np.isfinite(row).all()  # used as given, while the state lasts
    p.accept(token)
    assert not p.has_current_words()
    row = np.zeros(compiler.vocab_size, np.float32)
    p.apply(row)
    np.testing.assert_array_equal(np.isfinite(row), np.unpackbits(alone(p).view(np.uint8), bitorder="little")
                                  .astype(bool)[: compiler.vocab_size])
    p.rollback(1)
    assert not p.has_current_words()


def grammar_batch(compiler: GrammarCompiler, params: list[SamplingParams], seeds: list[int],
                  with_grammar: list[bool]) -> list[SequenceSampler]:
    all_specs = specs()
    seqs = []
    for i, (p, seed, g) in enumerate(zip(params, seeds, with_grammar)):
        processors = [compiler.processor(all_specs[i % len(all_specs)])] if g else []
        seq = SequenceSampler(copy.copy(p), vocab_size=compiler.vocab_size, eos_token_ids=compiler.eos_token_ids,
                              logits_processors=processors)
        seq.rng = make_generator(seed)
        seqs.append(seq)
    return seqs


def step_params(n: int) -> list[SamplingParams]:
    choices = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
               SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.2, top_k=20, min_p=0.02)]
    return [choices[i % len(choices)] for i in range(n)]


def run_steps(sample, seqs: list[SequenceSampler], rng: np.random.Generator, steps: int) -> None:  # noqa: ANN001
    """Random logits through `sample(logits, seqs)` until every grammar ends (or `steps`)."""
    vocab = seqs[0].vocab_size
    live = list(seqs)
    for _ in range(steps):
        live = [s for s in live if not any(p.is_terminated() for p in s.logits_processors)]
        if not live:
            return
        logits = (rng.standard_normal((len(live), vocab)) * 3).astype(np.float32)
        sample(logits, live)


def test_sample_batch_prefill_draws_what_row_by_row_drew(smol, monkeypatch):
    _tokenizer, compiler = smol
    n = 10
    params, seeds = step_params(n), list(range(100, 100 + n))
    batched = grammar_batch(compiler, params, seeds, [i != 3 for i in range(n)])
    one_by_one = grammar_batch(compiler, params, seeds, [i != 3 for i in range(n)])
    calls = []
    real = bitmask_batch.prefill_grammars
    monkeypatch.setattr("vtool.runtime.sampling.host.prefill_grammars", lambda rows: calls.append(real(rows)))
    run_steps(sample_batch, batched, np.random.default_rng(5), 60)
    run_steps(lambda logits, seqs: [sample_batch(logits[i:i + 1], [s]) for i, s in enumerate(seqs)],
              one_by_one, np.random.default_rng(5), 60)
    assert [s.output_token_ids for s in batched] == [s.output_token_ids for s in one_by_one]
    assert calls and max(calls) > 1  # the batch's grammars were prefilled together


# --- grammar rows on the device (the CPU build of the sampler library) ---------------------------

@pytest.fixture(scope="module")
def cpu_sampler(smol, tmp_path_factory) -> DeviceSampler:
    from test_gpu_sampler import Library, build_cpu_library

    vocab = smol[1].vocab_size
    path = build_cpu_library(vocab, tmp_path_factory.mktemp("sampler-grammar"))
    return DeviceSampler(Library(path, "cpu", vocab))


@pytest.mark.slow
def test_device_grammar_rows_match_host(smol, cpu_sampler):
    tokenizer, compiler = smol
    assert cpu_sampler.masks_supported
    n = 12
    params, seeds = step_params(n), list(range(7, 7 + n))
    with_grammar = [i % 5 != 4 for i in range(n)]
    device = grammar_batch(compiler, params, seeds, with_grammar)
    host = grammar_batch(compiler, params, seeds, with_grammar)
    assert cpu_sampler.can_sample(device)
    got_logprobs, want_logprobs = [], []

    def on_device(logits, seqs):  # noqa: ANN001, ANN202
        got_logprobs.extend(r.logprob for r in cpu_sampler.sample_batch(logits, seqs))

    def on_host(logits, seqs):  # noqa: ANN001, ANN202
        # The host reports logprobs only when asked: take the raw log-softmax of its tokens.
        rows = logits.astype(np.float64)
        lse = np.log(np.exp(rows - rows.max(axis=1, keepdims=True)).sum(axis=1)) + rows.max(axis=1)
        want_logprobs.extend(rows[i, r.token_id] - lse[i] for i, r in enumerate(sample_batch(logits, seqs)))

    run_steps(on_device, device, np.random.default_rng(9), 80)  # a disallowed token would raise in accept()
    run_steps(on_host, host, np.random.default_rng(9), 80)
    assert [s.output_token_ids for s in device] == [s.output_token_ids for s in host]
    np.testing.assert_allclose(got_logprobs, want_logprobs, atol=2e-5)
    for seq in device:
        for p in seq.logits_processors:
            assert p.num_accepted == seq.num_generated  # each token accepted once
    # The tool-schema rows (greedy and random) ended in valid JSON.
    for i, seq in enumerate(device):
        if with_grammar[i] and i % len(specs()) in (0, 1) and seq.logits_processors[0].is_terminated():
            jsonschema.validate(json.loads(tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)),
                                TOOL_SCHEMA)


# --- the engine ----------------------------------------------------------------------------------

def engine_run(tiny_session, compiler, device_sampler, overlap: bool = False,  # noqa: ANN001, ANN201
               queued: list | None = None):
    """overlap: steps overlap as on a GPU (collect N, launch N+1, build N's outputs, then queue
    N+1's masked draw); `queued` collects, per queue_draw call, whether a draw was pending."""
    from vtool.runtime.engine.engine import Engine, EngineConfig

    engine = Engine(tiny_session, EngineConfig(grammar_jump_forward=False))
    engine.runner.device_sampler = device_sampler
    engine._overlap = overlap
    if queued is not None:
        real_queue = engine.runner.queue_draw
        engine.runner.queue_draw = lambda flight: queued.append(flight.pending_draw is not None) or real_queue(flight)
    masked = []
    if device_sampler is not None:
        real = device_sampler.prepare_batch

        def prepare_batch(seqs, **kw):  # noqa: ANN001, ANN202
            prepared = real(seqs, **kw)
            masked.append(prepared.bitmask is not None or prepared.mask_job is not None)
            return prepared

        device_sampler.prepare_batch = prepare_batch
    prompt = tiny_session.tokenizer.encode("Answer in JSON:", add_special_tokens=True)
    requests = {"tool": (GrammarSpec.json_schema(TOOL_SCHEMA, any_whitespace=False), SamplingParams(temperature=0, max_tokens=60)),
                "tool-random": (GrammarSpec.json_schema(TOOL_SCHEMA), SamplingParams(temperature=0.9, seed=3, max_tokens=60)),
                "choice": (GrammarSpec.choice(["left", "right"]), SamplingParams(temperature=1.0, seed=4, max_tokens=10)),
                "free": (None, SamplingParams(temperature=0.8, seed=5, max_tokens=20))}
    for name, (spec, params) in requests.items():
        engine.add_request(name, prompt, params, logits_processors=[compiler.processor(spec)] if spec else None)
    tokens = {name: [] for name in requests}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    if device_sampler is not None:
        del device_sampler.prepare_batch
    return tokens, masked


@pytest.mark.slow
def test_engine_samples_grammar_batches_on_the_device(tiny_session, cpu_sampler):
    from test_gpu_sampler import _OldVM

    tokenizer = tiny_session.tokenizer
    compiler = GrammarCompiler(tokenizer, vocab_size=tiny_session.model.vocab_size,
                               eos_token_ids=sorted(tiny_session.stop_ids))
    host, _ = engine_run(tiny_session, compiler, None)
    device, masked = engine_run(tiny_session, compiler, cpu_sampler)
    assert device == host
    assert any(masked)  # grammar batches went to the device, with masks
    # Overlapped steps: a masked draw waits, pending, until the previous step's outputs are built.
    queued: list[bool] = []
    overlapped, _ = engine_run(tiny_session, compiler, cpu_sampler, overlap=True, queued=queued)
    assert overlapped == host
    assert sum(queued) >= 2  # pending draws were queued (by step_core or, at the latest, finish)
    jsonschema.validate(json.loads(tokenizer.decode(device["tool"])), TOOL_SCHEMA)
    assert tokenizer.decode(device["choice"]) in ("left", "right")
    # A library built before the mask functions: the grammar batches stay on the host.
    old_model = copy.copy(cpu_sampler.model)
    old_model.vm = _OldVM(cpu_sampler.model.vm)
    old = DeviceSampler(old_model)
    assert not old.masks_supported
    tokens, masked = engine_run(tiny_session, compiler, old)
    assert tokens == host
    assert not any(masked)  # only the grammar-free steps (if any) sampled there, unmasked


# --- the figure ----------------------------------------------------------------------------------

def test_fill_timings_32_json_schemas(smol, capsys):
    """32 JSON-schema grammars, each at its own point of a tool call, masks filled one after
    another, in one parallel call (bitmask_batch's executor), and by bitmask_batch itself;
    printed, not asserted. Two batches: 32 distinct compiled grammars, and 32 requests of one
    schema (copies of one compiled grammar share llguidance's lexer: on many cores one call
    is slower than filling them in turn, and bitmask_batch fills them in turn)."""
    from llguidance.numpy import fill_next_token_bitmask_par

    tokenizer, compiler = smol
    B = 32
    distinct = [compiler.compile(GrammarSpec.json_schema({**TOOL_SCHEMA, "title": f"schema {i}"})) for i in range(B)]
    one = [compiler.compile(GrammarSpec.json_schema(TOOL_SCHEMA))] * B
    text = [tokenizer.encode(json.dumps({"location": "Paris, France"[: 3 + i % 11], "unit": "celsius",
                                         "days": 1 + i % 9, "tags": ["ab", "c"][: i % 3]}), add_special_tokens=False)
            for i in range(B)]
    width = bitmask_words(compiler.vocab_size)
    words = np.empty((B, width), np.int32)

    def at(compiled, step: int) -> list[GrammarProcessor]:  # noqa: ANN001
        out = []
        for i in range(B):
            p = GrammarProcessor(compiled[i])
            for token in text[i][: (3 * i + step) % len(text[i])]:
                p.accept(token)
            out.append(p)
        return out

    def serial(ps):  # noqa: ANN001, ANN202
        for k, p in enumerate(ps):
            p.matcher.unsafe_compute_mask_ptr(words[k].ctypes.data, width * 4)

    def one_call(ps):  # noqa: ANN001, ANN202
        fill_next_token_bitmask_par(bitmask_batch.executor(), [(p.matcher, k) for k, p in enumerate(ps)], words)

    def module(ps):  # noqa: ANN001, ANN202 - what the samplers use (one call unless one grammar)
        bitmask_batch.fill_batch_bitmask([[p] for p in ps], words)

    cores = len(os.sched_getaffinity(0))
    lines = []
    for label, compiled in (("32 distinct schemas", distinct), ("one schema, 32 requests", one)):
        for step in range(30):  # warm: every state visited once (lexer caches are per compiled grammar)
            serial(at(compiled, step))
        fills = [("serial", serial), ("one parallel call", one_call), ("bitmask_batch", module)]
        seconds = {name: [] for name, _ in fills}
        for step in range(40):
            reference = None
            for name, fill in (fills if step % 2 else fills[::-1]):
                ps = at(compiled, step % 30)
                t0 = time.perf_counter()
                fill(ps)
                seconds[name].append(time.perf_counter() - t0)
                if reference is None:
                    reference = words.copy()
                np.testing.assert_array_equal(words, reference)
        lines.append(f"  {label}: " + ", ".join(
            f"{name} median {statistics.median(s) * 1e3:.2f} ms (mean {statistics.mean(s) * 1e3:.2f})"
            for name, s in seconds.items()))
    with capsys.disabled():
        print(f"\n[grammar batch fill] {B} JSON-schema masks per step, vocab {compiler.vocab_size}, "
              f"{cores} cores, parallel on LLExecutor({cores}):")
        print("\n".join(lines))
