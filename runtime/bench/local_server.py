"""`vtool bench` without --url: start `vtool serve` on a free local port, measure it over
HTTP like any other server, and stop it afterwards."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
from rich.console import Console

from vtool import VtoolError
from vtool.runtime.text.tokenizer import Tokenizer

STARTUP_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(model_path: Path, artifact_dir: Path, max_num_seqs: int, max_num_batched_tokens: int,
                 num_blocks: int | None, console: Console,
                 extra_args: list[str] | None = None) -> Iterator[tuple[str, Tokenizer]]:
    """A `vtool serve` of an artifact already built (the runtime's own command, so this works in a
    runtime-only install and never compiles while the clock runs)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vtool.runtime.cli", "serve", "--model", str(model_path), "--artifact",
           str(artifact_dir), "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max_num_seqs),
           "--max-num-batched-tokens", str(max_num_batched_tokens), "--disable-log-requests"]
    if num_blocks:
        cmd += ["--num-blocks", str(num_blocks)]
    cmd += extra_args or []
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"vtool-bench-server-{port}.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        with console.status(f"starting vtool serve on port {port} (log: {log_path})"):
            wait_healthy(proc, url, STARTUP_TIMEOUT_S, log_path)
        yield url, Tokenizer.load(model_path)
    finally:
        stop_process(proc, 20)


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path, what: str = "the server") -> None:
    """Until `url`/health answers 200; VtoolError (with the log's tail) when the process exits
    first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise VtoolError(f"{what} exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise VtoolError(f"{what} did not become healthy in {timeout_s:.0f} s; log: {log_path}")
        time.sleep(0.5)


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within timeout_s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
