"""Soak `vtool serve` on the CPU: many concurrent streaming clients for a while, then check that
nothing failed, that memory stopped growing after warm-up and that the KV cache went back to idle
(issue #13).

    python tests/bench/soak.py [--minutes 10] [--clients 64] [--warmup-minutes 2] [--out soak.json]
                               [--model PATH] [--server-env MALLOC_ARENA_MAX=2] [--server-arg=--max-num-seqs=64]

1. Starts `python -m vtool.toolchain.cli serve --model <default GGUF>` on a free local port (it builds
   the model on first use, which is not timed) and waits for /health.
2. Runs --clients streaming clients for --minutes. Each loops: a /v1/completions (3 in 4) or
   /v1/chat/completions (1 in 4) request with stream=true, a random prompt length (log-uniform,
   some prompts sharing a prefix so the prefix cache is used) and a random max_tokens; about
   --cancel-fraction of the streams are closed by the client after a random number of chunks
   (the server must abort them and free their blocks). A stream that finishes must end with a
   finish_reason and `data: [DONE]`; anything else (an HTTP error, an error chunk, a broken
   stream) is an error.
3. Every --sample-seconds, reads VmRSS / RssAnon / RssFile from /proc/PID/status of the server
   and of each of its descendants (the engine runs in a child process: /server_info's
   engine_core_pid, else the process that maps the artifact's model.so), each named by its
   command line: psutil when installed, else a walk of /proc/*/stat's ppid. In the engine
   process it also counts the resident pages of the KV pool (/proc/PID/pagemap over the pool's
   mappings, found at idle before any load: TVM allocates the pool once at startup, one
   anonymous mapping per layer, which Linux merges with its neighbours, and its pages are
   first written lazily; see kv_ranges).
4. At --minutes, stops starting requests, lets those in flight finish (--drain-seconds at
   most, then closes them), waits for the KV gauge to settle and reads /metrics.

Memory growth, per process and for the tree, of RSS, of the KV pool's resident part and of RSS
outside the pool: baseline = median over the first 30 s after warm-up, final = median over the
last 30 s of load, growth % = (final - baseline) / baseline, and the least-squares slope after
warm-up in MB/min. The pool's size (num_blocks x bytes per block, from /server_info and the
artifact's manifest) is reported beside it: up to that much RSS growth is the pool being filled
for the first time, bounded, not a leak; so what is judged is RSS outside the pool.

Targets (exit status 1 when one fails): 0 errors; growth of RSS outside the KV pool <=
--growth-target % for the whole tree and for every process whose baseline is at least
--min-rss-mb (small helpers are reported, not judged); vllm:kv_cache_usage_perc == 0 and no
running or waiting requests at the end. The JSON result (--out) holds every sample, the CPU
model and flags, and the settings; a summary is printed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

STARTUP_TIMEOUT_S = 900  # a first build of the default model on 2 cores
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from",
         "his", "her", "an", "were", "are", "which", "this", "be", "or", "had", "not", "but", "first", "one",
         "their", "its", "new", "after", "who", "they", "have", "two", "been", "has", "more", "also",
         "other", "into", "river", "mountain", "city", "language", "music", "theory", "number", "system",
         "history", "science", "water", "energy", "light", "market", "garden", "window", "station", "island",
         "winter", "morning", "engine", "bridge", "library", "signal"]
SHARED_PREFIXES = [
    " ".join(random.Random(k).choice(WORDS) for _ in range(n)) for k, n in ((1, 40), (2, 120), (3, 300))]


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the machine

def cpu_record() -> dict[str, Any]:
    model, flags = None, []
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if model is None and line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        if not flags and line.startswith("flags"):
            flags = line.split(":", 1)[1].split()
    return {"model": model, "flags": " ".join(flags), "cores": os.cpu_count(),
            "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3]}


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


# ----------------------------------------------------------------------------- memory sampling

def descendants(pid: int) -> list[int]:
    """pid and every process below it."""
    try:
        import psutil

        try:
            root = psutil.Process(pid)
            return [pid] + [p.pid for p in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
    except ImportError:
        pass
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # the comm field may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def proc_memory(pid: int) -> dict[str, Any] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    fields = {}
    for key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM", "Threads"):
        m = re.search(rf"^{key}:\s+(\d+)", status, re.MULTILINE)
        if m:
            fields[key] = int(m.group(1))
    return {"pid": pid, "name": short_name(cmdline), "cmdline": cmdline[:300],
            "rss_mb": round(fields.get("VmRSS", 0) / 1024, 1), "anon_mb": round(fields.get("RssAnon", 0) / 1024, 1),
            "file_mb": round(fields.get("RssFile", 0) / 1024, 1), "hwm_mb": round(fields.get("VmHWM", 0) / 1024, 1),
            "threads": fields.get("Threads")}


def short_name(cmdline: str) -> str:
    """A stable label for a process: the module or script it runs and its subcommand, or for
    `python -c CODE` (multiprocessing's children) the code."""
    parts = cmdline.split()
    if "-m" in parts and parts.index("-m") + 1 < len(parts):
        i = parts.index("-m")
        return " ".join(parts[i + 1:i + 3])
    if "-c" in parts:
        code = cmdline.split(" -c ", 1)[-1]
        return "python -c " + ("multiprocessing spawn child" if "spawn_main" in code else
                               "multiprocessing resource tracker" if "resource_tracker" in code else code[:60])
    return " ".join(Path(p).name if "/" in p else p for p in parts[:3])


# ----------------------------------------------------------------------------- the KV pool's pages

GLIBC_HEAP_MAX = 64 << 20  # HEAP_MAX_SIZE of a non-main malloc arena's heap on 64-bit
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) (\S+) (\S+) (\d+)\s*(.*)$")


