"""Served A/B on one machine (issue 13): `vtool serve` of each artifact in turn, never two at
once, each on a port of its own, driven by `vtool bench --url` with the same prompts, the
artifacts alternating over rounds (machines of one kind differ by ~8%, runs on one machine by
~5%: compare within a call).

    python tests/bench/served_ab.py --model CKPT ART_A [ART_B ...] [--labels a,b] [--rounds 2]
        [--runs 64x64,64x512,1x8] [--temperatures 0,1] [--top-p 0.9] [--input-len 128] [--output-len 128] [--max-num-seqs 64]
        [--max-num-batched-tokens 8192] [--max-model-len 1024] [--envs "A;B"] [--server-args "A;B"] [--out results.json]

Each server is started (runtime/bench/local_server.py: the runtime's own `vtool serve --artifact`
on a free port, stopped before the next), warmed
up with one run of the first --runs entry, then measured at every `CONCURRENCYxPROMPTS` entry
(fresh prompts of exactly --input-len tokens, ignore_eos). Besides the bench's figures, each
run reports the server's own step durations by kind, which `vtool bench --url` reads from
/metrics (vtool:engine_step_seconds: decode steps, and the mixed and prefill steps that admit
prompts), so a slower run says whether its decode steps or its admissions were slower, and the
server's own mean time to first token and queue time (vLLM's histograms, from the API server's
hand-off to the engine core: set against the bench's TTFT they say whether a late first token
waited in the engine or outside it). One JSON line per run on stdout; --out writes them all.
"""
from __future__ import annotations

import argparse
import io
import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console

from vtool.runtime.bench.local_server import local_server

KEYS = ("client_processes", "output_throughput", "duration", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_itl_ms",
        "p90_itl_ms", "p99_itl_ms", "completed", "failed")


def parse_runs(text: str) -> list[tuple[int, int]]:
    """"64x64,64x512,1x8" -> [(64, 64), (64, 512), (1, 8)] (concurrency, prompts)."""
    runs = []
    for part in text.split(","):
        concurrency, _, prompts = part.strip().partition("x")
        if not (concurrency.isdigit() and prompts.isdigit()) or int(concurrency) < 1 or int(prompts) < 1:
            raise SystemExit(f"--runs: {part!r} is not CONCURRENCYxPROMPTS (e.g. 64x512)")
        runs.append((int(concurrency), int(prompts)))
    return runs


def bench(url: str, a: argparse.Namespace, concurrency: int, prompts: int, seed: int,
          temperature: float = 0.0) -> dict[str, Any]:
    from vtool.runtime.bench.command import BenchOptions, bench_main

    opts = BenchOptions(model=None, url=url, endpoint="completions", num_prompts=prompts, input_len=a.input_len,
                        output_len=a.output_len, concurrency=[concurrency], ignore_eos=True, seed=seed,
                        tokenizer=str(a.tokenizer or a.model), fresh_prompts=True, temperature=temperature,
                        top_p=a.top_p, client_processes=a.client_processes)
    return bench_main(opts, console=Console(file=io.StringIO(), width=160))["runs"][0]


# The server's own request latencies (vLLM's histograms, from the API server's hand-off to the
# engine core): against the bench's TTFT they say whether a slow first token waited in the engine
# or before it (HTTP, tokenizing, the API server's loop) or on its way back to the client.
SERVER_LATENCIES = {"vllm:time_to_first_token_seconds": "server_ttft_ms", "vllm:request_queue_time_seconds": "server_queue_ms"}


def phase_totals(url: str) -> dict[str, float]:
    """The engine core's host seconds per step phase and its step count, and the sums and counts
    of SERVER_LATENCIES, from /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "vtool:engine_step_phase_seconds_total":
                totals[sample.labels["phase"]] = sample.value
            elif sample.name == "vtool:engine_steps_total":
                totals["steps"] = sample.value
            elif sample.name.removesuffix("_sum") in SERVER_LATENCIES and sample.name.endswith("_sum"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
            elif sample.name.removesuffix("_count") in SERVER_LATENCIES and sample.name.endswith("_count"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def phases_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Milliseconds per engine step of each phase over a run (schedule, forward, sample, output, io)."""
    steps = after.get("steps", 0) - before.get("steps", 0)
    return {k: round(1e3 * (after[k] - before.get(k, 0)) / steps, 3) for k in after
            if k != "steps" and not k.startswith("vllm:") and steps > 0}


