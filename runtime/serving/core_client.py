"""An API server's side of the engine core process (serving/engine_core.py).

It sends requests, aborts and utility calls over a ZeroMQ DEALER socket, receives each
step's token ids and turns them into text here (TextStage: detokenization and stop strings
run in the API process, off the core's loop). A stop string found here ends the request in
the core too (an ABORT with reason "stop"). A watcher notices when the core process is gone:
every open request then fails with EngineDeadError, the log says so, and `on_dead` runs
(the server uses it to shut itself down instead of hanging).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Any, Callable

import zmq
import zmq.asyncio

from vtool.runtime.engine.async_engine import RequestStream
from vtool.runtime.engine.text_stage import TextStage
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.serving import core_wire as wire
from vtool.runtime.serving.core_wire import EngineDeadError
from vtool.runtime.text.tokenizer import Tokenizer

log = logging.getLogger("vtool.server")

WATCH_INTERVAL_S = 0.5


def process_gone(pid: int) -> bool:
    """Whether `pid` has exited: absent, or a zombie (not our child, so not ours to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


class _Open:
    """An admitted request on this side: where its outputs go and its text state."""

    __slots__ = ("queue", "text")

    def __init__(self, queue: asyncio.Queue, text: TextStage):
        self.queue, self.text = queue, text


class CoreClient:
    def __init__(self, address: str, core_pid: int, tokenizer: Tokenizer, identity: bytes,
                 on_dead: Callable[[str], None] | None = None):
        self.address, self.core_pid, self.tokenizer = address, core_pid, tokenizer
        self.identity, self.on_dead = identity, on_dead
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._open: dict[str, _Open] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._dead: str | None = None

    # -- lifecycle (inside the server's event loop) -----------------------------------------
    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, self.identity)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.address)
        self._tasks = [asyncio.create_task(self._receive(), name="vtool-core-receive"),
                       asyncio.create_task(self._watch(), name="vtool-core-watch")]
        await self.call("ping")

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._socket is not None:
            self._socket.close(linger=0)
        if self._context is not None:
            self._context.term()
        self._socket = self._context = None

    # -- requests --------------------------------------------------------------------------
    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  priority: int = 0, parent: tuple[str, int] | None = None) -> RequestStream:
        """Admit a request; refusals raise here (RequestError, SamplingParamsError, a bad
        stop string), before any output, so the server can still answer 400."""
        self._check_alive()
        text = TextStage(self.tokenizer, list(prompt_ids), params)
        queue: asyncio.Queue = asyncio.Queue()
        arrival = time.monotonic()
        self._open[request_id] = _Open(queue, text)
        try:
            await self._request(wire.ADD, lambda call_id: (call_id, request_id, list(prompt_ids), params,
                                                           priority, arrival, parent))
        except BaseException:
            self._open.pop(request_id, None)
            raise
        return RequestStream(self, request_id, queue, arrival)

    def abort(self, request_id: str, reason: str = "abort", stop_reason: str | int | None = None) -> None:
        self._open.pop(request_id, None)
        if self._socket is None or self._dead is not None:
            return
        # A DEALER send does not block while the core reads; the future needs no await.
        self._socket.send_multipart([wire.ABORT, wire.encoder.encode(([request_id], reason, stop_reason))])

    # -- utility calls -----------------------------------------------------------------------
    async def call(self, method: str, *args: Any) -> Any:
        return await self._request(wire.CALL, lambda call_id: (call_id, method, list(args)))

    async def health(self) -> None:
        await self.call("ping")

    async def stats(self) -> dict[str, Any]:
        return await self.call("stats")

    async def metrics_text(self) -> str:
        return await self.call("metrics_text")

    async def reset_prefix_cache(self) -> bool:
        return await self.call("reset_prefix_cache")

    async def _request(self, kind: bytes, message: Callable[[int], tuple]) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await self._socket.send_multipart([kind, wire.encoder.encode(message(call_id))])
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._socket is None:
            raise EngineDeadError("the engine client is not started")

    # -- incoming ------------------------------------------------------------------------------
    async def _receive(self) -> None:
        socket = self._socket
        try:
            while True:
                kind, payload = await socket.recv_multipart()
                if kind == wire.OUTPUT:
                    self._deliver(wire.output_decoder.decode(payload))
                elif kind == wire.REPLY:
                    call_id, ok, result = wire.reply_decoder.decode(payload)
                    future = self._calls.get(call_id)
                    if future is not None and not future.done():
                        if ok:
                            future.set_result(result)
                        else:
                            future.set_exception(wire.error_from_payload(result))
                elif kind == wire.DEAD:
                    self._fail(wire.dead_decoder.decode(payload))
                    return
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a message this side cannot read is a bug: fail loudly, not silently
            log.exception("reading from the engine core failed")
            self._fail(f"reading from the engine core failed: {err!r}")

    def _deliver(self, outputs: list) -> None:
        for core in outputs:
            entry = self._open.get(core.request_id)
            if entry is None:
                continue  # aborted here, or a token the core made before it saw the abort
            out = entry.text.process(core)
            if out.finished:
                del self._open[core.request_id]
                if core.finish_reason is None:  # a stop string: the core must stop this request too
                    self.abort(core.request_id, "stop", out.stop_reason)
            entry.queue.put_nowait(out)

    async def _watch(self) -> None:
        while self._dead is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if process_gone(self.core_pid):
                self._fail(f"the engine core process (pid {self.core_pid}) died")

    def _fail(self, message: str) -> None:
        if self._dead is not None:
            return
        self._dead = message
        log.error("%s; failing %d open request(s) and shutting down", message, len(self._open))
        error = EngineDeadError(message)
        for entry in self._open.values():
            entry.queue.put_nowait(error)
        self._open.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        if self.on_dead is not None:
            self.on_dead(message)


def client_identity(index: int) -> bytes:
    return f"api-{index}-{os.getpid()}".encode()
