"""Tuned against rule-only builds of one model, side by side in one run.

    python tests/bench/tuned_vs_rules.py [--records DIR] [--target x86-avx2] [--quantization none]
                                         [--prompt-len 128] [--decode-tokens 32] [--rounds 3] [--profile]
                                         [--json OUT]

Builds the model twice, once with no tuning records and once with the records under
--records (default: the package's tuning_logs/), then
1. per kernel that a record applies to: the rule schedule and the tuned kernel (for a
   bucketed kernel, the dispatch as built) timed at each bucket's sizes, interleaved;
2. with --profile: the rule build's kernel time per call site in one prefill of
   --prompt-len tokens and in one decode step (the Relax VM's instrument hook), which is
   how the kernels worth tuning were chosen;
3. end to end: prefill tok/s (a --prompt-len prompt: set it to a bucket to exercise the
   tuned prefill kernels) and greedy decode tok/s, the two builds alternating per round;
   the tokens of both builds must agree.
Not a test: the figures go in docs/BENCHMARKS.md with the command and the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def kernel_times(model: Path, target_name: str, root: Path, quantization: str, reps: int = 3) -> list[dict]:
    """[{kernel, bucket, rule_us, tuned_us, applied}] for every bucket of every record of
    the model's kernels (applied or not): the symbolic rule kernel called at the bucket's
    sizes (what the build runs without the record) against the kernel as a build with the
    record runs it at those sizes (the dispatch, for an applied bucket; else the trace on
    the kernel specialized to the bucket), best of `reps` interleaved timings each."""
    import tvm

    from vtool.toolchain.records import apply_trace, dispatch, kernel_hash, read_record, specialize
    from vtool.toolchain.tune import extract_kernels, rule_schedule
    from vtool.toolchain.tune_measure import time_kernel

    spec, target, mod = extract_kernels(model, target_name, quantization=quantization)
    records = {}
    for path in sorted((root / spec.name).glob("*.json")):
        rec = read_record(path)
        records[rec.hash] = rec
    rows = []
    for gv, func in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint):
        if not isinstance(func, tvm.tirx.PrimFunc) or (rec := records.get(kernel_hash(func))) is None:
            continue
        rule = rule_schedule(func, target, spec.family, gv.name_hint)
        for b in rec.buckets:
            if b.trace is None:
                continue
            tuned = apply_trace(specialize(func, b.bindings), b.trace)
            if b.use and b.bindings:
                tuned = dispatch(func, rule, [(b.bindings, tuned)])
            pairs = [(time_kernel(rule, target, b.bindings), time_kernel(tuned, target, b.bindings)) for _ in range(reps)]
            rows.append({"kernel": gv.name_hint, "bucket": b.bindings, "applied": b.use, "trials": b.trials,
                         "rule_us": min(p[0] for p in pairs), "tuned_us": min(p[1] for p in pairs)})
    return rows


def profile(model, prompt: list[int], steps: int = 8) -> dict[str, dict[str, float]]:
    """Seconds per kernel (summed over its call sites) in one prefill of `prompt`, and in one
    decode step (the mean over `steps` steps), from the VM's instrument hook."""
    import tvm_ffi

    from vtool.runtime.engine.generate import Generator
    from vtool.runtime.sampling.params import SamplingParams

    totals: dict[str, float] = defaultdict(float)
    starts: dict[str, float] = {}
    on = {"recording": True}

    def instrument(_func, name, before, _ret, *_args):  # noqa: ANN001 - the VM's instrument protocol
        if not on["recording"]:
            return 0
        if before:
            starts[name] = time.perf_counter()
        elif name in starts:
            totals[name] += time.perf_counter() - starts.pop(name)
        return 0

    gen = Generator(model, max_model_len=len(prompt) + steps + 8)
    gen.generate(prompt, SamplingParams(temperature=0, max_tokens=2))  # warm-up
    model.vm["set_instrument"](tvm_ffi.convert(instrument))
    try:
        gen.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
        phases = {"prefill": dict(totals)}
        totals.clear()
        on["recording"] = False  # from the first token on: decode steps only

        def start(_token: int) -> None:
            on["recording"] = True

        gen.generate(prompt, SamplingParams(temperature=0, max_tokens=1 + steps), on_token=start)
        phases["decode step"] = {k: v / steps for k, v in totals.items()}
    finally:
        model.vm["set_instrument"](None)
    return phases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=Path, default=None, help="records root (default: the package's tuning_logs)")
    ap.add_argument("--target", default="x86-avx2")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M Q4_1 GGUF")
    ap.add_argument("--quantization", default="auto", help="as vtool build's (none: float32 NT-matmuls)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from vtool.toolchain.tune import same_threads_as_runtime

    same_threads_as_runtime()  # the kernel timings below on the runtime's thread count
    import numpy as np

    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.runtime.weights.default_model import default_model_path
    from vtool.runtime.engine.generate import Generator
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.toolchain import records as rec_mod
    from vtool.toolchain.build import build_artifact

    path = Path(args.model) if args.model else default_model_path()
    root = args.records or rec_mod.records_root()
    ckpt = open_checkpoint(path)
    with tempfile.TemporaryDirectory() as empty:
        os.environ[rec_mod.ENV_ROOT] = empty
        rules_dir = build_artifact(path, args.target, checkpoint=ckpt, quantization=args.quantization)
        os.environ[rec_mod.ENV_ROOT] = str(root)
        tuned_dir = build_artifact(path, args.target, checkpoint=ckpt, quantization=args.quantization)
    report: dict = {"target": args.target, "model": path.name, "quantization": args.quantization,
                    "prompt_len": args.prompt_len,
                    "tuning": json.loads((tuned_dir / "manifest.json").read_text())["build"]["tuning"]}
    t = report["tuning"]
    print(f"tuned build: {t['from_records']} kernels from records, {t['from_rules']} from rules; "
          f"applied {t['applied']}")
    if t["ignored"]:
        print("ignored records:", *t["ignored"], sep="\n  ")

    report["kernels"] = kernel_times(path, args.target, root, args.quantization)
    print(f"\n{'kernel':32} {'bucket':>15} {'trials':>6} {'rule us':>10} {'tuned us':>10} {'speedup':>8} applied")
    for r in report["kernels"]:
        b = ",".join(f"{k}={v}" for k, v in r["bucket"].items()) or "static"
        print(f"{r['kernel']:32} {b:>15} {r['trials']:6d} {r['rule_us']:10.1f} {r['tuned_us']:10.1f} "
              f"{r['rule_us'] / r['tuned_us']:8.2f} {'yes' if r['applied'] else 'no'}")

    vocab = CompiledModel(rules_dir, ckpt).vocab_size
    prompt = [int(x) for x in np.random.default_rng(0).integers(10, vocab - 10, size=args.prompt_len)]
    models = {"rules": CompiledModel(rules_dir, ckpt), "tuned": CompiledModel(tuned_dir, ckpt)}
    if args.profile:
        report["profile"] = profile(models["rules"], prompt)
        for phase, times in report["profile"].items():
            total = sum(times.values())
            print(f"\nrules build, {phase}: {total * 1e3:.2f} ms in kernels")
            for name, sec in sorted(times.items(), key=lambda kv: -kv[1])[:12]:
                print(f"  {name:44} {sec * 1e3:8.3f} ms {100 * sec / total:5.1f}%")

    gens = {k: Generator(m, max_model_len=args.prompt_len + args.decode_tokens + 8) for k, m in models.items()}
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens)
    tokens = {k: g.generate(prompt, params).token_ids for k, g in gens.items()}  # warm-up
    assert tokens["rules"] == tokens["tuned"], "tuned and rule builds generate different tokens"
    runs: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in gens}
    for _ in range(args.rounds):
        for k, g in gens.items():
            out = g.generate(prompt, params)
            runs[k]["prefill"].append(args.prompt_len / out.prefill_seconds)
            runs[k]["decode"].append(out.decode_tokens_per_second)
    report["end_to_end"] = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in runs.items()}
    print(f"\n{'build':8} {'prefill tok/s':>14} {'decode tok/s':>13}   (median of {args.rounds}, "
          f"{args.prompt_len}-token prompt, {args.decode_tokens} tokens)")
    for k, r in report["end_to_end"].items():
        print(f"{k:8} {r['prefill']:14.1f} {r['decode']:13.1f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
