"""The engine core in its own process behind `vtool serve` (serving/engine_core.py): aborts
cross to it and free blocks, either side dying ends the whole server with a log line and
never a hang, and several API servers share one core."""
from __future__ import annotations

import concurrent.futures
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from vtool.runtime.bench.local_server import free_port

MODEL = "tiny-chat"


class Server:
    def __init__(self, model_dir: Path, log: Path, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "vtool.toolchain.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), "--max-model-len", "512", "--served-model-name", MODEL,
               "--max-num-seqs", "16", "--max-num-batched-tokens", "256", *extra]
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        self.core_pid = httpx.get(f"{self.url}/server_info").json()["engine"]["engine_core_pid"]

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} {labels} not in /metrics")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _wait(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {seconds} s waiting for {what}"
        time.sleep(0.1)


def _long_stream(url: str, max_tokens: int = 500) -> httpx.Response:
    """A streaming completion that would run for seconds, opened and left for the caller."""
    client = httpx.Client(timeout=60)
    request = client.build_request("POST", f"{url}/v1/completions", json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
        "stream": True, "temperature": 0})
    return client.send(request, stream=True)


def _stream_started(url: str, chunks: int = 3) -> tuple[httpx.Response, Any]:
    """A long stream whose first `chunks` token chunks have arrived (it is decoding now), and its
    line iterator: the caller keeps both, since a line iterator that is dropped closes the stream."""
    response = _long_stream(url)
    lines = response.iter_lines()
    seen = 0
    for line in lines:
        seen += line.startswith("data: {")
        if seen == chunks:
            return response, lines
    raise AssertionError(f"the stream ended before {chunks} chunks")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = Server(tiny_model_dir, tmp_path_factory.mktemp("core") / "server.log")
    yield s
    s.stop()


def test_the_engine_core_is_its_own_process(server):
    assert server.core_pid != server.proc.pid and _alive(server.core_pid)
    with open(f"/proc/{server.core_pid}/status") as f:
        parent = int(re.search(r"PPid:\s+(\d+)", f.read()).group(1))
    assert parent == server.proc.pid  # one API server: the `vtool serve` process itself
    with open(f"/proc/{server.core_pid}/comm") as f:
        assert f.read().strip() == "vtool-engine"  # what ps and top show


def test_a_disconnected_stream_is_aborted_in_the_core_and_frees_its_blocks(server):
    before = server.metric("vllm:generation_tokens_total", model_name=MODEL)
    response, _lines = _stream_started(server.url)
    assert server.metric("vllm:num_requests_running", model_name=MODEL) == 1
    response.close()  # the client goes away mid-stream
    _wait(lambda: server.metric("vllm:num_requests_running", model_name=MODEL) == 0, 30, "the abort")
    assert server.metric("vllm:kv_cache_usage_perc", model_name=MODEL) == 0.0
    generated = server.metric("vllm:generation_tokens_total", model_name=MODEL) - before
    assert 3 <= generated < 300, generated  # stopped long before its 500 tokens


def test_the_step_profile_counts_every_part_of_the_engines_time(server):
    httpx.post(f"{server.url}/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "max_tokens": 8})
    steps = server.metric("vtool:engine_steps_total", model_name=MODEL)
    parts = {p: server.metric("vtool:engine_step_phase_seconds_total", model_name=MODEL, phase=p)
             for p in ("schedule", "forward", "sample", "output", "io")}
    assert steps >= 8 and all(v > 0 for v in parts.values()), parts
    assert parts["forward"] > parts["schedule"]  # a model step costs more than deciding it


def test_step_durations_by_kind_reach_metrics(server):
    """vtool:engine_step_seconds{kind}: a prompt admitted while another request decodes runs in
    a mixed step; the decode steps of the two are decode steps; no step is longer than the wall
    time around it."""
    def count(kind: str) -> float:
        return server.metric("vtool:engine_step_seconds_count", model_name=MODEL, kind=kind)

    before = {k: count(k) for k in ("decode", "mixed", "prefill")}
    seconds_before = sum(server.metric("vtool:engine_step_seconds_sum", model_name=MODEL, kind=k)
                         for k in ("decode", "mixed", "prefill"))
    start = time.monotonic()
    response, _lines = _stream_started(server.url)
    httpx.post(f"{server.url}/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
    response.close()
    _wait(lambda: server.metric("vllm:num_requests_running", model_name=MODEL) == 0, 30, "the abort")
    wall = time.monotonic() - start
    grown = {k: count(k) - before[k] for k in before}
    assert grown["prefill"] >= 1 and grown["mixed"] >= 1 and grown["decode"] >= 3, grown
    seconds = sum(server.metric("vtool:engine_step_seconds_sum", model_name=MODEL, kind=k)
                  for k in ("decode", "mixed", "prefill")) - seconds_before
    assert 0 < seconds <= wall, (seconds, wall)


def test_vtool_bench_reports_the_servers_own_steps(server, tiny_model_dir):
    """`vtool bench --url` against vtool serve: each level's report carries the steps the server
    took by kind, from its /metrics before and after."""
    from rich.console import Console

    from vtool.runtime.bench.command import BenchOptions, bench_main

    out = io.StringIO()
    opts = BenchOptions(model=None, url=server.url, num_prompts=4, input_len=8, output_len=6, concurrency=[2],
                        ignore_eos=True, tokenizer=str(tiny_model_dir), fresh_prompts=True)
    run = bench_main(opts, console=Console(file=out, width=160))["runs"][0]
    steps = run["server_steps"]
    assert run["completed"] == 4 and steps["decode"]["steps"] >= 5, steps
    assert steps["prefill"]["steps"] + steps["mixed"]["steps"] >= 2, steps  # 4 prompts, at most 2 at once
    assert all((v["mean_ms"] is None) == (v["steps"] == 0) for v in steps.values()), steps
    assert "server steps: " in out.getvalue()


def test_a_stop_string_found_on_the_api_side_ends_the_request_in_the_core(server):
    body = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "temperature": 0,
        "min_tokens": 0}).json()
    text = body["choices"][0]["text"]
    words = text.split()
    assert len(words) > 3
    stop = words[2]  # greedy: the same continuation, cut at its third word
    stopped = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "temperature": 0,
        "stop": [stop]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["stop_reason"] == stop
    assert stopped["choices"][0]["text"] == text[: text.index(stop)]
    _wait(lambda: server.metric("vllm:num_requests_running", model_name=MODEL) == 0, 30, "the core to stop it")
    assert server.metric("vllm:kv_cache_usage_perc", model_name=MODEL) == 0.0


