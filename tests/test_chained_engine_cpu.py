"""The GPU engine's default decode path, forced on the CPU: chained steps (engine/chained_steps.py)
whose model call runs on the model thread while the previous step is collected and its outputs
built beside it (engine/model_thread.py), the KV cache holding removals meanwhile.

A CPU build samples on the host, so its library leaves out the compiled sampling functions the
chained path draws with; this module builds the tiny model for the host with them added (the
functions a CUDA build links, compiled for the CPU), gives a CPU engine a device sampler over them
and overlapped launches, and lets the engine arrange its chains as a GPU engine would. Real TVM
calls throughout (the model's entry points on the worker thread, the draw, the token gather); the
tokens must equal those of the plain CPU engine that waits for every step and samples on the host.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vtool.runtime.engine.chain_rule import OneSequenceChains
from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def sampling_session(tiny_model_dir, tmp_path_factory):
    """The tiny model's host build with the compiled sampling functions beside its entry points
    and decode in two calls as a CUDA build has it (built into a folder of this module's, never
    the shared artifact cache)."""
    import vtool.toolchain.build as build
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.schedules.cuda.sampler import sampler_module

    real = build.family_of

    def with_sampler(spec):  # noqa: ANN001, ANN202
        return dataclasses.replace(real(spec), extra_modules=lambda cfg: [sampler_module(cfg.vocab_size)])

    patch = pytest.MonkeyPatch()
    patch.setattr(build, "family_of", with_sampler)
    patch.setattr(build, "splits_decode", lambda _target: True)  # decode_hidden / decode_logits, as CUDA builds
    try:
        folder = build.build_artifact(tiny_model_dir, "host", output=tmp_path_factory.mktemp("sampling") / "a",
                                      force=True)
    finally:
        patch.undo()
    return open_session(folder, open_checkpoint(tiny_model_dir), max_model_len=256)


def gpu_like(engine: Engine) -> Engine:
    """What a GPU engine has, on the CPU: launches it collects a call later, draws on the device
    sampler (the library's compiled functions), and chains arranged from those."""
    from vtool.runtime.sampling.device import DeviceSampler

    engine._overlap = True
    engine.runner.device_sampler = DeviceSampler(engine.model)
    engine._arrange_chains()
    return engine


PROMPTS = ["The quick brown fox", "Hi", "In 1905 Einstein published four papers", "def add(a, b):", "Un deux",
           "Once upon a time"]


def requests_for(session, seed: int) -> list[tuple[str, list[int], SamplingParams]]:  # noqa: ANN001
    rng = np.random.default_rng(seed)
    out = []
    for i, prompt in enumerate(PROMPTS):
        ids = session.tokenizer.encode(prompt)
        params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(6, 24)), ignore_eos=True) if i % 2 \
            else SamplingParams(temperature=0.9, seed=int(rng.integers(0, 1000)), max_tokens=int(rng.integers(6, 24)),
                                ignore_eos=True)
        out.append((f"r{i}", ids, params))
    return out