def kv_ranges(pid: int, pool_bytes: int, layers: int) -> list[tuple[int, int]]:
    """The address ranges that hold the KV pool, taken at idle before any load: every anonymous
    mapping at least one layer's pages long (pool_bytes / layers). TVM allocates the pool once at
    startup, one page tensor per layer (each posix_memalign'd, so each its own mmap), and Linux
    merges neighbouring anonymous mappings with each other and with other startup allocations (the
    weights, TVM's attention workspaces), which are resident from the start or bounded just the same;
    nothing in these ranges is freed while the engine lives, only first touched lazily."""
    per_layer = pool_bytes // max(1, layers)
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        m = _MAPPING.match(line)
        if not m or m.group(7).strip():  # file-backed or named ([heap], [stack])
            continue
        start, end = int(m.group(1), 16), int(m.group(2), 16)
        if start % GLIBC_HEAP_MAX == 0 and end - start <= GLIBC_HEAP_MAX:
            continue  # a thread's malloc arena (glibc maps each heap at a multiple of its 64 MiB size)
        if end - start >= per_layer:
            out.append((start, end))
    return out


def resident_in(pid: int, ranges: list[tuple[int, int]]) -> float:
    """MB of the ranges resident now (the present bit of /proc/PID/pagemap)."""
    page = os.sysconf("SC_PAGE_SIZE")
    present = 0
    try:
        import numpy as np
    except ImportError:
        np = None
    with open(f"/proc/{pid}/pagemap", "rb") as f:
        for start, end in ranges:
            f.seek(start // page * 8)
            raw = f.read((end - start) // page * 8)
            if np is not None:
                present += int(np.count_nonzero(np.frombuffer(raw, dtype="<u8") >> np.uint64(63)))
            else:
                present += sum(int.from_bytes(raw[i:i + 8], "little") >> 63 for i in range(0, len(raw), 8))
    return round(present * page / 2**20, 1)


class MemorySampler:
    def __init__(self, pid: int, every_s: float, engine_pid: int | None = None,
                 kv: list[tuple[int, int]] | None = None):
        self.pid, self.every_s = pid, every_s
        self.engine_pid, self.kv = engine_pid, kv or []
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def sample(self, phase: str) -> dict[str, Any]:
        procs = [m for m in (proc_memory(p) for p in descendants(self.pid)) if m is not None]
        for p in procs:
            p["engine"] = p["pid"] == self.engine_pid
            p["kv_resident_mb"] = 0.0
            if p["engine"] and self.kv:
                try:
                    p["kv_resident_mb"] = resident_in(p["pid"], self.kv)
                except OSError:
                    p["kv_resident_mb"] = None
            p["rss_outside_kv_mb"] = round(p["rss_mb"] - (p["kv_resident_mb"] or 0.0), 1)
        s = {"t_s": round(time.monotonic() - self.t0, 1), "phase": phase, "procs": procs,
             "tree_rss_mb": round(sum(p["rss_mb"] for p in procs), 1),
             "tree_rss_outside_kv_mb": round(sum(p["rss_outside_kv_mb"] for p in procs), 1)}
        self.samples.append(s)
        return s

    async def run(self, phase_of: Any) -> None:
        while True:
            self.sample(phase_of())
            await asyncio.sleep(self.every_s)


def _series_stats(points: list[tuple[float, float]], start: float, end: float, window_s: float) -> dict[str, Any]:
    base = [v for t, v in points if start <= t <= start + window_s]
    final = [v for t, v in points if end - window_s <= t <= end]
    if not base or not final:
        return {"note": "not alive over the whole load phase"}
    b, f = statistics.median(base), statistics.median(final)
    after = [(t, v) for t, v in points if start <= t <= end]
    slope = None
    if len(after) >= 3:
        tm, vm = statistics.fmean(t for t, _ in after), statistics.fmean(v for _, v in after)
        den = sum((t - tm) ** 2 for t, _ in after)
        slope = round(60 * sum((t - tm) * (v - vm) for t, v in after) / den, 2) if den else None
    return {"baseline_mb": b, "final_mb": f, "peak_mb": max(v for _, v in points),
            "growth_mb": round(f - b, 1), "growth_pct": round(100 * (f - b) / b, 2) if b else None,
            "slope_mb_per_min": slope}


def growth_report(samples: list[dict[str, Any]], load_start: float, warmup_s: float, load_end: float,
                  window_s: float = 30.0) -> dict[str, Any]:
    """Per process (by pid) and for the whole tree: RSS, the KV pool's resident part and RSS outside
    it, each as baseline (median of the first window_s after warm-up), final (median of the last
    window_s of load), growth and least-squares slope after warm-up."""
    fields = ("rss_mb", "kv_resident_mb", "rss_outside_kv_mb")
    series: dict[str, dict[str, list[tuple[float, float]]]] = {}
    meta: dict[str, dict[str, Any]] = {}
    for s in samples:
        for p in s["procs"]:
            key = str(p["pid"])
            meta[key] = {"name": p["name"], "engine": p.get("engine", False)}
            for f in fields:
                if p.get(f) is not None:
                    series.setdefault(key, {}).setdefault(f, []).append((s["t_s"], p[f]))
        tree = series.setdefault("tree", {})
        tree.setdefault("rss_mb", []).append((s["t_s"], s["tree_rss_mb"]))
        tree.setdefault("rss_outside_kv_mb", []).append((s["t_s"], s["tree_rss_outside_kv_mb"]))
    meta["tree"] = {"name": "server and all its descendants", "engine": False}
    start = load_start + warmup_s
    out = {}
    idle: dict[str, dict[str, float]] = {}  # phase -> key -> RSS, at idle before and after the load
    for s in samples:
        if s["phase"].startswith("idle"):
            idle[s["phase"]] = {str(p["pid"]): p["rss_mb"] for p in s["procs"]} | {"tree": s["tree_rss_mb"]}
    for key, by_field in series.items():
        entry = dict(meta[key])
        entry["rss_idle_before_load_mb"] = idle.get("idle_before_load", {}).get(key)
        entry["rss_idle_after_load_mb"] = idle.get("idle_after_load", {}).get(key)
        for f, points in by_field.items():
            entry[f.removesuffix("_mb")] = _series_stats(points, start, load_end, window_s)
        out[key] = entry
    return out


# ----------------------------------------------------------------------------- the server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, port: int, extra_args: list[str], extra_env: dict[str, str],
                 log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vtool.toolchain.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--disable-log-requests"]
    if model:
        cmd += ["--model", model]
    cmd += extra_args
    env = {**os.environ, **extra_env}
    log(f"starting: {' '.join(cmd)} (env {extra_env or '-'}; log {log_path})")
    with open(log_path, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the server was not healthy after {STARTUP_TIMEOUT_S} s; log: {log_path}")
        time.sleep(1)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the server and its children only
            proc.wait()


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            pass
    return out


def kv_pool_bytes(info: dict[str, Any]) -> int | None:
    """num_blocks x the bytes of one block (the engine's own formula) from the artifact's manifest."""
    try:
        from vtool.runtime.engine.engine import kv_bytes_per_block

        manifest = json.loads((Path(info["artifact"]) / "manifest.json").read_text())
        return info["engine"]["num_blocks"] * kv_bytes_per_block(manifest, info["engine"]["block_size"])
    except (OSError, KeyError, ValueError, ImportError):
        return None


def num_layers(info: dict[str, Any]) -> int | None:
    try:
        return json.loads((Path(info["artifact"]) / "manifest.json").read_text())["config"]["num_hidden_layers"]
    except (OSError, KeyError, ValueError):
        return None


def engine_by_maps(pid: int, info: dict[str, Any]) -> int | None:
    """The process of the tree that has the artifact's library mapped (the one running the model)."""
    library = str(Path(info.get("artifact", "")) / "model.so")
    for p in descendants(pid)[::-1]:
        try:
            if library in Path(f"/proc/{p}/maps").read_text():
                return p
        except OSError:
            continue
    return None


# ----------------------------------------------------------------------------- the clients

class Tally:
    def __init__(self) -> None:
        self.started = self.completed = self.cancelled = self.drain_closed = 0
        self.completion_tokens = self.prompt_tokens = 0
        self.errors: dict[str, int] = {}
        self.error_examples: list[str] = []
        self.finish_reasons: dict[str, int] = {}
        self.prompt_words: list[int] = []
        self.max_tokens: list[int] = []

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if len(self.error_examples) < 20:
            self.error_examples.append(f"{kind}: {detail[:300]}")


def make_prompt(rng: random.Random, max_words: int) -> str:
    n = round(2 ** rng.uniform(1, max_words.bit_length() - 1))  # log-uniform, 2..max_words
    body = " ".join(rng.choice(WORDS) for _ in range(n))
    if rng.random() < 0.3:
        return rng.choice(SHARED_PREFIXES) + " " + body
    return body


async def one_request(client: httpx.AsyncClient, url: str, model: str, rng: random.Random, args: argparse.Namespace,
                      tally: Tally, stop_all: asyncio.Event) -> None:
    prompt = make_prompt(rng, args.max_prompt_words)
    max_tokens = rng.randint(1, args.max_tokens)
    chat = rng.random() < 0.25
    cancel_after = rng.randint(1, max(1, max_tokens - 1)) if rng.random() < args.cancel_fraction else None
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True,
                            "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randint(0, 2**31),
                            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    if rng.random() < 0.5:
        body["ignore_eos"] = True  # full-length generations: the longest-lived sequences
    tally.started += 1
    tally.prompt_words.append(len(prompt.split()))
    tally.max_tokens.append(max_tokens)
    chunks, finish, done = 0, None, False
    try:
        async with client.stream("POST", url + path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                tally.error(f"http_{resp.status_code}", resp.text)
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    tally.error("error_chunk", data)
                    return
                if obj.get("usage"):
                    tally.completion_tokens += obj["usage"].get("completion_tokens", 0)
                    tally.prompt_tokens += obj["usage"].get("prompt_tokens", 0)
                for choice in obj.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after and finish is None:
                    tally.cancelled += 1
                    return  # leaving the block closes the connection mid-stream
                if stop_all.is_set():
                    tally.drain_closed += 1
                    return
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        tally.error(type(err).__name__, repr(err))
        return
    if not done or finish is None:
        tally.error("incomplete_stream", f"done={done} finish={finish} chunks={chunks}")
        return
    tally.completed += 1
    tally.finish_reasons[finish] = tally.finish_reasons.get(finish, 0) + 1


async def client_loop(i: int, url: str, model: str, args: argparse.Namespace, tally: Tally, deadline: float,
                      stop_all: asyncio.Event) -> None:
    rng = random.Random(args.seed * 1000 + i)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        await asyncio.sleep(rng.uniform(0, 2))  # do not all arrive in the same step
        while time.monotonic() < deadline and not stop_all.is_set():
            await one_request(client, url, model, rng, args, tally, stop_all)


async def run_load(url: str, model: str, args: argparse.Namespace, sampler: MemorySampler) -> dict[str, Any]:
    tally = Tally()
    phase = {"name": "warmup"}
    load_start = time.monotonic()
    deadline = load_start + args.minutes * 60
    warmup_s = args.warmup_minutes * 60
    stop_all = asyncio.Event()

    def phase_of() -> str:
        now = time.monotonic()
        if phase["name"] in ("warmup", "load"):
            phase["name"] = "warmup" if now < load_start + warmup_s else "load"
        return phase["name"]

    sampling = asyncio.create_task(sampler.run(phase_of))
    tasks = [asyncio.create_task(client_loop(i, url, model, args, tally, deadline, stop_all))
             for i in range(args.clients)]
    progress_every = 60
    next_progress = load_start + progress_every
    while time.monotonic() < deadline:
        await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if time.monotonic() >= next_progress:
            next_progress += progress_every
            last = sampler.samples[-1] if sampler.samples else {}
            log(f"{(time.monotonic() - load_start) / 60:.1f} min: {tally.started} started, {tally.completed} done, "
                f"{tally.cancelled} cancelled, {sum(tally.errors.values())} errors, "
                f"{tally.completion_tokens} tokens; tree RSS {last.get('tree_rss_mb')} MB")
    load_end_t = round(time.monotonic() - sampler.t0, 1)
    phase["name"] = "drain"
    drained = await asyncio.wait(tasks, timeout=args.drain_seconds)
    if drained[1]:
        stop_all.set()  # close what is still streaming at the next chunk
        await asyncio.wait(tasks, timeout=60)
    for t in tasks:
        if not t.done():
            t.cancel()
    sampling.cancel()
    return {"tally": tally, "load_start_t": round(load_start - sampler.t0, 1), "load_end_t": load_end_t,
            "warmup_s": warmup_s, "load_s": round(time.monotonic() - load_start, 1)}


async def settle_metrics(url: str, timeout_s: float = 60) -> dict[str, float]:
    """/metrics once the engine is idle (running and waiting 0, KV usage 0), or at the timeout."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            m = parse_metrics((await client.get(f"{url}/metrics")).text)
            idle = (m.get("vllm:num_requests_running", 1) == 0 and m.get("vllm:num_requests_waiting", 1) == 0
                    and m.get("vllm:kv_cache_usage_perc", 1) == 0)
            if idle or time.monotonic() > deadline:
                return m
            await asyncio.sleep(1)


# ----------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="load duration (default 10)")
    ap.add_argument("--warmup-minutes", type=float, default=None,
                    help="first part of the load not judged for growth (default: 2, or a fifth of --minutes "
                         "when shorter than 10)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-prompt-words", type=int, default=1024, help="prompt lengths are log-uniform up to this")
    ap.add_argument("--max-tokens", type=int, default=256, help="max_tokens is uniform in 1..this")
    ap.add_argument("--cancel-fraction", type=float, default=0.15)
    ap.add_argument("--sample-seconds", type=float, default=3.0)
    ap.add_argument("--drain-seconds", type=float, default=120.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--growth-target", type=float, default=5.0, help="percent (default 5)")
    ap.add_argument("--min-rss-mb", type=float, default=100.0,
                    help="judge growth only for processes at least this large at baseline")
    ap.add_argument("--model", default=None, help="the server's --model (default: vtool's default GGUF)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `vtool serve` argument (repeatable)")
    ap.add_argument("--server-env", action="append", default=[], help="KEY=VALUE for the server's environment")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="soak.json")
    args = ap.parse_args()
    if args.warmup_minutes is None:
        args.warmup_minutes = 2.0 if args.minutes >= 10 else args.minutes / 5
    extra_env = dict(kv.split("=", 1) for kv in args.server_env)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"vtool-soak-server-{port}.log"
    result: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items()}, "cpu": cpu_record(),
                              "commit": git_commit(), "server_log": str(log_path)}
    proc = start_server(args.model, port, args.server_arg, extra_env, log_path)
    try:
        t = time.monotonic()
        wait_healthy(proc, url, log_path)
        log(f"healthy after {time.monotonic() - t:.0f} s")
        info = httpx.get(f"{url}/server_info", timeout=10).json()
        model_name = info["served_model_names"][0]
        pool = kv_pool_bytes(info)
        engine_pid = info.get("engine", {}).get("engine_core_pid") or engine_by_maps(proc.pid, info) or proc.pid
        layers = num_layers(info)
        kv = kv_ranges(engine_pid, pool, layers) if pool and layers else []
        result["server"] = {"target": info.get("target"), "dtype": info.get("dtype"), "engine": info.get("engine"),
                            "engine_pid": engine_pid, "kv_pool_bytes": pool,
                            "kv_pool_mb": round(pool / 2**20, 1) if pool else None,
                            "kv_ranges_mb": [round((e - b) / 2**20, 1) for b, e in kv]}
        sampler = MemorySampler(proc.pid, args.sample_seconds, engine_pid, kv)
        idle_before = sampler.sample("idle_before_load")
        log(f"server tree before load: {[(p['name'], p['pid'], p['rss_mb']) for p in idle_before['procs']]}; "
            f"engine pid {engine_pid}; KV pool {result['server']['kv_pool_mb']} MB in mappings of "
            f"{result['server']['kv_ranges_mb']} MB")
        load = asyncio.run(run_load(url, model_name, args, sampler))
        metrics = asyncio.run(settle_metrics(url))
        sampler.sample("idle_after_load")
        tally: Tally = load["tally"]
        growth = growth_report(sampler.samples, load["load_start_t"], load["warmup_s"], load["load_end_t"])
        errors = sum(tally.errors.values())
        kv_end = metrics.get("vllm:kv_cache_usage_perc")
        failures = []
        if errors:
            failures.append(f"{errors} errors: {tally.errors}")
        # Judged: RSS outside the KV pool's mappings (the pool is allocated at startup and only
        # touched lazily; its resident part is reported, bounded by kv_pool_mb), for the tree and
        # for each process at least --min-rss-mb at baseline.
        for k, g in growth.items():
            judged = g.get("rss_outside_kv", {})
            if judged.get("baseline_mb") is None or (k != "tree" and judged["baseline_mb"] < args.min_rss_mb):
                continue
            if judged["growth_pct"] is not None and judged["growth_pct"] > args.growth_target:
                failures.append(f"{g['name']} ({k}) grew {judged['growth_pct']}% outside the KV pool after warm-up "
                                f"({judged['baseline_mb']} -> {judged['final_mb']} MB) > {args.growth_target}%")
        if not kv and pool:
            failures.append("the KV pool's mappings were not found in the engine process: growth is unattributed")
        if kv_end != 0:
            failures.append(f"vllm:kv_cache_usage_perc is {kv_end} at the end, not 0")
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            if metrics.get(gauge, 0) != 0:
                failures.append(f"{gauge} is {metrics.get(gauge)} at the end, not 0")
        if tally.started == 0:
            failures.append("no request was started")
        result.update({
            "requests": {"started": tally.started, "completed": tally.completed, "cancelled_by_client": tally.cancelled,
                         "closed_at_drain": tally.drain_closed, "errors": errors, "errors_by_kind": tally.errors,
                         "error_examples": tally.error_examples, "finish_reasons": tally.finish_reasons,
                         "completion_tokens_reported": tally.completion_tokens,
                         "prompt_tokens_reported": tally.prompt_tokens,
                         "prompt_words_median": statistics.median(tally.prompt_words) if tally.prompt_words else None,
                         "prompt_words_max": max(tally.prompt_words, default=None)},
            "load_seconds": load["load_s"],
            "memory_growth": growth,
            "metrics_at_end": {k: v for k, v in metrics.items() if k.startswith("vllm:") and (
                "usage" in k or "num_requests" in k or k.endswith("_total"))},
            "kv_cache_usage_at_end": kv_end,
            "failures": failures, "passed": not failures,
            "samples": sampler.samples,
        })
    finally:
        stop_server(proc)
    Path(args.out).write_text(json.dumps(result, indent=1))
    summary = {k: result.get(k) for k in ("requests", "kv_cache_usage_at_end", "failures", "passed")}
    summary["memory_growth"] = {
        k: {"name": g.get("name"), "engine": g.get("engine"), "rss_idle_before_load_mb": g.get("rss_idle_before_load_mb"),
            "rss_idle_after_load_mb": g.get("rss_idle_after_load_mb"),
            **{f: {x: g.get(f, {}).get(x) for x in ("baseline_mb", "final_mb", "growth_pct", "slope_mb_per_min",
                                                    "peak_mb")} for f in ("rss", "kv_resident", "rss_outside_kv")
               if f in g}}
        for k, g in result.get("memory_growth", {}).items()}
    summary["kv_pool_mb"] = result.get("server", {}).get("kv_pool_mb")
    summary["kv_ranges_mb"] = result.get("server", {}).get("kv_ranges_mb")
    summary["load_seconds"] = result.get("load_seconds")
    summary["cpu"] = {k: result["cpu"][k] for k in ("model", "cores", "flags", "loadavg_at_start")}
    print(json.dumps(summary, indent=1))
    log(f"wrote {args.out}: {'PASSED' if not result.get('failures') else 'FAILED: ' + '; '.join(result['failures'])}")
    return 0 if result.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
