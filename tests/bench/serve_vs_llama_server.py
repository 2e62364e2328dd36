"""Serving on the CPU, vtool against llama.cpp (issue #13's CPU target): `vtool serve` and
`llama-server` on the same GGUF, the same thread count, driven by the same client.

    python tests/bench/serve_vs_llama_server.py [--threads 2] [--concurrency 1,4,8]
        [--num-prompts 32] [--input-len 128] [--output-len 128] [--rounds 1] [--out results.json]
    python tests/bench/serve_vs_llama_server.py --smoke     # a short run: 8 prompts, 64 in, 32 out

What it does:
  1. builds vtool's artifact for the default model (SmolLM2-135M-Instruct Q4_1 GGUF; `--target
     host`, float32, `--quantization gguf`, as tests/bench/cpu_vs_llamacpp.py; cached) and
     llama-server (tests/bench/llamacpp.py build_llama_server; cached);
  2. per round, one server at a time (never both running): `vtool serve --max-num-seqs N` with
     VTOOL_CPU_THREADS=T, then `llama-server -np N -t T -tb T` (llamacpp.llama_server; llama.cpp's
     defaults, --no-repack only where repacking crashes it), N = the highest concurrency level;
  3. drives each with `vtool bench --url` (runtime/bench: bench_main) on /v1/completions at
     every --concurrency level in one invocation: the same fresh prompts for both servers
     (one seed), new prompts at every level and for the warm-up, exactly --input-len tokens of
     the GGUF's tokenizer, ignore_eos so every request makes --output-len tokens, greedy
     sampling on both (temperature 0), output counted from each server's usage;
  4. checks each run (no failures, every prompt the asked length on the server, every output
     counted from usage) and writes a JSON: per level output tok/s, TTFT and TPOT (mean and
     median) for both, and vtool / llama-server ratios (tok/s above 1: vtool faster; TTFT and
     TPOT below 1: vtool faster); the CPU model name and flags (/proc/cpuinfo); the commands;
     the CPU the server used and the other processes' use while each server was measured (in
     cores: the machine may be shared). With --rounds > 1 the best round per server and level is
     kept (highest tok/s; other load can only slow a run down).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cpu_info import cpu_info  # noqa: E402  (re-exported: spec_vs_llamacpp imports it from here)
from vtool.runtime.bench.local_server import stop_process, wait_healthy  # noqa: E402

KEYS = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms",
        "mean_e2el_ms", "request_throughput")


def log(msg: str) -> None:
    print(f"[serve_vs_llama_server] {msg}", file=sys.stderr, flush=True)



@contextlib.contextmanager
def vtool_server(model: Path, artifact: Path, threads: int, max_num_seqs: int, max_num_batched_tokens: int,
                 log_dir: Path, startup_timeout: float = 600.0) -> Iterator[dict[str, Any]]:
    """`vtool serve` of a built artifact (the runtime's own command: no compile while measured)."""
    from vtool.runtime.bench.local_server import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "vtool.runtime.cli", "serve", "--model", str(model), "--artifact", str(artifact),
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max_num_seqs),
           "--max-num-batched-tokens", str(max_num_batched_tokens), "--disable-log-requests"]
    env = {**os.environ, "VTOOL_CPU_THREADS": str(threads)}
    log_path = log_dir / f"vtool-serve-{port}.log"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(proc, url, startup_timeout, log_path, "vtool serve")
        yield {"url": url, "command": f"VTOOL_CPU_THREADS={threads} " + " ".join(cmd), "log": str(log_path),
               "pid": proc.pid}
    finally:
        stop_process(proc, 30)


