"""The model thread (runtime/engine/model_thread.py): an entry-point call on a worker thread with
the engine's host work beside it, and the KV cache holding removals meanwhile (kv_cache.py).
The engine's use of it is in test_engine_overlap.py; on a GPU in test_gpu_parity.py."""
from __future__ import annotations

import threading
import time

import pytest

from vtool import VtoolError
from vtool.runtime.engine.model_thread import ModelThread


@pytest.fixture
def model_thread():
    bound: list[str] = []
    thread = ModelThread(lambda: bound.append(threading.current_thread().name))
    thread.bound = bound
    yield thread
    thread.close()


def test_an_unseen_call_runs_alone_on_the_callers_thread(model_thread):
    """A call whose CUDA graphs may still be captured runs here and leaves `beside` to the caller."""
    ran_on: list[str] = []
    beside_ran: list[bool] = []
    result = model_thread.call("k", lambda x: ran_on.append(threading.current_thread().name) or x + 1, (1,),
                               lambda: beside_ran.append(True))
    assert result == 2 and ran_on == [threading.current_thread().name] and beside_ran == []
    assert model_thread.knows("k") and not model_thread.knows("other")
    assert model_thread.overlapped_calls == 0


def test_a_seen_call_runs_on_the_worker_while_beside_runs_here(model_thread):
    """Both at once: the call waits for an event only `beside` sets (one at a time would time out)."""
    model_thread.call("k", lambda: None, (), None)
    both = threading.Event()
    ran_on: list[str] = []

    def fn() -> bool:
        ran_on.append(threading.current_thread().name)
        return both.wait(10)

    beside_on: list[str] = []
    assert model_thread.call("k", fn, (), lambda: beside_on.append(threading.current_thread().name) or both.set())
    assert ran_on[0].startswith("vtool-model") and beside_on == [threading.current_thread().name]
    assert model_thread.bound and model_thread.bound[0].startswith("vtool-model")  # bound before its first call
    assert model_thread.overlapped_calls == 1


def test_errors_of_either_side_come_back_after_both_ended(model_thread):
    model_thread.call("k", lambda: None, (), None)
    ended: list[str] = []

    def failing_call() -> None:
        time.sleep(0.05)
        ended.append("call")
        raise ValueError("the call failed")

    with pytest.raises(ValueError, match="the call failed"):
        model_thread.call("k", failing_call, (), lambda: ended.append("beside"))
    assert sorted(ended) == ["beside", "call"]

    def slow_call() -> int:
        time.sleep(0.05)
        ended.append("slow call")
        return 3

    def failing_beside() -> None:
        raise RuntimeError("beside failed")

    with pytest.raises(RuntimeError, match="beside failed"):
        model_thread.call("k", slow_call, (), failing_beside)
    assert ended[-1] == "slow call"  # the call was waited for before the error came back


def test_tvm_calls_release_the_gil_so_python_runs_beside_them(model_thread, tiny_session):
    """What the overlap rests on: TVM's FFI lets go of the GIL for the length of a call (here one of
    tvm_ffi's own long-running test functions); the host work beside it makes progress meanwhile.
    And the library's entry points are such FFI functions."""
    import tvm_ffi

    assert tiny_session.model.function("batch_decode").release_gil
    long_call = tvm_ffi.get_global_func("testing.run_check_signal")
    model_thread.call("long", lambda: None, (), None)
    done = threading.Event()
    counted: list[int] = []

    def call() -> None:
        long_call(1)  # one second inside C++
        done.set()

    def beside() -> None:
        n = 0
        while not done.is_set():
            n += 1
        counted.append(n)

    start = time.perf_counter()
    model_thread.call("long", call, (), beside)
    assert time.perf_counter() - start < 1.8  # beside did not run after the call
    assert counted[0] > 10_000, f"only {counted[0]} loops of Python ran beside a one-second TVM call"


