"""Overlapped steps (Engine.step_core with one step in flight, vLLM's async scheduling):
forced on the CPU, where a launch computes at once and its outputs come a call later, they
must give exactly what one step at a time gives: tokens, finish reasons, stop strings,
seeds, aborts in flight, preemption and prefix caching."""
from __future__ import annotations

import numpy as np
import pytest

from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.sampling.params import SamplingParams

PROMPTS = ["The quick brown fox", "Hi", "In 1905 Einstein published four papers", "def add(a, b):", "Un deux"]


def overlapped(engine: Engine) -> Engine:
    engine._overlap = True  # what a GPU runner gets; here the launch computes, finish waits a call
    return engine


def run(engine: Engine, requests, abort_after: dict[str, int] | None = None):
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    got = {rid: [] for rid, _, _ in requests}
    ends = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
            if out.finished:
                ends[out.request_id] = (out.finish_reason, out.stop_reason, out.num_output_tokens)
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort(rid)
        assert steps < 5000
    assert engine.kv.in_sync()
    assert engine.kv.blocks.num_free_blocks + (engine.prefix_cache.evictable_blocks() if engine.prefix_cache else 0) \
        == engine.kv.blocks.num_blocks  # every block back
    return got, ends


def cases(session, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for i, prompt in enumerate(PROMPTS):
        ids = session.tokenizer.encode(prompt)
        kind = i % 3
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 20)), ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(temperature=1.0, seed=int(rng.integers(0, 1000)), max_tokens=15, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=30, stop=[" the", "a"], ignore_eos=True)
        out.append((f"r{i}", ids, params))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("config", [
    EngineConfig(max_num_batched_tokens=16),  # chunked prefill beside decodes
    EngineConfig(num_blocks=6, max_num_seqs=4),  # preemption
])
def test_overlapped_steps_give_what_one_step_at_a_time_gives(tiny_session, seed, config):
    one = run(Engine(tiny_session, config), cases(tiny_session, seed))
    two = run(overlapped(Engine(tiny_session, config)), cases(tiny_session, seed))
    assert two == one


def test_a_request_aborted_while_its_step_is_in_flight_frees_its_blocks(tiny_session):
    requests = cases(tiny_session, 5)
    alone = run(Engine(tiny_session, EngineConfig()), [r for r in requests if r[0] != "r1"])
    engine = overlapped(Engine(tiny_session, EngineConfig()))
    got, ends = run(engine, requests, abort_after={"r1": 3})  # r1: seeded, 15 tokens, no stop strings
    assert engine._in_flight is None and not engine.requests
    assert "r1" not in ends and len(got["r1"]) < requests[1][2].max_tokens
    assert {k: v for k, v in got.items() if k != "r1"} == alone[0]
    assert engine.counters.finished.get("abort") == 1



def test_the_cpu_engine_has_no_model_thread_and_does_not_chain(tiny_session):
    """On the CPU a model call is the computation (Python beside it would take a core from TVM's
    thread pool) and steps do not chain (the draw is on the host): the defaults ask for both."""
    engine = Engine(tiny_session, EngineConfig())
    assert engine.config.chain_steps is None and engine.config.overlap_model_calls
    assert engine.model_thread is None and engine.runner.model_thread is None and not engine._chains