def run(engine: Engine, requests, arrive_at: dict[str, int], abort_at: dict[str, int] | None = None,
        early: list[int] | None = None) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Step the engine, adding each request at its step and aborting some; tokens and finish reasons.
    early: take outputs through step_core's on_outputs too (what it got is counted there)."""
    got: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}

    def take(outs) -> None:  # noqa: ANN001
        for out in outs:
            got[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason

    def take_early(outs) -> None:  # noqa: ANN001
        early.append(len(outs))
        take(outs)

    for step in range(2000):
        for rid, ids, params in requests:
            if arrive_at[rid] == step:
                engine.add_request(rid, ids, params, with_text=False)
                got[rid] = []
        for rid, at in (abort_at or {}).items():
            if at == step:
                engine.abort(rid)
                reasons[rid] = "abort"
        if step > max(arrive_at.values()) and not engine.has_unfinished():
            break
        take(engine.step_core(on_outputs=take_early if early is not None else None))
    assert not engine.has_unfinished(), "the engine stopped making progress"
    assert engine._in_flight is None and not engine.requests
    assert engine.kv.in_sync() and engine.kv.blocks.num_free_blocks + (
        engine.prefix_cache.evictable_blocks() if engine.prefix_cache else 0) == engine.kv.blocks.num_blocks
    return got, reasons


@pytest.mark.parametrize("seed", [0, 1])
def test_chained_steps_on_the_model_thread_give_the_waiting_engines_tokens(sampling_session, seed):
    """Requests arriving two at a time while others decode (admissions break the chains, requests
    ending inside a chain free their blocks after the call), greedy and seeded: every token equals
    the plain CPU engine's, and most decode steps were chained with their call on the thread."""
    requests = requests_for(sampling_session, seed)
    arrive_at = {rid: 3 * (i // 2) for i, (rid, _, _) in enumerate(requests)}
    plain = Engine(sampling_session, EngineConfig(max_num_seqs=4))
    want = run(plain, requests, arrive_at)
    engine = gpu_like(Engine(sampling_session, EngineConfig(max_num_seqs=4)))
    try:
        got = run(engine, requests, arrive_at)
        calls, chained = engine.model_thread.overlapped_calls, engine.counters.chained_steps
    finally:
        engine.model_thread.close()
    print(f"[chained on the model thread, seed {seed}] {chained} of {engine.counters.steps} steps chained, "
          f"{calls} model calls beside host work")
    assert got == want
    assert chained >= 10 and calls >= chained // 2, f"{chained} chained steps, {calls} calls beside host work"


def test_a_request_aborted_inside_a_chain_frees_its_blocks(sampling_session):
    requests = requests_for(sampling_session, 2)
    arrive_at = {rid: 0 for rid, _, _ in requests}
    keep = [r for r in requests if r[0] != "r4"]
    alone = run(Engine(sampling_session, EngineConfig(max_num_seqs=8)), keep, {rid: 0 for rid, _, _ in keep})
    engine = gpu_like(Engine(sampling_session, EngineConfig(max_num_seqs=8)))
    try:
        got, reasons = run(engine, requests, arrive_at, abort_at={"r4": 5})
    finally:
        engine.model_thread.close()
    assert reasons["r4"] == "abort" and len(got["r4"]) < requests[4][2].max_tokens
    assert {k: v for k, v in got.items() if k != "r4"} == alone[0]
    assert engine.counters.chained_steps > 0


def test_one_sequence_does_not_chain_by_default_but_does_when_asked(sampling_session):
    """On the CPU a launch computes the step, so the host never waits for a device: the engine's
    timings of its one-sequence steps (chain_rule.py) call them host-bound, and they never chain
    unless asked to."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = sampling_session.tokenizer.encode("Hello there")
    counts = {}
    for chain in (None, True):
        engine = gpu_like(Engine(sampling_session, EngineConfig(chain_steps=chain)))
        try:
            run(engine, [("r0", ids, params)], {"r0": 0})
            counts[chain] = engine.counters.chained_steps
            rule = engine.one_sequence_chains
        finally:
            engine.model_thread.close()
        if chain is None:
            assert rule is not None and rule.observed == rule.window and not rule.device_bound
        else:
            assert rule is None  # asked for: no decision to make
    assert counts[None] == 0 and counts[True] >= 20


class DecidesAfterWindow(OneSequenceChains):
    """Judges one-sequence steps device-bound once it has timed a window of them, whatever the
    timings (a CPU launch computes its step, so real timings never say so here)."""

    def observe(self, queued_seconds: float, waited_seconds: float) -> bool:
        super().observe(0.0, 1.0)
        return self.device_bound


@pytest.mark.parametrize("seed", [4, 5])
def test_one_sequence_steps_chain_once_judged_device_bound(sampling_session, seed):
    """When the rule judges one-sequence steps device-bound, the engine fences them and chains the
    following ones (not the very next: its predecessor recorded no fence); the tokens stay those of
    the waiting engine, greedy and seeded, with a second request arriving and leaving meanwhile."""
    encode = sampling_session.tokenizer.encode
    requests = [("alone", encode("Once upon a time"), SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)),
                ("joins", encode("Un deux"), SamplingParams(temperature=0.9, seed=seed, max_tokens=12, ignore_eos=True))]
    arrive_at = {"alone": 0, "joins": 20}
    want = run(Engine(sampling_session, EngineConfig(max_num_seqs=4)), requests, arrive_at)
    chained = {}
    for judged in (False, True):
        engine = gpu_like(Engine(sampling_session, EngineConfig(max_num_seqs=4)))
        if judged:
            engine.one_sequence_chains = DecidesAfterWindow(window=3)
        try:
            got = run(engine, requests, arrive_at)
        finally:
            engine.model_thread.close()
        assert got == want
        chained[judged] = engine.counters.chained_steps
    assert engine.one_sequence_chains.device_bound and engine._chain_min_rows == 1
    # "alone" runs ~19 steps alone before "joins" and ~26 after: all but the judged window and the
    # step that first records the fence chain now
    assert chained[True] >= chained[False] + 30, chained


def test_outputs_built_beside_the_model_call_can_leave_at_once(sampling_session):
    """step_core(on_outputs=...) hands over the outputs built beside a chained step's call while it
    runs (the engine core sends them then); with what step_core returns, they are exactly the
    outputs of the run without it."""
    requests = requests_for(sampling_session, 3)
    arrive_at = {rid: 2 * i for i, (rid, _, _) in enumerate(requests)}
    engine = gpu_like(Engine(sampling_session, EngineConfig(max_num_seqs=4)))
    early: list[int] = []
    try:
        got = run(engine, requests, arrive_at, early=early)
    finally:
        engine.model_thread.close()
    want = run(Engine(sampling_session, EngineConfig(max_num_seqs=4)), requests, arrive_at)
    assert got == want
    assert len(early) >= 5 and all(n > 0 for n in early), early


def test_a_chained_step_of_one_sequence_computes_decodes_logits_in_two_calls(sampling_session):
    """A chained one-sequence step runs decode_hidden, then (after the KV cache's fence) decode_logits:
    its logits equal `decode`'s bit for bit, step after step, with a new KV page begun midway
    (test_gpu_split_decode.py holds a CUDA build to the same)."""
    from two_call_decode import assert_two_calls_give_decodes_logits

    assert_two_calls_give_decodes_logits(sampling_session.model)