def test_the_kv_cache_holds_removals_until_the_end(tiny_session):
    from vtool.runtime.engine.kv_cache import PagedKVCache

    kv = PagedKVCache(tiny_session.model, 8, 16, 4, 64)
    empty = kv.blocks.num_free_blocks  # TVM may round the page count up
    for seq in (0, 1):
        kv.add(seq)
    kv.begin_forward([0, 1], [20, 5])
    kv.end_forward()
    free = kv.blocks.num_free_blocks
    with kv.holding_removals():
        kv.remove(0)
        assert kv.blocks.num_free_blocks == free and kv.tvm_free_blocks() == free  # neither changed yet
        assert kv.blocks.sequences() == [0, 1]
        with pytest.raises(VtoolError, match="does not nest"):
            with kv.holding_removals():
                pass
    assert kv.blocks.sequences() == [1] and kv.blocks.num_free_blocks == free + 2 and kv.in_sync()
    kv.remove(1)  # not held any more
    assert kv.blocks.num_free_blocks == empty and kv.in_sync()


@pytest.mark.parametrize("buckets", ["off", ((2, 4, 8), "batch_decode")], ids=["own size", "padded"])
def test_the_runner_queues_a_seen_step_on_the_model_thread_with_the_same_result(tiny_session, buckets):
    """Decode steps of a real (CPU) library launched with host work beside them: a step shape seen
    before runs its entry call on the model thread while the host work runs here (the padded way
    through decode_buckets too), a new one runs alone and leaves the work to the caller; the
    logits are those of the runner without a thread, bit for bit."""
    import numpy as np

    from test_cuda_graph_buckets import Harness
    from vtool.runtime.engine.step_types import ScheduledSequence, SchedulerOutput

    model = tiny_session.model
    plain, threaded = Harness.make(model, 200, 16, buckets), Harness.make(model, 200, 16, buckets)
    threaded.runner.model_thread = ModelThread(lambda: None)
    rng = np.random.default_rng(1)
    try:
        for s in range(3):
            prompt = rng.integers(1, model.vocab_size, size=4 + s).tolist()
            plain.prefill(s, prompt)
            threaded.prefill(s, prompt)
        ran: list[tuple[int, bool, str]] = []
        for step_index in range(4):
            nxt = {s: int(rng.integers(1, model.vocab_size)) for s in plain.tokens}
            want = plain.decode(nxt)
            step = SchedulerOutput(tuple(ScheduledSequence(f"r{s}", s, (t,), len(threaded.tokens[s]), 1, False,
                                                           return_logits=True) for s, t in nxt.items()))
            where: list[str] = []
            flight = threaded.runner.launch(step, beside=lambda: where.append(threading.current_thread().name))
            ran.append((step_index, flight.beside_ran, where[0] if where else ""))
            got = threaded.runner.finish(flight).results
            for s, result in zip(nxt, got):
                threaded.tokens[s].append(nxt[s])
                assert np.array_equal(result.logits[-1], want[s]), f"step {step_index}, sequence {s}"
        # the first decode step of 3 sequences is a new call; the later ones run beside their work
        assert ran[0][1] is False and all(r[1] and r[2] == threading.current_thread().name for r in ran[1:]), ran
        assert threaded.runner.model_thread.overlapped_calls == 3
    finally:
        threaded.runner.model_thread.close()


class RecordingEvents:
    """Stands in for the CUDA event calls fence_steps makes (no GPU here): what was called."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def event_create(self) -> str:
        return "event"

    def event_record(self, event: str) -> None:
        self.calls.append("record")

    def event_synchronize(self, event: str) -> None:
        self.calls.append("wait")


def test_the_fence_records_only_behind_steps_a_chained_step_may_follow(tiny_session):
    """Steps of fewer sequences than the engine chains record no event (a served one-sequence
    step paid for the record); a step queued early waits for the last step's event, and one
    queued early behind a step that recorded none is refused by name."""
    from vtool.runtime.engine.kv_cache import PagedKVCache

    kv = PagedKVCache(tiny_session.model, 8, 16, 4, 64)
    events = RecordingEvents()
    kv.fence_steps(events, min_rows=2)
    for seq in (0, 1):
        kv.add(seq)
    kv.begin_forward([0], [3])
    kv.end_forward()
    assert events.calls == []  # one sequence: nothing may chain behind it
    with pytest.raises(VtoolError, match="recorded no fence"):
        kv.begin_forward([0], [1], queued_early=True)
    assert kv.blocks.length(0) == 3  # refused before anything changed
    kv.begin_forward([0, 1], [1, 4])
    kv.end_forward()
    kv.begin_forward([0, 1], [1, 1])  # queued after the last step was collected: no wait
    kv.end_forward()
    kv.begin_forward([0, 1], [1, 1], queued_early=True)
    kv.end_forward()
    assert events.calls == ["record", "record", "wait", "record"]