def _tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its live descendants (a server's engine process included)."""
    import psutil

    total = 0.0
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class OtherLoad:
    """`.cores`: CPU cores' worth of work done meanwhile by processes other than this one and
    the server being measured (system busy time from /proc/stat minus both); `.server_cores`:
    the server's own (membw.OtherLoad counts only reaped children, so a live server would
    count as other load there)."""

    def __init__(self, server_pid: int) -> None:
        self.pid = server_pid

    def __enter__(self) -> "OtherLoad":
        from membw import _proc_stat

        self._busy = _proc_stat()[0]
        t = os.times()
        self._own = t.user + t.system
        self._server = _tree_cpu(self.pid)
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        from membw import _proc_stat

        wall = time.perf_counter() - self._t
        t = os.times()
        own = t.user + t.system - self._own
        server = _tree_cpu(self.pid) - self._server
        busy = _proc_stat()[0] - self._busy
        self.cores = round(max(0.0, busy - own - server) / wall, 2) if wall > 0 and busy else float("nan")
        self.server_cores = round(server / wall, 2) if wall > 0 else float("nan")


def bench(url: str, server_pid: int, tokenizer: Path, levels: list[int], a: argparse.Namespace,
          seed: int) -> tuple[dict[str, Any], OtherLoad]:
    """One `vtool bench --url` invocation over every level; returns the report and the load
    (other processes', the server's) meanwhile."""
    from rich.console import Console

    from vtool.runtime.bench.command import BenchOptions, bench_main

    opts = BenchOptions(model=None, url=url, endpoint="completions", num_prompts=a.num_prompts,
                        input_len=a.input_len, output_len=a.output_len, concurrency=levels, ignore_eos=True,
                        seed=seed, tokenizer=str(tokenizer), fresh_prompts=True, extra_body={"temperature": 0.0})
    out = io.StringIO()
    with OtherLoad(server_pid) as load:
        report = bench_main(opts, console=Console(file=out, width=160))
    if a.verbose:
        print(out.getvalue(), file=sys.stderr)
    return report, load


def check(report: dict[str, Any], a: argparse.Namespace) -> list[str]:
    """What makes a run's figures not comparable: failures, prompts of another length on the
    server than asked, outputs not counted from usage, prompt-cache reuse."""
    problems = []
    for run in report["runs"]:
        c = run["max_concurrency"]
        if run["failed"]:
            problems.append(f"concurrency {c}: {run['failed']} failed: {run['failed_errors'][:2]}")
        pc = run["prompt_tokens_check"]
        if pc["mismatched_requests"]:
            problems.append(f"concurrency {c}: {pc['mismatched_requests']} prompts of another length on the server "
                            f"({pc['mismatch_examples'][:2]})")
        if run["output_tokens_counted_by"] != {"usage": run["completed"]}:
            problems.append(f"concurrency {c}: output counted by {run['output_tokens_counted_by']}")
        if run["total_output_tokens"] != run["completed"] * a.output_len:
            problems.append(f"concurrency {c}: {run['total_output_tokens']} output tokens, "
                            f"expected {run['completed'] * a.output_len}")
        if run.get("cached_prompt_tokens"):
            problems.append(f"concurrency {c}: {run['cached_prompt_tokens']} prompt tokens reused from the cache")
    if not report.get("fresh_prompts"):
        problems.append("a prompt was sent in more than one run")
    return problems


def figures(run: dict[str, Any]) -> dict[str, Any]:
    return {k: run[k] for k in KEYS} | {"completed": run["completed"], "total_output_tokens": run["total_output_tokens"],
                                        "total_input_tokens": run["total_input_tokens"]}


def ratio(x: float, y: float) -> float | None:
    return round(x / y, 3) if y else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", "-t", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="vtool then llama-server, this many times; best kept")
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024, help="vtool serve (vtool bench's default)")
    ap.add_argument("--seed", type=int, default=None, help="prompt seed (default: fresh, written in the JSON)")
    ap.add_argument("--smoke", action="store_true", help="a short run: 8 prompts, 64 tokens in, 32 out")
    ap.add_argument("--target", default="host")
    ap.add_argument("--out", type=Path, help="JSON (default: <llama.cpp folder>/serve_vs_llama_server.json)")
    ap.add_argument("--verbose", action="store_true", help="print vtool bench's tables")
    ap.add_argument("--quiet-cores", type=float, default=0.3,
                    help="before each server's run wait until other processes use at most this many cores")
    ap.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for that, at most")
    a = ap.parse_args()
    if a.smoke:
        a.num_prompts, a.input_len, a.output_len = 8, 64, 32

    import llamacpp
    from membw import wait_quiet

    from vtool.runtime.bench.command import fresh_seed, parse_concurrency
    from vtool.runtime.weights.default_model import default_model_path
    from vtool.toolchain.build import build_artifact

    levels = parse_concurrency(a.concurrency)
    if 0 in levels:
        raise SystemExit("--concurrency: give finite levels (llama-server's -np and vtool's --max-num-seqs follow the highest)")
    slots = max(levels)
    seed = a.seed if a.seed is not None else fresh_seed()
    model = default_model_path()
    root = llamacpp.llamacpp_root()
    binary = llamacpp.build_llama_server(root)
    t = time.perf_counter()
    artifact = build_artifact(str(model), a.target, "float32", quantization="gguf", progress=lambda m: log(f"  {m}"))
    log(f"vtool artifact {artifact} ({time.perf_counter() - t:.0f} s); llama-server {binary}")
    ctx = slots * (a.input_len + a.output_len + 64)
    log_dir = Path(tempfile.mkdtemp(prefix="serve-vs-llama-"))

    rounds: dict[str, list[dict[str, Any]]] = {"vtool": [], "llama_server": []}
    for r in range(a.rounds):
        for name, serving in (("vtool", lambda: vtool_server(model, artifact, a.threads, slots,
                                                              a.max_num_batched_tokens, log_dir)),
                              ("llama_server", lambda: llamacpp.llama_server(model, parallel=slots, threads=a.threads,
                                                                            ctx_size=ctx, binary=binary,
                                                                            log_dir=log_dir))):
            before = wait_quiet(a.quiet_cores, a.max_wait)
            with serving() as srv:
                report, load = bench(srv["url"], srv["pid"], model, levels, a, seed)
            rounds[name].append({"server": srv, "report": report, "other_load_cores_before": before,
                                 "other_load_cores": load.cores, "server_cores": load.server_cores,
                                 "problems": check(report, a)})
            log(f"round {r + 1}: {name} " + ", ".join(f"c{x['max_concurrency']} {x['output_throughput']:.1f} tok/s"
                                                     for x in report["runs"])
                + f" (server {load.server_cores} cores, other processes {load.cores} cores)")

    def best(name: str, i: int) -> tuple[dict[str, Any], int]:
        ok = [(k, rd) for k, rd in enumerate(rounds[name]) if not rd["problems"]] or list(enumerate(rounds[name]))
        k, rd = max(ok, key=lambda kr: kr[1]["report"]["runs"][i]["output_throughput"])
        return rd["report"]["runs"][i], k

    result_levels = []
    for i, c in enumerate(levels):
        v, vk = best("vtool", i)
        lsrv, lk = best("llama_server", i)
        result_levels.append({
            "concurrency": c,
            "vtool": {**figures(v), "round": vk + 1},
            "llama_server": {**figures(lsrv), "round": lk + 1},
            "ratio_vtool_over_llama_server": {
                "output_tok_s": ratio(v["output_throughput"], lsrv["output_throughput"]),
                "mean_ttft": ratio(v["mean_ttft_ms"], lsrv["mean_ttft_ms"]),
                "median_ttft": ratio(v["median_ttft_ms"], lsrv["median_ttft_ms"]),
                "mean_tpot": ratio(v["mean_tpot_ms"], lsrv["mean_tpot_ms"]),
                "median_tpot": ratio(v["median_tpot_ms"], lsrv["median_tpot_ms"]),
            },
        })
    problems = {name: [p for rd in rds for p in rd["problems"]] for name, rds in rounds.items()}
    result: dict[str, Any] = {
        "what": "vtool serve vs llama-server on the CPU: /v1/completions, same GGUF, threads, slots and prompts, "
                "driven by vtool bench --url (vLLM's metrics); ratio = vtool / llama-server",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": cpu_info(),
        "model": str(model.name),
        "threads": a.threads, "slots": slots, "levels": levels, "num_prompts": a.num_prompts,
        "input_len": a.input_len, "output_len": a.output_len, "seed": seed, "rounds": a.rounds,
        "sampling": "greedy (temperature 0), ignore_eos",
        "vtool": {"artifact": str(artifact), "command": rounds["vtool"][0]["server"]["command"],
                  "max_num_batched_tokens": a.max_num_batched_tokens},
        "llama_server": {"command": rounds["llama_server"][0]["server"]["command"],
                         "repack": rounds["llama_server"][0]["server"]["repack"],
                         "build": llamacpp.llama_server_record(root)},
        "valid": not any(problems.values()), "problems": problems,
        # other processes took CPU while a server was measured: its figures are lower bounds, and
        # a spinning ggml thread pool (llama-server) loses far more from a taken core than vtool
        "noisy": any(rd["other_load_cores"] > a.quiet_cores for rds in rounds.values() for rd in rds),
        "levels_result": result_levels,
        "other_load_cores": {name: [rd["other_load_cores"] for rd in rds] for name, rds in rounds.items()},
        "server_cores": {name: [rd["server_cores"] for rd in rds] for name, rds in rounds.items()},
        "other_load_cores_before": {name: [rd["other_load_cores_before"] for rd in rds] for name, rds in rounds.items()},
        "reports": {name: [rd["report"] for rd in rds] for name, rds in rounds.items()},
    }
    out = a.out or root / "serve_vs_llama_server.json"
    out.write_text(json.dumps(result, indent=2) + "\n")

    m = result["machine"]
    print(f"{m['model_name']} ({m['cores']} cores; {' '.join(m['simd_flags'])}), -t {a.threads}, {slots} slots, "
          f"{a.num_prompts} prompts x {a.input_len} in / {a.output_len} out, seed {seed}")
    print(f"{'conc':>4}  {'vtool tok/s':>11} {'llama tok/s':>11} {'ratio':>6}  {'TTFT v/l ms':>15} {'ratio':>6}  "
          f"{'TPOT v/l ms':>13} {'ratio':>6}")
    for lv in result_levels:
        v, lsrv, rt = lv["vtool"], lv["llama_server"], lv["ratio_vtool_over_llama_server"]
        print(f"{lv['concurrency']:>4}  {v['output_throughput']:>11.1f} {lsrv['output_throughput']:>11.1f} "
              f"{rt['output_tok_s']:>6.2f}  {v['mean_ttft_ms']:>7.1f}/{lsrv['mean_ttft_ms']:<7.1f} "
              f"{rt['mean_ttft']:>6.2f}  {v['mean_tpot_ms']:>6.1f}/{lsrv['mean_tpot_ms']:<6.1f} {rt['mean_tpot']:>6.2f}")
    if not result["valid"]:
        print(f"NOT COMPARABLE: {json.dumps(problems)}")
    if result["noisy"]:
        print(f"NOISY: other processes used {json.dumps(result['other_load_cores'])} cores while the servers ran "
              f"(the servers: {json.dumps(result['server_cores'])}); measure again on a quiet machine")
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
