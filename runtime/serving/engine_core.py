"""The engine core in its own process, as vLLM v1's EngineCore: it owns the model, the KV
cache, the scheduler and the metrics, and does nothing but step.

API servers (one or more processes, serving/core_client.py) send requests, aborts and
utility calls over one ZeroMQ ROUTER socket; each step's outputs go back, one message per
client, as token ids (text is made on the API side, off this loop). The loop blocks only
when there is no work. It exits when its parent process goes away, and when a step fails
it tells every client (DEAD) and exits non-zero, so that no server waits on it forever.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import zmq

from vtool import VtoolError
from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.engine.request import CoreOutput
from vtool.runtime.serving import core_wire as wire
from vtool.runtime.serving.metrics import ServerMetrics

log = logging.getLogger("vtool.engine_core")

IDLE_POLL_MS = 200  # how often an idle core looks at its parent
STARTUP_TIMEOUT_S = 3600  # loading (not building) a model; a hung start still ends


@dataclasses.dataclass(frozen=True)
class CoreLaunch:
    """What the core process needs to open the model (picklable: it crosses a spawn)."""

    artifact: str
    model_path: str
    tokenizer_config: str | None
    max_model_len: int | None
    engine_config: EngineConfig
    metrics_model_name: str | None  # None: --disable-metrics
    address: str  # the ZeroMQ endpoint the core binds


@dataclasses.dataclass(frozen=True)
class CoreInfo:
    """What the core reports once it is ready: the numbers the API servers show."""

    pid: int
    num_blocks: int
    block_size: int
    max_model_len: int
    device: str
    target: str
    dtype: str
    frees_window: bool = False  # the KV cache gives back blocks a sliding window has passed


class EngineCoreLoop:
    def __init__(self, engine: Engine, socket: zmq.Socket, metrics: ServerMetrics | None, parent_pid: int):
        self.engine, self.socket, self.metrics, self.parent_pid = engine, socket, metrics, parent_pid
        self.owners: dict[str, bytes] = {}  # request id -> the client (ROUTER identity) that added it
        self.clients: set[bytes] = set()
        self.io_seconds = 0.0  # receiving and sending, for the step profile

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while True:
            busy = self.engine.has_unfinished()
            t0 = time.perf_counter()
            if poller.poll(0 if busy else IDLE_POLL_MS):
                self._drain()
            if os.getppid() != self.parent_pid:
                log.error("the server process (pid %d) is gone; the engine core exits", self.parent_pid)
                return
            if busy or self.engine.has_unfinished():
                if busy:
                    self.io_seconds += time.perf_counter() - t0
                # outputs built beside a chained step's model call go out while it runs
                outputs = self.engine.step_core(on_outputs=self._send_timed)
                self._send_timed(outputs)

    # -- incoming ------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                identity, kind, payload = self.socket.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self.clients.add(identity)
            if kind == wire.ADD:
                self._add(identity, payload)
            elif kind == wire.ABORT:
                request_ids, reason, stop_reason = wire.abort_decoder.decode(payload)
                for request_id in request_ids:
                    self.owners.pop(request_id, None)
                    self.engine.finish_request(request_id, reason, stop_reason)
            elif kind == wire.CALL:
                call_id, method, args = wire.call_decoder.decode(payload)
                self._reply(identity, call_id, lambda: self._utility(method, args))
            else:
                log.error("unknown message kind %r from a client; ignored", kind)

    def _add(self, identity: bytes, payload: bytes) -> None:
        call_id, request_id, prompt_ids, params, priority, arrival, parent = wire.add_decoder.decode(payload)

        def add() -> None:
            self.engine.add_request(request_id, prompt_ids, params, priority, arrival, with_text=False, parent=parent)
            self.owners[request_id] = identity

        self._reply(identity, call_id, add)

    def _utility(self, method: str, args: list[Any]) -> Any:
        if method == "ping":
            return None
        if method == "stats":
            return {**self.engine.stats(), "io_seconds": self.io_seconds}
        if method == "metrics_text":
            if self.metrics is None:
                raise VtoolError("metrics are disabled (--disable-metrics)")
            self.metrics.update_from_engine({**self.engine.stats(), "io_seconds": self.io_seconds})
            return self.metrics.render().decode()
        if method == "reset_prefix_cache":
            return self.engine.reset_prefix_cache()
        raise VtoolError(f"unknown engine core method {method!r}; known: {', '.join(wire.UTILITY_METHODS)}")

    def _reply(self, identity: bytes, call_id: int, fn: Any) -> None:
        try:
            message = (call_id, True, fn())
        except Exception as err:  # a refusal (RequestError -> 400) or a bug, handed to the caller
            if not isinstance(err, (VtoolError, ValueError)):
                log.exception("engine core call failed")
            message = (call_id, False, wire.error_payload(err))
        self.socket.send_multipart([identity, wire.REPLY, wire.encoder.encode(message)])

    # -- outgoing ------------------------------------------------------------------------
    def _send_timed(self, outputs: list[CoreOutput]) -> None:
        t0 = time.perf_counter()
        self._send_outputs(outputs)
        self.io_seconds += time.perf_counter() - t0

    def _send_outputs(self, outputs: list[CoreOutput]) -> None:
        by_client: dict[bytes, list[CoreOutput]] = {}
        owners = self.owners
        for out in outputs:
            identity = owners.get(out.request_id)
            if identity is None:
                continue
            if out.finish_reason is not None:
                del owners[out.request_id]
            by_client.setdefault(identity, []).append(out)
        for identity, batch in by_client.items():
            self.socket.send_multipart([identity, wire.OUTPUT, wire.encoder.encode(batch)])

    def broadcast_dead(self, message: str) -> None:
        for identity in self.clients:
            try:
                self.socket.send_multipart([identity, wire.DEAD, wire.encoder.encode(message)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass


def name_process(name: str) -> None:
    """The name `ps -o comm`, top and /proc/PID/comm show (Linux; 15 bytes), so a spawned
    process is not just "python"."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def run_engine_core(launch: CoreLaunch, ready: Connection, parent_pid: int) -> None:
    """The core process's main: open the model, say ready (or why not), then loop."""
    name_process("vtool-engine")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from vtool.runtime.artifact.tvm_runtime import block_torch_import
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint

    block_torch_import()
    try:
        checkpoint = open_checkpoint(launch.model_path)
        session = open_session(launch.artifact, checkpoint, launch.tokenizer_config, launch.max_model_len)
        engine = Engine(session, launch.engine_config)
        engine.prepare_grammar()  # structured output's vocabulary, off the loop
        metrics = ServerMetrics(launch.metrics_model_name, max_model_len=engine.max_model_len) \
            if launch.metrics_model_name else None
        if metrics is not None:
            engine.observer = metrics
            metrics.set_cache_config(block_size=engine.kv.block_size, num_blocks=engine.kv.blocks.num_blocks,
                                     enable_prefix_caching=launch.engine_config.enable_prefix_caching)
        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a client that left: its messages are dropped
        socket.bind(launch.address)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which says it and exits
        ready.send(("error", f"{type(err).__name__}: {err}" if not isinstance(err, VtoolError) else str(err)))
        return
    model = session.model
    ready.send(("ready", CoreInfo(pid=os.getpid(), num_blocks=engine.kv.blocks.num_blocks,
                                  block_size=engine.kv.block_size, max_model_len=engine.max_model_len,
                                  device=f"{model.device_type}:{model.device_index}",
                                  target=model.manifest["target"]["name"], dtype=model.manifest["dtype"],
                                  frees_window=engine.kv.frees)))
    ready.close()
    loop = EngineCoreLoop(engine, socket, metrics, parent_pid)
    try:
        loop.run()
    except BaseException as err:
        message = f"the engine core failed: {type(err).__name__}: {err}"
        log.error("%s\n%s", message, traceback.format_exc())
        loop.broadcast_dead(message)
        time.sleep(0.1)  # let ZeroMQ hand the DEAD messages over before the process ends
        socket.close(linger=1000)
        sys.exit(1)
    socket.close(linger=0)


