"""How many streamed chunks a second `vtool bench`'s client can take in: the ceiling of what
it can measure. A raw asyncio HTTP/1.1 server (no framework: it costs next to nothing) streams
completion chunks with usage at the end as fast as the socket takes them; the client runs
--concurrency streams at once, through the same `run_requests` as `vtool bench --url`. The server
answers at once, so the client's time to first token is the client's own cost of sending a
request while the other streams run (a small --tokens makes requests start in waves).

    python tests/bench/client_capacity.py [--concurrency 64] [--requests 256] [--tokens 128] [--processes 1]

Prints one JSON line: chunks per second, the mean and longest time to first token, the CPU, and the run's parameters.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_info import cpu_name  # noqa: E402

CHUNK = ("data: " + json.dumps({"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m",
         "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}]}) + "\n\n").encode()


def _last(tokens: int) -> bytes:
    usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
    return ("data: " + json.dumps({"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m",
                                   "choices": [], "usage": usage}) + "\n\ndata: [DONE]\n\n").encode()


def serve(sock: socket.socket, tokens: int) -> None:
    last = _last(tokens)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for i in range(tokens):
                    writer.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
                    if i % 8 == 0:
                        await writer.drain()
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(last), last))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, sock=sock)
        async with server:
            await server.serve_forever()

    asyncio.run(main())



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--processes", type=int, default=1, help="client worker processes (vtool bench --client-processes)")
    a = ap.parse_args()
    from vtool.runtime.bench.client import RequestInput, run_requests

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(sock, a.tokens), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}/v1/completions"
    inputs = [RequestInput(prompt="x", prompt_len=1, output_len=a.tokens, model="m", api_url=url)
              for _ in range(a.requests)]
    records, duration = asyncio.run(run_requests(inputs, max_concurrency=a.concurrency, processes=a.processes))
    server.terminate()
    ok = [r for r in records if r.success]
    chunks = sum(len(r.itl) + 1 for r in ok)
    ttft_ms = [1000 * r.ttft for r in ok]
    print(json.dumps({"chunks_per_s": round(chunks / duration), "mean_ttft_ms": round(statistics.fmean(ttft_ms), 2),
                      "max_ttft_ms": round(max(ttft_ms), 2), "ok": len(ok), "requests": a.requests,
                      "concurrency": a.concurrency, "tokens": a.tokens, "processes": a.processes, "cpu": cpu_name()}))


if __name__ == "__main__":
    main()
