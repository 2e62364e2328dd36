"""Mixed steps run as two calls (runtime/engine/mixed_steps.py): prompt chunks through
batch_prefill, one-token sequences as an all-decode step, the wanted rows gathered in the step's
order. On the CPU (opt-in, forced here) against the same sequences run as two separate steps, bit
for bit, and through the engine."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtool.runtime.engine.chained_steps import part_runs as copy_runs
from vtool.runtime.engine.mixed_steps import row_sources, split_rows, splits_mixed_steps
from vtool.runtime.engine.step_types import ScheduledSequence, SchedulerOutput


def _seq(i: int, n: int, **kw) -> ScheduledSequence:
    return ScheduledSequence(f"r{i}", i, tuple(range(1, n + 1)), 5, 1, False, **kw)


def test_split_rows_takes_only_steps_with_both_kinds_and_one_row_each():
    step = SchedulerOutput((_seq(0, 1), _seq(1, 7), _seq(2, 1)))
    assert split_rows(step) == ([0, 2], [1])
    assert split_rows(SchedulerOutput((_seq(0, 1), _seq(1, 1)))) is None  # all decode
    assert split_rows(SchedulerOutput((_seq(0, 4), _seq(1, 7)))) is None  # prompts only
    assert split_rows(SchedulerOutput((_seq(0, 1), _seq(1, 7, return_logits=True)))) is None
    from vtool.runtime.sampling.host import SequenceSampler
    from vtool.runtime.sampling.params import SamplingParams

    drafts = ScheduledSequence("d", 3, (5, 6, 7), 5, 3, True, sampler=SequenceSampler(SamplingParams()),
                               draft_ids=(6, 7))
    assert split_rows(SchedulerOutput((_seq(0, 1), drafts))) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=2, max_size=40).filter(lambda k: any(k) and not all(k)))
def test_every_wanted_row_is_copied_once_from_its_part(kinds):
    """Any interleaving of one-token and prompt sequences: the copies put each sequence's row at
    its place in the step's order, every destination row written exactly once."""
    ones = [i for i, one in enumerate(kinds) if one]
    rest = [i for i, one in enumerate(kinds) if not one]
    owners = list(range(len(kinds)))
    parts = [(ones, list(range(len(ones)))), (rest, list(range(len(rest))))]
    sources = row_sources(owners, parts)
    written = []
    for part, src, dst, n in copy_runs(sources):
        for k in range(n):
            indices = parts[part][0]
            assert indices[src + k] == owners[dst + k]  # the row of the right sequence
            written.append(dst + k)
    assert sorted(written) == owners
    assert len(copy_runs(sources)) == 1 + sum(a != b for a, b in zip(kinds, kinds[1:]))


def test_steps_split_only_when_asked(monkeypatch):
    monkeypatch.delenv("VTOOL_SPLIT_MIXED_STEPS", raising=False)
    assert not splits_mixed_steps()
    monkeypatch.setenv("VTOOL_SPLIT_MIXED_STEPS", "0")
    assert not splits_mixed_steps()
    monkeypatch.setenv("VTOOL_SPLIT_MIXED_STEPS", "1")
    assert splits_mixed_steps()


def test_a_split_step_computes_what_its_two_halves_compute_as_steps(tiny_session):
    """Two running sequences decode beside a new prompt and a running prompt's second chunk:
    the split step's rows equal those of the same sequences run as two steps on a twin cache."""
    from test_cuda_graph_buckets import Harness

    model = tiny_session.model
    split, twin = Harness.make(model, 200, 16), Harness.make(model, 200, 16)
    split.runner.split_mixed = True
    rng = np.random.default_rng(3)
    for s in (0, 1):
        prompt = rng.integers(1, model.vocab_size, size=6 + s).tolist()
        split.prefill(s, prompt)
        twin.prefill(s, prompt)
    long_prompt = rng.integers(1, model.vocab_size, size=20).tolist()
    for h in (split, twin):
        h.kv.add(2)
        h.runner.execute(SchedulerOutput((ScheduledSequence("r2", 2, tuple(long_prompt[:8]), 0, 0, False),)))
        h.kv.add(3)
    new_prompt = rng.integers(1, model.vocab_size, size=9).tolist()
    nxt = {0: int(rng.integers(1, model.vocab_size)), 1: int(rng.integers(1, model.vocab_size))}

    def decode(s: int) -> ScheduledSequence:
        return ScheduledSequence(f"r{s}", s, (nxt[s],), len(split.tokens[s]), 1, False, return_logits=False)

    chunk = ScheduledSequence("r2", 2, tuple(long_prompt[8:]), 8, 1, False)
    fresh = ScheduledSequence("r3", 3, tuple(new_prompt), 0, 1, False)
    mixed = SchedulerOutput((decode(0), chunk, decode(1), fresh))  # interleaved on purpose
    flight = split.runner.launch(mixed)
    rows = flight.logits.host()
    assert flight.logits.num_rows == 4 and split.kv.in_sync()
    decodes = twin.runner.launch(SchedulerOutput((decode(0), decode(1)))).logits.host()
    prompts = twin.runner.launch(SchedulerOutput((chunk, fresh))).logits.host()
    np.testing.assert_array_equal(rows[0], decodes[0])
    np.testing.assert_array_equal(rows[1], prompts[0])
    np.testing.assert_array_equal(rows[2], decodes[1])
    np.testing.assert_array_equal(rows[3], prompts[1])


@pytest.mark.parametrize("seed", [0, 1])
def test_the_engine_with_split_steps_gives_the_same_tokens(tiny_session, seed):
    """Requests arriving while others decode (mixed steps), greedy and seeded: the same tokens
    with the steps split as without (float32: the decode rows' numerics differ by rounding only)."""
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.sampling.params import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, tiny_session.model.vocab_size, size=int(rng.integers(3, 40))).tolist()
               for _ in range(6)]

    def run(split: bool) -> tuple[dict[str, list[int]], int]:
        engine = Engine(tiny_session, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32))
        engine.runner.split_mixed = split
        got: dict[str, list[int]] = {}
        for step_index in range(400):
            if step_index % 3 == 0 and step_index // 3 < len(prompts):
                k = step_index // 3
                params = SamplingParams(max_tokens=12, ignore_eos=True,
                                        **({"temperature": 0.0} if k % 2 else {"temperature": 0.9, "seed": k}))
                engine.add_request(f"q{k}", prompts[k], params, with_text=False)
                got[f"q{k}"] = []
            if not engine.has_unfinished() and step_index > 3 * len(prompts):
                break
            for out in engine.step_core():
                got[out.request_id].extend(out.new_token_ids)
        assert engine.kv.in_sync()
        return got, engine.runner.split_steps

    plain, none_split = run(False)
    split, splits = run(True)
    assert none_split == 0 and splits >= 3, f"{splits} steps split"
    assert split == plain
    assert all(len(v) == 12 for v in split.values())