class EngineCoreProcess:
    """Start the core process and wait until it is ready (or say why it is not)."""

    def __init__(self, launch: CoreLaunch):
        self.launch = launch
        context = multiprocessing.get_context("spawn")  # never fork a process that holds threads
        parent, child = context.Pipe(duplex=False)
        self.process = context.Process(target=run_engine_core, args=(launch, child, os.getpid()),
                                       name="vtool-engine-core", daemon=True)
        self.process.start()
        child.close()
        self.info = self._wait_ready(parent)

    def _wait_ready(self, conn: Connection) -> CoreInfo:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not conn.poll(0.2):
            if not self.process.is_alive():
                raise VtoolError(f"the engine core process exited while starting (exit code {self.process.exitcode}); "
                                 "its log above says why")
            if time.monotonic() > deadline:
                self.terminate()
                raise VtoolError(f"the engine core did not start within {STARTUP_TIMEOUT_S} s")
        try:
            status, value = conn.recv()
        except EOFError:
            self.process.join(5)
            raise VtoolError(f"the engine core process exited while starting (exit code {self.process.exitcode})") \
                from None
        if status != "ready":
            self.process.join(10)
            raise VtoolError(f"the engine core could not start: {value}")
        return value

    @property
    def pid(self) -> int:
        return self.process.pid

    def terminate(self, timeout: float = 10.0) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
