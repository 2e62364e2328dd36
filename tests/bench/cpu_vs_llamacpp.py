"""vtool against llama.cpp on the CPU, same GGUF files, same threads, same conditions (issue #5).

    python tests/bench/cpu_vs_llamacpp.py [--threads 2] [--rounds 3] [--nice -19] [--only NAME ...]
                                          [--bandwidth-gbs 59.8] [--out results.json]
                                          [--files F.gguf ...] [--baseline-tree DIR]
                                          [--target x86-avx2 --llamacpp-isa avx2]

--llamacpp-isa: which llama.cpp build is the peer (tests/bench/llamacpp.py ISA_VARIANTS): `native`
(GGML_NATIVE=ON, the default) or `avx2` (AVX2/FMA/F16C, every AVX-512/AVX-VNNI/AMX option off);
use `avx2` with `--target x86-avx2` to compare what each does on an AVX2-only CPU on a CPU that
has more. The JSON records both: "llama_cpp_isa" (with the build's flags and, for avx2, its
isa_check) and "vtool_target" (the name given, the artifact manifest's target row, its LLVM
mcpu, the integer-dot ISA vtool picks for it, and the instructions its model.so uses).

--files: measure these GGUF files (named by their stem) instead of the prepared ones (with them
unless --only is given). --baseline-tree DIR: a second vtool source tree (DIR holds the package
folder `vtool`, e.g. a copy of this tree with one change undone): each round also builds and
measures the file with it (PYTHONPATH=DIR), reported as "baseline" beside the tree under test,
in the same rounds as llama-bench.

For each GGUF file that tests/bench/llamacpp.py prepares (SmolLM2-135M Q4_1 = the default
model, SmolLM2 Q8_0, Qwen3-0.6B-shape Q4_1 and Q8_0):
  1. builds vtool's artifact for it (`--quantization gguf`, `--target host`, float32; cached);
  2. per round, alternately: vtool's figures (a subprocess, see below), then llama-bench's
     pp512 and tg128 (llamacpp.llama_bench, `-r --reps`, llama.cpp's default settings; an
     invocation that fails with them, as pp512 with the AMX weight buffer of a GCC 12 native
     build does, is run again at once with `--repack 0`, and that setting is kept for the
     file's later rounds; each figure records its setting);
     every invocation, vtool's included, first waits (bounded) for the other processes to go
     quiet, runs in a scheduling group of its own at --nice, and records the cores' worth of
     CPU others used meanwhile; the best of --rounds rounds is kept for each figure (other load
     can only slow a run down);
  3. writes a JSON (every round, every command) and prints the figures, vtool / llama.cpp
     ratios and the decode roofline (measured read bandwidth / weight bytes per token).

vtool's figures, measured in a worker (`--worker`, run with VTOOL_CPU_THREADS=--threads):
  pp512        one 512-token prefill of a fresh sequence through the `prefill` entry point
               (synthetic token ids), embed included, logits of the last token to the host:
               512 / seconds, mean of --reps (llama-bench: one 512-token batch, mean of -r);
  tg128        128 decode steps of one sequence from an empty context through the `decode`
               entry point, embed included, each step's logits to the host and argmax there
               (the model step with greedy host sampling): 128 / seconds, mean of --reps
               (llama-bench: 128 one-token steps from an empty context, no sampling);
  tg128_engine the same 128 steps as the engine runs them (vtool.runtime.engine.engine.Engine: scheduler,
               KV-block bookkeeping, the host sampler, incremental detokenization), greedy,
               ignore_eos, a 1-token prompt, timed from the first generated token to the 129th.
Each worker first warms up (one prefill, a few decode steps), as llama-bench does.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

N_PROMPT, N_GEN = 512, 128


def log(msg: str) -> None:
    print(f"[cpu_vs_llamacpp] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the vtool worker

def worker(artifact: str, model: str, reps: int, engine_too: bool) -> dict[str, Any]:
    """Runs in its own process (VTOOL_CPU_THREADS set by the parent): loads the artifact and
    measures pp512, tg128 and tg128_engine; returns the figures (t/s per repetition)."""
    import numpy as np

    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.runtime.session import open_session

    t0 = time.perf_counter()
    session = open_session(Path(artifact), open_checkpoint(Path(model)), max_model_len=N_PROMPT + N_GEN + 16)
    load_s = time.perf_counter() - t0
    gen = session.generator
    vocab = session.model.vocab_size
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, min(vocab, 30000), N_PROMPT)]

    def pp() -> float:
        gen._fresh_sequence(N_PROMPT + N_GEN)
        t = time.perf_counter()
        gen._forward("prefill", prompt)
        return N_PROMPT / (time.perf_counter() - t)

    def tg(steps: int = N_GEN) -> float:
        gen._fresh_sequence(steps + 1)
        token = prompt[0]
        t = time.perf_counter()
        for _ in range(steps):
            token = int(np.argmax(gen._forward("decode", [token])))
        return steps / (time.perf_counter() - t)

    pp()
    tg(8)  # warm-up, as llama-bench's
    out: dict[str, Any] = {"load_seconds": round(load_s, 2),
                           "threads_env": os.environ.get("VTOOL_CPU_THREADS"),
                           "pp512": [round(pp(), 2) for _ in range(reps)],
                           "tg128": [round(tg(), 2) for _ in range(reps)]}
    if engine_too:
        from vtool.runtime.engine.engine import Engine, EngineConfig
        from vtool.runtime.sampling.params import SamplingParams

        engine = Engine(session, EngineConfig(max_num_seqs=1, enable_prefix_caching=False,
                                              max_model_len=N_PROMPT + N_GEN + 16))
        params = SamplingParams(temperature=0.0, max_tokens=N_GEN + 1, ignore_eos=True)

        def tg_engine(i: int) -> float:
            engine.add_request(f"tg-{i}", prompt[:1], params)
            first = last = None
            n = 0
            while engine.has_unfinished():
                for o in engine.step():
                    n += len(o.new_token_ids)
                    last = time.perf_counter()
                    first = first or last
            assert n == N_GEN + 1, n
            return N_GEN / (last - first)

        tg_engine(-1)
        out["tg128_engine"] = [round(tg_engine(i), 2) for i in range(reps)]
    return out


def run_worker(artifact: Path, model: str, threads: int, reps: int, nice: int, quiet: tuple[float, float],
               engine_too: bool, tree: Path | None = None) -> dict[str, Any]:
    """The worker in a subprocess, in the conditions llama-bench gets (quiet wait, own
    scheduling group at `nice`, same thread count). `tree`: run another vtool source tree's
    worker (--baseline-tree)."""
    from membw import OtherLoad, own_sched_group, wait_quiet

    script = tree / "vtool" / "tests" / "bench" / Path(__file__).name if tree else Path(__file__).resolve()
    cmd = [sys.executable, str(script), "--worker", "--artifact", str(artifact),
           "--model", model, "--reps", str(reps)] + (["--engine"] if engine_too else [])
    env = {**os.environ, "VTOOL_CPU_THREADS": str(threads)}
    if tree:
        env["PYTHONPATH"] = str(tree)
    before = wait_quiet(*quiet)
    t0 = time.perf_counter()
    with OtherLoad() as load:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              preexec_fn=(lambda: own_sched_group(nice)) if nice else None)
    run: dict[str, Any] = {"command": f"VTOOL_CPU_THREADS={threads} " + " ".join(cmd), "nice": nice,
                           "returncode": done.returncode, "seconds": round(time.perf_counter() - t0, 1),
                           "other_load_cores_before": before, "other_load_cores_during": load.cores}
    try:
        run["result"] = json.loads(done.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        run["result"] = None
        run["stderr_tail"] = done.stderr.strip()[-1500:]
    return run


# ----------------------------------------------------------------------------- the comparison

def build_vtool(model: str, target: str, activations: str = "auto", tree: Path | None = None) -> Path:
    t = time.perf_counter()
    if tree:  # the other tree's build_artifact, in a process that imports vtool from it
        code = ("import sys; from vtool.toolchain.build import build_artifact; "
                f"print(build_artifact({model!r}, {target!r}, 'float32', quantization='gguf', "
                f"activations={activations!r}))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONPATH": str(tree)})
        folder = Path(done.stdout.strip().splitlines()[-1])
        log(f"baseline artifact {folder} ({time.perf_counter() - t:.0f} s)")
        return folder
    from vtool.toolchain.build import build_artifact

    folder = build_artifact(model, target, "float32", quantization="gguf", activations=activations,
                            progress=lambda m: log(f"  {m}"))
    log(f"vtool artifact {folder} ({time.perf_counter() - t:.0f} s)")
    return folder


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def vtool_target_info(artifact: Path, target: str) -> dict[str, Any]:
    """What the vtool artifact was built for: the target name given, the manifest's target row,
    its LLVM mcpu, the integer-dot ISA vtool's x86 family picks for that row
    (models/int8_activations.py int8_isa: x86-avx2 -> "avx2", vpmaddubsw + vpmaddwd), and counts
    of the telling instructions in its model.so (objdump, where there is one): zmm registers
    (AVX-512), vpdpbusd (AVX-512 VNNI / AVX-VNNI), vpmaddubsw (the AVX2 integer dot)."""
    import shutil

    from vtool.targets.table import lookup
    from vtool.toolchain.families import family_of

    manifest = json.loads((artifact / "manifest.json").read_text())
    spec = lookup(manifest["target"]["name"])
    info: dict[str, Any] = {"given": target, "manifest_target": manifest["target"]["name"],
                            "mcpu": manifest["target"].get("tvm", {}).get("mcpu"),
                            "int8_isa": family_of(spec).int8_isa(spec), "activations": manifest.get("activations")}
    objdump = shutil.which("objdump")
    lib = artifact / "model.so"
    if objdump and lib.exists():
        dis = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True,
                             check=False).stdout
        info["model_so_instructions"] = {"zmm": dis.count("%zmm"), "vpdpbusd": dis.count("vpdpbusd"),
                                         "vpmaddubsw": dis.count("vpmaddubsw")}
    return info


def bandwidth_from(args: argparse.Namespace, root: Path) -> tuple[float | None, str]:
    if args.bandwidth_gbs:
        return args.bandwidth_gbs, "--bandwidth-gbs"
    for name in ("membw-1gib.json", "membw-4gib.json"):
        p = root / name
        if p.exists():
            try:
                return float(json.loads(p.read_text())["read_gbs"][str(args.threads)]["best"]), str(p)
            except (KeyError, ValueError, json.JSONDecodeError):
                pass
    return None, "none (pass --bandwidth-gbs, from tests/bench/membw.py)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per invocation (llama-bench -r)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating vtool/llama-bench rounds; best kept")
    ap.add_argument("--only", nargs="*", help="model names (smollm2-135m-q4_1 smollm2-135m-q8_0 "
                                              "qwen3-0.6b-q4_1 qwen3-0.6b-q8_0); default all")
    ap.add_argument("--nice", type=int, default=-19, help="as llamacpp.py --nice (negative needs root)")
    ap.add_argument("--quiet-cores", type=float, default=0.3)
    ap.add_argument("--max-wait", type=float, default=120.0)
    ap.add_argument("--target", default="host", help="vtool's target (x86-avx2 with --llamacpp-isa avx2)")
    ap.add_argument("--llamacpp-isa", default="native", help="the llama.cpp build measured: native (GGML_NATIVE=ON) "
                    "or avx2 (AVX2/FMA/F16C only; built on first use, at nice 10); see llamacpp.py ISA_VARIANTS")
    ap.add_argument("--activations", nargs="+", default=["auto"], choices=["auto", "decode", "q8_0", "none"],
                    help="vtool builds to measure per file: the first is the table's, the others are printed "
                         "below it (same rounds)")
    ap.add_argument("--no-engine", action="store_true", help="skip the tg128_engine figure")
    ap.add_argument("--vtool-only", action="store_true", help="skip llama-bench")
    ap.add_argument("--bandwidth-gbs", type=float, help="read bandwidth for the roofline (default: membw JSON "
                                                        "in the llama.cpp folder, --threads column)")
    ap.add_argument("--out", type=Path, help="JSON (default: <llama.cpp folder>/cpu_vs_llamacpp.json)")
    ap.add_argument("--files", nargs="*", type=Path, help="GGUF files to measure (named by their stem)")
    ap.add_argument("--baseline-tree", type=Path, help="another vtool source tree (the folder holding `vtool`) "
                                                       "measured in the same rounds")
    # the worker
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--artifact", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.artifact, a.model, a.reps, a.engine)))
        return

    import llamacpp

    if a.llamacpp_isa not in llamacpp.ISAS:
        ap.error(f"--llamacpp-isa: one of {', '.join(llamacpp.ISAS)}")
    root = llamacpp.llamacpp_root()
    info = llamacpp.build(root, os.cpu_count() or 2, a.llamacpp_isa, nice=10)
    binary = llamacpp.bench_binary(root, a.llamacpp_isa)
    models = llamacpp.prepare_models(root, a.only) if a.only or not a.files else {}
    for f in a.files or []:
        models[f.stem] = {"path": str(f.resolve()), "how": "given with --files",
                          **llamacpp.decode_bytes_per_token(f.resolve())}
    baseline_tree = a.baseline_tree.resolve() if a.baseline_tree else None
    bandwidth, bw_source = bandwidth_from(a, root)
    quiet = (a.quiet_cores, a.max_wait)
    report: dict[str, Any] = {
        "what": "vtool vs llama-bench, pp512 / tg128 t/s, same GGUF, same threads, own sched group at --nice",
        "threads": a.threads, "reps": a.reps, "rounds": a.rounds, "nice": a.nice,
        "llama_cpp": info["llama_cpp_commit"], "llama_cpp_isa": a.llamacpp_isa,
        "llama_cpp_build": {k: info.get(k) for k in ("isa", "configure", "compiler", "isa_check") if k in info},
        "llama_bench": str(binary.relative_to(root)), "vtool_target": {"given": a.target},
        "machine": {"cpu": llamacpp.cpu_name(), **llamacpp.cpu_info()},
        "bandwidth_gbs": bandwidth, "bandwidth_source": bw_source,
        "vtool_figures": "pp512: `prefill` entry; tg128: `decode` entry + host argmax; tg128_engine: Engine.step "
                         "(greedy host sampler, detokenizer)", "models": {}}
    for name, m in models.items():
        artifact = build_vtool(m["path"], a.target, a.activations[0])
        target_info = vtool_target_info(artifact, a.target)
        report["vtool_target"] = {k: v for k, v in target_info.items() if k != "model_so_instructions"}
        if a.llamacpp_isa == "avx2" and target_info["int8_isa"] not in ("avx2", None):
            log(f"warning: llama.cpp's avx2 build against vtool's {target_info['manifest_target']} "
                f"({target_info['int8_isa']} kernels); pass --target x86-avx2 for the like-for-like figure")
        others = {mode: build_vtool(m["path"], a.target, mode) for mode in a.activations[1:]}
        if baseline_tree:
            others["baseline"] = build_vtool(m["path"], a.target, a.activations[0], baseline_tree)
        repack: dict[str, bool | None] = {"pp512": None, "tg128": None}  # None: llama.cpp's default
        entry: dict[str, Any] = {**m, "vtool_artifact": str(artifact), "vtool_target": target_info, "vtool_runs": [],
                                 "activations": a.activations[0], "llama_runs": {"pp512": [], "tg128": []},
                                 "other_activations": {mode: [] for mode in others}}
        for r in range(a.rounds):
            run = run_worker(artifact, m["path"], a.threads, a.reps, a.nice, quiet, not a.no_engine)
            entry["vtool_runs"].append(run)
            for mode, other in others.items():  # the same file with other --activations, same round
                extra = run_worker(other, m["path"], a.threads, a.reps, a.nice, quiet, False,
                                   baseline_tree if mode == "baseline" else None)
                entry["other_activations"][mode].append(extra)
                res = extra["result"] or {}
                log(f"{name} round {r + 1}: vtool " + ("baseline tree" if mode == "baseline" else
                                                       f"--activations {mode}") + ": "
                    + ", ".join(f"{k} {mean(res[k]):.1f}" for k in ("pp512", "tg128") if k in res))
            res = run["result"] or {}
            log(f"{name} round {r + 1}: vtool " + (", ".join(f"{k} {mean(res[k]):.1f}" for k in
                                                             ("pp512", "tg128", "tg128_engine") if k in res)
                                                  or f"FAILED: {run.get('stderr_tail', '')[-400:]}")
                + f" (other load {run['other_load_cores_during']})")
            if a.vtool_only:
                continue
            for label, test in (("pp512", ["-p", str(N_PROMPT), "-n", "0"]), ("tg128", ["-p", "0", "-n", str(N_GEN)])):
                while True:
                    lr = llamacpp.llama_bench(binary, m["path"], test, a.threads, a.reps, repack[label], quiet, a.nice)
                    lr["setting"] = "default (repack on)" if repack[label] is None else "--repack 0"
                    entry["llama_runs"][label].append(lr)
                    log(f"{name} round {r + 1}: llama.cpp {label} [{lr['setting']}] "
                        + (f"{lr['rows'][0]['avg_ts']:.1f}" if lr["rows"] else f"FAILED (exit {lr['returncode']})")
                        + f" (other load {lr['other_load_cores_during']})")
                    if lr["rows"] or repack[label] is not None:
                        break
                    repack[label] = False  # llama.cpp's default failed: --repack 0 from here on
        best: dict[str, Any] = {}
        for key in ("pp512", "tg128", "tg128_engine"):
            vals = [(mean(run["result"][key]), run) for run in entry["vtool_runs"] if run["result"] and key in run["result"]]
            if vals:
                v, run = max(vals, key=lambda x: x[0])
                best[f"vtool_{key}"] = {"t_s": round(v, 2), "samples": run["result"][key],
                                        "other_load_cores_during": run["other_load_cores_during"]}
        for mode, runs in entry["other_activations"].items():
            for key in ("pp512", "tg128"):
                vals = [mean(run["result"][key]) for run in runs if run["result"] and key in run["result"]]
                if vals:
                    best[f"vtool@{mode}_{key}"] = {"t_s": round(max(vals), 2)}
        for key in ("pp512", "tg128"):
            vals = [(lr["rows"][0]["avg_ts"], lr) for lr in entry["llama_runs"][key] if lr["rows"]]
            if vals:
                v, lr = max(vals, key=lambda x: x[0])
                best[f"llama_{key}"] = {"t_s": round(v, 2), "stddev": round(lr["rows"][0]["stddev_ts"], 2),
                                        "command": lr["command"], "setting": lr.get("setting"),
                                        "other_load_cores_during": lr["other_load_cores_during"]}
        for key in ("pp512", "tg128", "tg128_engine"):
            lk = "llama_" + ("tg128" if key == "tg128_engine" else key)
            if f"vtool_{key}" in best and lk in best:
                best[f"ratio_{key}"] = round(best[f"vtool_{key}"]["t_s"] / best[lk]["t_s"], 3)
            for mode in entry["other_activations"]:
                if f"vtool@{mode}_{key}" in best and lk in best:
                    best[f"ratio@{mode}_{key}"] = round(best[f"vtool@{mode}_{key}"]["t_s"] / best[lk]["t_s"], 3)
        if bandwidth:
            best["tg_roofline_t_s"] = round(bandwidth * 1e9 / m["decode_weight_bytes_per_token"], 1)
        entry["best"] = best
        report["models"][name] = entry
        out = a.out or root / ("cpu_vs_llamacpp.json" if a.llamacpp_isa == "native" else
                               f"cpu_vs_llamacpp-{a.llamacpp_isa}.json")
        out.write_text(json.dumps(report, indent=2) + "\n")  # after every model: a partial run is kept

    print(f"vtool ({report['vtool_target'].get('manifest_target', a.target)}) vs llama.cpp "
          f"{info['llama_cpp_commit'][:10]} ({a.llamacpp_isa} build), -t {a.threads}, best of {a.rounds} rounds x "
          f"{a.reps} reps, nice {a.nice}; bandwidth {bandwidth} GB/s ({bw_source}); JSON: {out}")
    hdr = (f"{'model':<18} {'MB/tok':>6} {'roof':>6} | {'pp512 vt':>8} {'llama':>7} {'ratio':>5} | "
           f"{'tg128 vt':>8} {'engine':>6} {'llama':>6} {'ratio':>5} {'eng/l':>5} {'%roof':>5}")
    print(hdr)
    for name, e in report["models"].items():
        b = e["best"]
        g = lambda k: b.get(k, {}).get("t_s", float("nan"))  # noqa: E731
        roof = b.get("tg_roofline_t_s", float("nan"))
        print(f"{name:<18} {e['decode_weight_bytes_per_token'] / 1e6:>6.1f} {roof:>6.0f} | "
              f"{g('vtool_pp512'):>8.1f} {g('llama_pp512'):>7.1f} {b.get('ratio_pp512', float('nan')):>5.2f} | "
              f"{g('vtool_tg128'):>8.1f} {g('vtool_tg128_engine'):>6.1f} {g('llama_tg128'):>6.1f} "
              f"{b.get('ratio_tg128', float('nan')):>5.2f} {b.get('ratio_tg128_engine', float('nan')):>5.2f} "
              f"{100 * g('vtool_tg128') / roof:>5.0f}")
    for name, e in report["models"].items():
        for mode in e.get("other_activations", {}):
            b = e["best"]
            label = "baseline tree" if mode == "baseline" else f"--activations {mode}"
            print(f"{name:<18} {label}: pp512 {b.get(f'vtool@{mode}_pp512', {}).get('t_s', float('nan')):.1f}"
                  f" ({b.get(f'ratio@{mode}_pp512', float('nan')):.2f}x), tg128 "
                  f"{b.get(f'vtool@{mode}_tg128', {}).get('t_s', float('nan')):.1f}"
                  f" ({b.get(f'ratio@{mode}_tg128', float('nan')):.2f}x)")
    for name, e in report["models"].items():
        for key in ("pp512", "tg128"):
            setting = e["best"].get(f"llama_{key}", {}).get("setting")
            if setting and setting != "default (repack on)":
                print(f"{name:<18} llama.cpp {key} ran with {setting} (llama.cpp's default failed: see llama_runs)")
    print("ratio = vtool / llama.cpp (t/s); roof = decode roofline t/s (bandwidth / weight bytes per token); "
          "%roof = vtool tg128 / roofline")


if __name__ == "__main__":
    main()