def latencies_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean milliseconds of each SERVER_LATENCIES histogram over a run's requests."""
    out: dict[str, float | None] = {}
    for metric, key in SERVER_LATENCIES.items():
        count = after.get(f"{metric}_count", 0.0) - before.get(f"{metric}_count", 0.0)
        seconds = after.get(f"{metric}_sum", 0.0) - before.get(f"{metric}_sum", 0.0)
        out[key] = round(1e3 * seconds / count, 2) if count > 0 else None
    return out


def measure(label: str, url: str, a: argparse.Namespace, runs: list[tuple[int, int]], round_index: int) -> list[dict]:
    bench(url, a, *runs[0], seed=1_000_000 + round_index)  # warm-up: its own prompts
    results = []
    for t_index, temperature in enumerate(a.temperatures):
        for i, (concurrency, prompts) in enumerate(runs):
            before = phase_totals(url)
            run = bench(url, a, concurrency, prompts, seed=round_index * 100 + t_index * 10_000 + i,
                        temperature=temperature)
            result = {"label": label, "round": round_index, "temperature": temperature, "top_p": a.top_p,
                      "concurrency": concurrency,
                      "prompts": prompts,
                      **{k: (round(run[k], 2) if isinstance(run.get(k), float) else run.get(k)) for k in KEYS},
                      "server_steps": run["server_steps"],  # the bench's scrape of vtool:engine_step_seconds
                      **latencies_between(before, after := phase_totals(url)),
                      "phase_ms_per_step": phases_between(before, after)}
            print(json.dumps(result), flush=True)
            results.append(result)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--model", required=True, type=Path, help="the checkpoint every artifact serves")
    ap.add_argument("--tokenizer", type=Path, help="the bench's local tokenizer (default: --model)")
    ap.add_argument("--labels", help="comma-separated, one per artifact (default: folder names)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--runs", default="64x64,64x512,1x8", help="CONCURRENCYxPROMPTS,... (the first also warms up)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--temperatures", default="0",
                    help="comma list: every run at each (0: greedy, the bench's default, as vLLM's)")
    ap.add_argument("--top-p", type=float, help="sent with every request (default: none, the server's)")
    ap.add_argument("--envs", help="semicolon-separated, one per artifact: environment settings its server starts "
                                   "with, e.g. 'VTOOL_OVERLAP_MODEL_CALLS=0;VTOOL_OVERLAP_MODEL_CALLS=1' (the same "
                                   "artifact twice, two engine settings)")
    ap.add_argument("--server-args", help="semicolon-separated, one per artifact: more `vtool serve` arguments, "
                                          "e.g. ';--api-server-count 2' (the same artifact with one and two API servers)")
    ap.add_argument("--client-processes", type=int, help="the bench's worker processes (default: its own rule)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    a.temperatures = [float(t) for t in a.temperatures.split(",")]
    runs = parse_runs(a.runs)
    labels = a.labels.split(",") if a.labels else [p.name for p in a.artifacts]
    if len(labels) != len(a.artifacts):
        raise SystemExit(f"--labels names {len(labels)} artifacts, {len(a.artifacts)} given")
    envs = [dict(kv.split("=", 1) for kv in part.split()) for part in a.envs.split(";")] if a.envs \
        else [{} for _ in a.artifacts]
    if len(envs) != len(a.artifacts):
        raise SystemExit(f"--envs gives {len(envs)} settings, {len(a.artifacts)} artifacts given")
    server_args = [part.split() for part in a.server_args.split(";")] if a.server_args else [[] for _ in a.artifacts]
    if len(server_args) != len(a.artifacts):
        raise SystemExit(f"--server-args gives {len(server_args)} settings, {len(a.artifacts)} artifacts given")
    results = []
    console = Console(stderr=True)
    for round_index in range(a.rounds):
        order = list(zip(labels, a.artifacts, envs, server_args))
        if round_index % 2:
            order.reverse()  # alternate who goes first
        for label, artifact, env, extra in order:
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # the server process inherits them
            try:
                # the runtime's own `vtool serve --artifact` on a free port, stopped before the next
                with local_server(a.model, artifact, a.max_num_seqs, a.max_num_batched_tokens, None, console,
                                  ["--max-model-len", str(a.max_model_len), *extra]) as (url, _tokenizer):
                    results += measure(label, url, a, runs, round_index)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
