"""The engine on its own thread, driven from asyncio: the in-process alternative to the
engine core process (serving/engine_core.py), with the same client methods.

The HTTP event loop never runs model code: it posts commands (add, abort, a query) to the
engine thread and receives each request's outputs on an asyncio.Queue. A slow client
therefore never stalls generation for the others, and a generator that is closed early
(a client that went away) aborts its request, which frees its blocks at once.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable

from vtool.runtime.engine.engine import Engine
from vtool.runtime.engine.request import StepOutput
from vtool.runtime.sampling.params import SamplingParams

log = logging.getLogger("vtool.engine")


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: Any = None):
        """metrics: a ServerMetrics (or None): the engine's observer, rendered by metrics_text."""
        self.engine = engine
        self.metrics = metrics
        if metrics is not None:
            engine.observer = metrics
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="vtool-engine", daemon=True)
        self._thread.start()

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_commands()
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out, last=out.finished)
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as err:  # a bug in a step: fail every open request loudly
            log.exception("engine loop died")
            self._error = err
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"the engine stopped: {err!r}"), last=True)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, request_id: str, item: Any, last: bool) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if last:
            del self._streams[request_id]
        loop, q = stream
        loop.call_soon_threadsafe(q.put_nowait, item)

    # -- asyncio side ----------------------------------------------------------------------
    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps and return its result."""
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            try:
                future.set_result(fn(self.engine))
            except BaseException as err:  # handed back to the caller, e.g. a RequestError -> 400
                future.set_exception(err)

        self._commands.put(command)
        self._wake.set()
        return await asyncio.wrap_future(future)

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  priority: int = 0, parent: tuple[str, int] | None = None) -> "RequestStream":
        """Admit a request; refusals (RequestError, SamplingParamsError) raise here, before
        any output, so a server can still answer 400."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        arrival = time.monotonic()

        def add(engine: Engine) -> None:
            self._streams[request_id] = (loop, q)
            try:
                engine.add_request(request_id, prompt_ids, params, priority, arrival, parent=parent)
            except BaseException:
                self._streams.pop(request_id, None)
                raise

        await self.call(add)
        return RequestStream(self, request_id, q, arrival)

    async def start(self) -> None:
        """Nothing to connect: the engine thread runs from construction."""

    async def health(self) -> None:
        await self.call(lambda engine: None)  # answers only while the engine thread is alive

    async def stats(self) -> dict[str, Any]:
        return await self.call(lambda engine: engine.stats())

    async def metrics_text(self) -> str:
        if self.metrics is None:
            raise RuntimeError("metrics are disabled (--disable-metrics)")

        def render(engine: Engine) -> str:
            self.metrics.update_from_engine(engine.stats())
            return self.metrics.render().decode()

        return await self.call(render)

    async def reset_prefix_cache(self) -> bool:
        return await self.call(lambda engine: engine.reset_prefix_cache())

    def abort(self, request_id: str) -> None:
        def command() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

        self._commands.put(command)
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)


class RequestStream:
    """The outputs of one admitted request. Leaving `async with` (or calling close())
    before the request finished aborts it."""

    def __init__(self, engine: AsyncEngine, request_id: str, q: asyncio.Queue, arrival: float):
        self.engine, self.request_id, self.arrival = engine, request_id, arrival
        self._q = q
        self.finished = False

    def __aiter__(self) -> AsyncIterator[StepOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StepOutput]:
        while not self.finished:
            item = await self._q.get()
            # Whatever else already waits comes along in the same delta: a consumer that fell
            # behind (a busy API server, a slow client) sends fewer, larger chunks instead of
            # falling further behind, as vLLM's output collector does.
            while not isinstance(item, BaseException) and not item.finished and not self._q.empty():
                later = self._q.get_nowait()
                if isinstance(later, BaseException):
                    item = later
                    break
                item = item.merged(later)
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()