def test_killing_the_engine_core_ends_the_server_without_a_hang(tiny_model_dir, tmp_path):
    s = Server(tiny_model_dir, tmp_path / "server.log")
    try:
        streams = [_long_stream(s.url) for _ in range(3)]
        os.kill(s.core_pid, signal.SIGKILL)

        def drain(response: httpx.Response) -> str:
            try:
                return "".join(response.iter_lines())
            except httpx.HTTPError as err:  # the server may cut the connection instead
                return repr(err)

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            ends = [f.result(timeout=30) for f in [pool.submit(drain, r) for r in streams]]
        assert all(("[DONE]" in e and "error" in e) or "Error" in e for e in ends), ends
        s.proc.wait(timeout=30)  # the server stops by itself
        assert s.proc.returncode != 0
        log = s.log.read_text()
        assert f"the engine core process (pid {s.core_pid}) died" in log, log
    finally:
        s.stop()


def test_sigterm_stops_the_server_and_its_engine_core_cleanly(tiny_model_dir, tmp_path):
    s = Server(tiny_model_dir, tmp_path / "server.log")
    try:
        s.proc.terminate()
        assert s.proc.wait(timeout=30) == 0
        _wait(lambda: not _alive(s.core_pid), 5, "the engine core to be stopped")
        log = s.log.read_text()
        assert "Finished server process" in log and "is gone" not in log, log  # stopped, not orphaned
    finally:
        s.stop()


def test_killing_the_api_server_ends_the_engine_core(tiny_model_dir, tmp_path):
    s = Server(tiny_model_dir, tmp_path / "server.log")
    try:
        s.proc.kill()
        s.proc.wait(timeout=10)
        _wait(lambda: not _alive(s.core_pid), 15, "the engine core to exit")
        assert "is gone; the engine core exits" in s.log.read_text()
    finally:
        s.stop()


def test_two_api_servers_share_one_core_and_stop_together(tiny_model_dir, tmp_path):
    s = Server(tiny_model_dir, tmp_path / "server.log", "--api-server-count", "2")
    try:
        # /health answers once one API server is up; under load the second may start later
        _wait(lambda: len(re.findall(r"Started server process", s.log.read_text())) >= 2, 60,
              "both API servers to start")

        def complete(i: int) -> str:
            # A fresh connection each: the kernel spreads connections over both processes.
            return httpx.post(f"{s.url}/v1/completions", timeout=60, headers={"Connection": "close"}, json={
                "model": MODEL, "prompt": f"Request {i % 2}", "max_tokens": 12, "temperature": 0}).json()[
                "choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(complete, range(16)))
        assert texts[0::2] == [texts[0]] * 8 and texts[1::2] == [texts[1]] * 8  # batched greedy = alone
        log = s.log.read_text()
        servers = [int(p) for p in re.findall(r"Started server process \[(\d+)\]", log)]
        assert len(set(servers)) == 2, log
        os.kill(servers[0], signal.SIGKILL)
        s.proc.wait(timeout=30)
        assert s.proc.returncode != 0
        _wait(lambda: not _alive(s.core_pid), 15, "the engine core to exit")
        assert re.search(rf"vtool-api-\d \(pid {servers[0]}\) exited with code -9", s.log.read_text())
    finally:
        s.stop()
