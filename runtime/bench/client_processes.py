"""`vtool bench`'s requests spread over worker processes, for levels one event loop cannot keep
up with.

One asyncio loop reads every stream of a run: at 64 streams of a fast server it takes in ~28-44k
chunks a second, and each new request costs it ~1 ms of httpx work while the other streams wait,
so a wave of 64 arrivals reaches the server over ~0.1 s and the chunks of one stream come in
bursts (the loop reads each socket late). Worker processes each run a loop of their own; this
process keeps the run's semantics in one place: the arrival schedule (request_delays), the
concurrency limit (at most `max_concurrency` requests in flight over all workers, the next input
in order going out as soon as any slot frees, as one loop with a semaphore would), and the
progress callback. A request goes to the worker with the fewest in flight. Workers send each
record back as its stream ends; their perf_counter timestamps share this process's clock
(CLOCK_MONOTONIC), so the run's duration and the records' times compare.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from vtool.runtime.bench.client import REQUEST_FUNCS, ClientPool, run_schedule
from vtool.runtime.bench.metrics import RequestRecord

STREAMS_PER_PROCESS = 16      # one loop keeps up with this many streams of a fast server
MAX_PROCESSES = 8
READY_TIMEOUT_S = 120.0       # a spawned worker imports httpx and numpy before it says it is ready
WORKER_DIED = "the bench's client worker process ended before this request did"


def default_client_processes(max_concurrency: int | None, cores: int | None = None) -> int:
    """Worker processes for a level: one below 2 x STREAMS_PER_PROCESS streams (or without a
    limit, where the streams in flight are not known ahead); else one per STREAMS_PER_PROCESS
    streams, at most half the cores (the server may share the machine) and MAX_PROCESSES."""
    if not max_concurrency or max_concurrency < 2 * STREAMS_PER_PROCESS:
        return 1
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return max(1, min(MAX_PROCESSES, cores // 2, max_concurrency // STREAMS_PER_PROCESS))


# --------------------------------------------------------------------------- the worker side

def _worker_main(conn: Connection, inputs: list[Any], endpoint: str) -> None:
    asyncio.run(_worker_loop(conn, inputs, endpoint))


async def _worker_loop(conn: Connection, inputs: list[Any], endpoint: str) -> None:
    """Receive input indices (None: stop), stream each request, send back (index, record)."""
    loop = asyncio.get_running_loop()
    func = REQUEST_FUNCS[endpoint]
    pool = ClientPool()
    incoming: asyncio.Queue[int | None] = asyncio.Queue()

    def readable() -> None:
        try:
            while conn.poll():
                incoming.put_nowait(conn.recv())
        except (EOFError, OSError):      # the parent went away: stop
            incoming.put_nowait(None)

    async def one(i: int) -> None:
        client = pool.take()
        try:
            record = await func(client, inputs[i])
        finally:
            pool.give(client)
        conn.send((i, record))

    loop.add_reader(conn.fileno(), readable)
    conn.send(("ready", os.getpid()))
    running: set[asyncio.Task[None]] = set()
    try:
        while (i := await incoming.get()) is not None:
            task = asyncio.create_task(one(i))
            running.add(task)
            task.add_done_callback(running.discard)
        if running:
            await asyncio.gather(*running)
    finally:
        loop.remove_reader(conn.fileno())
        await pool.aclose()


# --------------------------------------------------------------------------- this process's side

class _Worker:
    def __init__(self, ctx: Any, inputs: list[Any], endpoint: str) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, inputs, endpoint), daemon=True,
                                   name="vtool-bench-client")
        self.process.start()
        child.close()
        self.pending: set[int] = set()
        self.alive = True

    def wait_ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"a bench client worker did not start within {timeout:.0f} s")
        tag, _ = self.conn.recv()
        if tag != "ready":
            raise RuntimeError(f"a bench client worker sent {tag!r} before it was ready")

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        self.conn.close()


async def run_requests_in_processes(
    inputs: Sequence[Any],
    delays: Sequence[float],
    endpoint: str,
    max_concurrency: int | None,
    processes: int,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """run_requests' contract (records in input order, the duration from just before the first
    request to the last return) with the streams read by `processes` worker processes."""
    if processes < 1:
        raise ValueError(f"client processes must be at least 1, got {processes}")
    loop = asyncio.get_running_loop()
    ctx = multiprocessing.get_context("spawn")   # no fork of a process that runs an event loop
    workers: list[_Worker] = []
    try:
        for _ in range(processes):
            workers.append(_Worker(ctx, list(inputs), endpoint))
        for w in workers:
            await loop.run_in_executor(None, w.wait_ready, READY_TIMEOUT_S)
        return await _dispatch(loop, workers, inputs, delays, max_concurrency, on_done)
    finally:
        for w in workers:
            if w.alive:
                loop.remove_reader(w.conn.fileno())
            await loop.run_in_executor(None, w.stop)


def _lost(inp: Any) -> RequestRecord:
    return RequestRecord(success=False, error=WORKER_DIED, prompt_len=inp.prompt_len, client_prompt_len=inp.prompt_len)


async def _dispatch(loop: asyncio.AbstractEventLoop, workers: list[_Worker], inputs: Sequence[Any],
                    delays: Sequence[float], max_concurrency: int | None,
                    on_done: Callable[[RequestRecord], None] | None) -> tuple[list[RequestRecord], float]:
    results: list[asyncio.Future[RequestRecord]] = [loop.create_future() for _ in inputs]

    def dead(w: _Worker) -> None:
        """The worker died: the requests it held fail, the run goes on with the others."""
        if w.alive:
            w.alive = False
            loop.remove_reader(w.conn.fileno())
        for i in w.pending:
            if not results[i].done():
                results[i].set_result(_lost(inputs[i]))
        w.pending.clear()

    def readable(w: _Worker) -> None:
        try:
            while w.conn.poll():
                i, record = w.conn.recv()
                w.pending.discard(i)
                if not results[i].done():
                    results[i].set_result(record)
        except (EOFError, OSError):
            dead(w)

    for w in workers:
        loop.add_reader(w.conn.fileno(), readable, w)

    async def send(i: int) -> RequestRecord:
        """To the live worker with the fewest in flight; its record when it comes back."""
        while live := [w for w in workers if w.alive]:
            w = min(live, key=lambda x: len(x.pending))
            w.pending.add(i)
            try:
                w.conn.send(i)
            except (BrokenPipeError, OSError):   # died before its pipe said so: try the next one
                w.pending.discard(i)
                dead(w)
                continue
            return await results[i]
        return _lost(inputs[i])

    return await run_schedule(delays, send, max_concurrency, on_done)
