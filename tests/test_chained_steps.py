"""Chained decode steps (runtime/engine/chained_steps.py): which steps may be queued before the
previous step's tokens are on the host, and how their input tokens are gathered on the device.

The engine-level behaviour (the same tokens with and without chaining, blocks freed, stop tokens
and aborts one step late) needs a device sampler, so it is tested on the GPU
(tests/test_gpu_parity.py, test_smollm2_chained_steps_change_no_token); here the pieces run on the
CPU: the decision, the copy plan, and the gather through the TVM runtime's own tensor copies.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtool.runtime.engine.chained_steps import (PENDING_TOKEN, DeviceTokens, chain_rows, chained_step, copy_runs,
                                                fill_token_ids)
from vtool.runtime.engine.request import Request, Status
from vtool.runtime.engine.step_types import ScheduledSequence, SchedulerOutput
from vtool.runtime.sampling.host import SequenceSampler
from vtool.runtime.sampling.params import SamplingParams

VOCAB = 100


# -- the copy plan --------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.integers(0, 200), unique=True, max_size=70))
def test_copy_runs_move_each_row_once_in_maximal_runs(rows):
    runs = copy_runs(rows)
    moved = {}
    for dst, src, n in runs:
        assert n >= 1
        for k in range(n):
            assert dst + k not in moved, "a destination written twice"
            moved[dst + k] = src + k
    assert moved == dict(enumerate(rows))
    for (d0, s0, n0), (d1, s1, _) in zip(runs, runs[1:]):
        assert not (d0 + n0 == d1 and s0 + n0 == s1), "two runs that are one"


def test_copy_runs_of_a_batch_that_lost_one_sequence_are_two():
    assert copy_runs(list(range(64))) == [(0, 0, 64)]
    assert copy_runs([0, 1, 2, 4, 5]) == [(0, 0, 3), (3, 4, 2)]
    assert copy_runs([]) == []


# -- the gather, through the TVM runtime's tensors (CPU here, the same calls on a GPU) ------

@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_fill_token_ids_puts_each_rows_drawn_token_in_place(tiny_session, data):
    model = tiny_session.model
    drawn = np.asarray(data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40), label="drawn"),
                       np.int32)
    rows = sorted(data.draw(st.sets(st.integers(0, len(drawn) - 1), min_size=1), label="rows"))
    pads = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=8), label="pads")
    source = model.upload(drawn)
    ids = fill_token_ids(model, [PENDING_TOKEN] * len(rows) + pads, DeviceTokens(source, tuple(rows)))
    got = model.to_numpy(ids).tolist()
    assert got == drawn[rows].tolist() + pads


def test_fill_token_ids_never_uploads_the_pending_marker(tiny_session):
    """A row the copies do not cover (none should) holds token 0, not -1: an embedding lookup
    at -1 would read outside the table."""
    model = tiny_session.model
    source = model.upload(np.asarray([7, 8], np.int32))
    ids = fill_token_ids(model, [PENDING_TOKEN, PENDING_TOKEN, 5], DeviceTokens(source, (1,)))
    assert model.to_numpy(ids).tolist() == [8, 0, 5]


# -- which steps chain ------------------------------------------------------------------------

def _request(i: int, prompt: int = 4, out: int = 3, max_tokens: int = 20, **params) -> Request:
    p = SamplingParams(max_tokens=max_tokens, **params)
    prompt_ids = list(range(1, prompt + 1))
    r = Request(request_id=f"r{i}", prompt_ids=prompt_ids, params=p, max_tokens=max_tokens,
                sampler=SequenceSampler(p, prompt_ids, [0], VOCAB))
    r.output_ids = list(range(10, 10 + out))
    r.seq_id, r.status = i, Status.RUNNING
    r.num_computed = r.num_tokens - 1
    return r


def _decode(r: Request, **fields) -> ScheduledSequence:
    fields.setdefault("logits_processors", r.sampler.logits_processors)
    return ScheduledSequence(request_id=r.request_id, seq_id=r.seq_id, token_ids=(r.output_ids[-1],),
                             num_computed=r.num_computed, num_logit_rows=1, sample=True, sampler=r.sampler,
                             **fields)


def _room(r: Request) -> int:
    return r.max_tokens - len(r.output_ids)


def _rows(requests, step=None, on_device=True, running=None, can_admit=False, budget=1024):
    step = step or SchedulerOutput(tuple(_decode(r) for r in requests))
    return chain_rows(requests, step, on_device, requests if running is None else running, can_admit, budget, _room)


def test_plain_decoding_chains_every_sequence():
    requests = [_request(i) for i in range(4)]
    assert _rows(requests) == [0, 1, 2, 3]


def test_a_finished_request_leaves_the_chained_step():
    requests = [_request(i) for i in range(4)]
    requests[2].status = Status.FINISHED
    assert _rows(requests, running=[requests[0], requests[1], requests[3]]) == [0, 1, 3]
    for r in requests:
        r.status = Status.FINISHED
    assert _rows(requests, running=[]) is None  # nothing left to run


@pytest.mark.parametrize("why", ["host draw", "admission", "mid prompt", "no room", "other running",
                                 "grammar", "drafts", "prompt logits", "budget", "repetition penalty",
                                 "frequency penalty", "min_tokens"])
def test_a_step_the_scheduler_must_decide_does_not_chain(why):
    requests = [_request(i) for i in range(3)]
    kw: dict = {}
    edits = {"repetition penalty": dict(repetition_penalty=1.2), "frequency penalty": dict(frequency_penalty=0.5),
             "min_tokens": dict(min_tokens=2)}
    if why in edits:  # the device applies these edits, but they depend on the token being drawn
        requests[1] = _request(1, **edits[why])
    if why == "host draw":
        kw["on_device"] = False
    elif why == "admission":
        kw["can_admit"] = True
    elif why == "mid prompt":  # a prompt chunk that does not finish its prompt samples nothing
        r = requests[1]
        r.output_ids, r.num_computed = [], 0
        mid = ScheduledSequence(request_id=r.request_id, seq_id=r.seq_id, token_ids=(1, 2), num_computed=0,
                                num_logit_rows=0, sample=False)
        kw["step"] = SchedulerOutput((_decode(requests[0]), mid, _decode(requests[2])))
    elif why == "no room":  # the launched step's token and one more must fit
        requests[0].max_tokens = len(requests[0].output_ids) + 1
    elif why == "other running":
        kw["running"] = requests + [_request(9)]
    elif why == "grammar":
        kw["step"] = SchedulerOutput(tuple(_decode(r, logits_processors=(object(),)) for r in requests))
    elif why == "drafts":
        r = requests[0]
        drafted = ScheduledSequence(request_id=r.request_id, seq_id=r.seq_id, token_ids=(5, 6), num_computed=3,
                                    num_logit_rows=2, sample=True, sampler=r.sampler, draft_ids=(6,))
        kw["step"] = SchedulerOutput((drafted, *(_decode(x) for x in requests[1:])))
    elif why == "prompt logits":
        kw["step"] = SchedulerOutput(tuple(_decode(r, return_logits=True) for r in requests))
    elif why == "budget":
        kw["budget"] = 2
    assert _rows(requests, **kw) is None


def test_a_logit_bias_alone_chains():
    """logit_bias edits the same tokens every step: the chained step may be prepared early."""
    requests = [_request(0, logit_bias={5: 3.0}), _request(1)]
    assert _rows(requests) == [0, 1]


def test_room_for_exactly_two_more_tokens_chains():
    r = _request(0)
    r.max_tokens = len(r.output_ids) + 2
    assert _rows([r]) == [0]


def test_the_chained_step_decodes_after_the_launched_one():
    """A decode moves one position on; a prompt's last chunk moves past the whole chunk."""
    a, b = _request(0), _request(1, prompt=9, out=0)
    b.num_computed = 5
    last_chunk = ScheduledSequence(request_id=b.request_id, seq_id=b.seq_id, token_ids=(6, 7, 8, 9),
                                   num_computed=5, num_logit_rows=1, sample=True, sampler=b.sampler)
    step = chained_step([a, b], [_decode(a), last_chunk])
    assert [s.token_ids for s in step.sequences] == [(PENDING_TOKEN,), (PENDING_TOKEN,)]
    assert [s.num_computed for s in step.sequences] == [a.num_computed + 1, 9]
    assert all(s.sample and s.num_logit_rows == 1 and s.sampler is r.sampler
               for s, r in zip(step.sequences, [a, b]))
    assert step.all_decode and [s.seq_id for s in step.sequences] == [0, 1]


