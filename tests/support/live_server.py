"""A live `vtool serve` on 127.0.0.1 for the tests that talk to one over HTTP."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from vtool.runtime.bench.local_server import free_port


@contextlib.contextmanager
def vtool_serve(args: list[str], log: Path, timeout: float = 300, poll: float = 0.3) -> Iterator[str]:
    """`vtool serve ARGS --host 127.0.0.1 --port <free>`, its output written to `log`: yields the
    base URL once /health answers 200 (failing the test with the log when the server exits or
    is not up within `timeout` seconds); the server is stopped on leaving."""
    port = free_port()
    cmd = [sys.executable, "-m", "vtool.toolchain.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(poll)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
