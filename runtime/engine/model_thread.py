"""The model's call on a thread of its own, with the engine's host work beside it.

On a GPU a small model's decode step is bound by the host (docs/BENCHMARKS.md, "Where SmolLM2's
host time goes"): TVM's VM spends ~1.7 ms of host time queueing a 30-layer step (a CUDA-graph
replay between each layer's KV-cache calls), and the engine's Python ~1.9 ms more, one after
the other on one thread, while the device needs ~1.7 ms. TVM's FFI releases the GIL for the
length of a call, so the VM can queue step N+1 on a worker thread while the engine's thread
takes step N's tokens into the requests and builds their outputs (vLLM keeps its model
executor apart from the scheduler for the same reason).

Only the one entry-point call runs on the worker: everything before it (the token ids, embed,
the KV cache's begin_forward and its fence) and after it (end_forward, the draw) stays on the
engine's thread, so the worker takes the GIL twice a step and the two threads never contend for
it over many small calls. What the host work beside it may not do, the engine arranges: touch
TVM's KV cache (removals are held until the step is queued, kv_cache.py `holding_removals`) or
call into the same VM (the host work only copies drawn tokens back and runs Python).

A CUDA graph is captured the first time a batch size runs (decode_buckets.py); a capture must
not have another thread's synchronous copies beside it, so a call whose graph has not been seen
yet runs alone, on the engine's thread, and only calls seen before run beside host work.
"""
from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Hashable
from typing import Any

# Host work run beside one model call: called once, on the engine's thread.
Beside = Callable[[], None]


class ModelThread:
    """One worker thread, bound to the model's GPU, that runs entry-point calls."""

    def __init__(self, bind: Callable[[], None]):
        """bind: run once on the worker before its first call (makes the CUDA context current
        there: TVM's kernel launches use the driver API, which needs one per thread)."""
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vtool-model",
                                                          initializer=bind)
        self._seen: set[Hashable] = set()
        self.overlapped_calls = 0  # calls that ran beside host work (for tests and stats)

    def knows(self, key: Hashable) -> bool:
        """Whether a call with this graph key ran before (its CUDA graphs are captured)."""
        return key in self._seen

    def call(self, key: Hashable, fn: Callable[..., Any], args: tuple[Any, ...], beside: Beside | None) -> Any:
        """fn(*args). With `beside` and a key seen before, fn runs on the worker while `beside`
        runs here, and this returns when both are done (an error of either is raised, fn's
        first; `beside` always ran). Otherwise fn runs here and `beside` is not called."""
        if beside is None or key not in self._seen:
            result = fn(*args)
            self._seen.add(key)
            return result
        started = threading.Event()

        def run() -> Any:
            started.set()
            return fn(*args)

        future = self._pool.submit(run)
        started.wait()  # the worker holds the call, not the queue: beside's work cannot delay its start
        try:
            beside()
        finally:
            result = future.result()  # waits (without the GIL); fn's error wins over beside's
        self.overlapped_calls += 1
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def model_thread_for(model: Any) -> ModelThread:
    """The model thread of a loaded model: bound to its GPU (a CPU model's needs no binding)."""
    if not getattr(model, "on_gpu", False):
        return ModelThread(lambda: None)
    from vtool.runtime.artifact.tvm_runtime import cuda_runtime

    cuda, index = cuda_runtime(), int(model.device_index)
    return ModelThread(lambda: cuda.set_device(index))