# -- a decode step whose tokens are on the device, through the model (CPU build) --------------

@pytest.mark.parametrize("buckets", ["off", ((2, 4, 8), "batch_decode")], ids=["own size", "padded"])
def test_a_step_reading_its_tokens_on_the_device_computes_what_host_tokens_do(tiny_session, buckets):
    """The same decode steps twice on TVM's paged KV cache: tokens uploaded from the host, and
    tokens gathered from a "drawn" tensor (other rows in between, a sequence gone midway):
    identical logits, unpadded and padded (the host build's batch_decode at bucket sizes)."""
    from test_cuda_graph_buckets import Harness

    model = tiny_session.model
    host, device = Harness.make(model, 200, 16, buckets), Harness.make(model, 200, 16, buckets)
    rng = np.random.default_rng(0)
    live = list(range(5))
    for s in live:
        prompt = rng.integers(1, model.vocab_size, size=3 + 2 * s).tolist()
        host.prefill(s, prompt)
        device.prefill(s, prompt)
    for step_index in range(4):
        if step_index == 2:
            for h in (host, device):
                h.leave(2)
            live.remove(2)
        nxt = {s: int(rng.integers(1, model.vocab_size)) for s in live}
        want = host.decode(nxt)
        # the drawn tensor holds the tokens at odd rows, junk ids at even ones
        drawn = np.zeros(2 * len(live) + 1, np.int32)
        drawn[1::2][: len(live)] = [nxt[s] for s in live]
        drawn[0::2] = rng.integers(1, model.vocab_size, size=len(drawn[0::2]))
        rows = tuple(1 + 2 * i for i in range(len(live)))
        step = SchedulerOutput(tuple(ScheduledSequence(f"r{s}", s, (PENDING_TOKEN,), len(device.tokens[s]), 1, False,
                                                       return_logits=True) for s in live))
        results = device.runner.finish(device.runner.launch(step, DeviceTokens(model.upload(drawn), rows))).results
        for s in live:
            device.tokens[s].append(nxt[s])
        for s, result in zip(live, results):
            np.testing.assert_array_equal(result.logits[-1], want[s], err_msg=f"step {step_index}, sequence {s}")


@given(st.text(min_size=1, max_size=8), st.integers(0, 1 << 40), st.integers(-1, 1 << 20), st.integers(0, 1 << 20))
def test_a_decode_row_is_the_row_init_makes(request_id, seq_id, token, num_computed):
    """ScheduledSequence.decode_row skips the frozen __init__ for speed: every field, defaults
    included, must still be what __init__ sets (a field added later fails here)."""
    sampler = SequenceSampler(SamplingParams())
    fast = ScheduledSequence.decode_row(request_id, seq_id, token, num_computed, sampler)
    slow = ScheduledSequence(request_id=request_id, seq_id=seq_id, token_ids=(token,), num_computed=num_computed,
                             num_logit_rows=1, sample=True, sampler=sampler)
    assert fast == slow and vars(fast) == vars(slow) and hash(fast.token_ids) == hash(slow.token_ids)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.num_computed = 0
