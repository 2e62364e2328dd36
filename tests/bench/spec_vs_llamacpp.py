"""Speculative decoding on the CPU, vtool against llama.cpp's own: the Qwen2.5-Coder-1.5B-Instruct
Q4_K_M target with the 0.5B-Instruct Q4_K_M draft (tests/bench/coder_pair.py), greedy, on
copy-heavy prompts (where a draft or n-gram lookup should be accepted most).

    python tests/bench/spec_vs_llamacpp.py [--dir /tmp/coder-pair] [--k 4,8] [--num-prompts 2]
        [--max-tokens 128] [--threads 2] [--rounds 3] [--nice -10] [--vtool] [--no-llamacpp]
        [--result-json out.json]

llama.cpp: `llama-server` (tests/bench/llamacpp.py, built from the llama-cpp-python sdist) with
the target, `-t T -c 4096 -np 1`, once without a draft and once per K with
`--model-draft <0.5B> --spec-type draft-simple --spec-draft-n-max K --spec-draft-n-min 0`
(this build removed --draft-max/--draft-min, and a plain --model-draft without --spec-type
drafts nothing). Each prompt goes to /completion (temperature 0, ignore_eos, no prompt cache)
after one warm-up request; the figures are llama-server's own `timings`: predicted_per_second
(decode only), draft_n / draft_n_accepted, plus end-to-end tokens / client wall seconds.
llama.cpp's defaults otherwise (tests/bench/llamacpp.py falls back to --no-repack where weight
repacking crashes the server, as on an AMX Xeon; the JSON says which ran).

Each prompt runs --rounds times per configuration and the fastest is kept (the machine may be
shared: other load only slows a run down); --nice puts each peer in a scheduling group of its own.

--vtool: vtool's offline API on the same prompts, `LLM(model, max_model_len=4096,
speculative_config=None | draft | ngram)`, `generate([prompt], SamplingParams(temperature=0,
max_tokens, ignore_eos=True))` timed after one warm-up call; tok/s = generated tokens / wall
seconds (prefill included: compare with llama.cpp's end-to-end column). A speculative_config the
API does not take yet is reported and skipped.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import coder_pair  # noqa: E402
import llamacpp  # noqa: E402
from membw import own_sched_group, wait_quiet  # noqa: E402
from serve_vs_llama_server import OtherLoad, cpu_info  # noqa: E402

CTX = 4096


def chat(user: str) -> str:
    """Qwen2.5's ChatML written out: both peers get the same text, neither's template code."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


CODE = '''def summarize_orders(orders, tax_rate=0.08, discount_codes=None):
    """Return per-customer totals, the grand total and the largest order."""
    discount_codes = discount_codes or {}
    per_customer = {}
    total = 0.0
    largest = None
    for order in orders:
        customer = order["customer"]
        subtotal = 0.0
        for item in order["items"]:
            price = item["price"] * item.get("quantity", 1)
            if item.get("taxable", True):
                price += price * tax_rate
            subtotal += price
        code = order.get("discount_code")
        if code in discount_codes:
            subtotal -= subtotal * discount_codes[code]
        subtotal = round(subtotal, 2)
        per_customer[customer] = per_customer.get(customer, 0.0) + subtotal
        total += subtotal
        if largest is None or subtotal > largest[1]:
            largest = (order["id"], subtotal)
    if total < 0:
        raise ValueError("negative total: check the discount codes")
    average = total / len(orders) if orders else 0.0
    report = {
        "customers": len(per_customer),
        "per_customer": per_customer,
        "total": round(total, 2),
        "average": round(average, 2),
        "largest": largest,
    }
    for customer, amount in sorted(per_customer.items()):
        share = amount / total if total else 0.0
        report.setdefault("shares", {})[customer] = round(share, 4)
    return report
'''

PARAGRAPH = (
    "The lighthouse at the end of the northern pier was built in 1874 from granite quarried on the "
    "island itself. For more than a century its keepers climbed the one hundred and twelve steps "
    "twice each night to wind the clockwork that turned the lens, and they recorded every passing "
    "ship, every storm and every change of the wind in a leather-bound logbook that is now kept in "
    "the town museum. In 1962 the light was electrified and the last keeper, a retired fisherman "
    "named Tomas Ekberg, moved into the village, where he repaired nets and told visitors that the "
    "sea had never once been the same colour two days in a row. The tower was restored in 2009 "
    "with money raised by the islanders, who sold postcards, knitted scarves and jars of cloudberry "
    "jam at the summer market until the last of the scaffolding came down."
)

# Copy-heavy: the answer repeats long stretches of the prompt (the first --num-prompts are used).
PROMPTS: list[str] = [
    chat(f"Here is a Python function:\n\n{CODE}\nRewrite the function above exactly, but rename the "
         "variable `total` to `acc`. Output only the code."),
    chat(f"Repeat the following text verbatim:\n\n{PARAGRAPH}\n"),
    chat(f"Here is a Python function:\n\n{CODE}\nAdd a type hint to every parameter and to the return "
         "value of the function above; change nothing else. Output only the code."),
]


def log(msg: str) -> None:
    print(f"[spec_vs_llamacpp] {msg}", file=sys.stderr, flush=True)


def prioritize(pid: int, nice: int) -> None:
    """Sets the nice of `pid`'s session (its autogroup: with autogroup scheduling the kernel shares
    the CPU between sessions first), so that other sessions' jobs on a shared 2-core machine take
    less from the peer being measured. Negative values need root."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError as e:
        log(f"could not set the autogroup nice of {pid} to {nice}: {e}")


def best_of(prompts: list[str], rounds: int, run: Any) -> list[dict[str, Any]]:
    """`run(i, prompt)` `rounds` times per prompt, keeping the fastest (on a shared machine other
    load can only slow a run down); every round's tok/s is kept beside it."""
    rows = []
    for i, prompt in enumerate(prompts):
        tries = [run(i, prompt) for _ in range(rounds)]
        secs = [t["decode_ms"] / 1000 if "decode_ms" in t else t["wall_s"] for t in tries]
        best = min(range(rounds), key=lambda j: secs[j])
        rows.append(tries[best] | {"round_tok_s": [round(t["tokens"] / s, 2) for t, s in zip(tries, secs)]})
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Token-weighted figures over the prompts (sums, not a mean of rates)."""
    n = sum(r["tokens"] for r in rows)
    out: dict[str, Any] = {"tokens": n, "e2e_tok_s": round(n / sum(r["wall_s"] for r in rows), 2)}
    if all("decode_ms" in r for r in rows):
        out["decode_tok_s"] = round(n / sum(r["decode_ms"] for r in rows) * 1000, 2)
    drafted = sum(r.get("draft_n", 0) for r in rows)
    if drafted:
        accepted = sum(r.get("draft_n_accepted", 0) for r in rows)
        out |= {"draft_n": drafted, "draft_n_accepted": accepted, "acceptance": round(accepted / drafted, 3)}
    return out


# ----------------------------------------------------------------------------- llama.cpp

def llamacpp_runs(target: Path, draft: Path, prompts: list[str], ks: list[int], a: argparse.Namespace
                  ) -> list[dict[str, Any]]:
    import httpx

    binary = llamacpp.build_llama_server()
    configs = [("no draft", ())] + [
        (f"draft K={k}", ("--model-draft", str(draft), "--spec-type", "draft-simple",
                          "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0")) for k in ks]
    results = []
    for name, extra in configs:
        with llamacpp.llama_server(target, parallel=1, threads=a.threads, ctx_size=CTX, binary=binary,
                                   extra=extra) as srv:
            if a.nice:
                prioritize(srv["pid"], a.nice)  # the server runs in a session of its own

            def complete(prompt: str, n: int) -> tuple[dict[str, Any], float]:
                body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True,
                        "cache_prompt": False, "return_tokens": True}
                t = time.perf_counter()
                r = httpx.post(srv["url"] + "/completion", json=body, timeout=1800)
                r.raise_for_status()
                return r.json(), time.perf_counter() - t

            complete(prompts[0], 16)  # warm-up: first-touch of the mapped weights, thread pool
            before = wait_quiet(a.quiet_cores, a.max_wait)

            def one(i: int, prompt: str) -> dict[str, Any]:
                resp, wall = complete(prompt, a.max_tokens)
                tm = resp["timings"]
                log(f"llama.cpp {name}, prompt {i}: {tm['predicted_per_second']:.2f} tok/s decode, "
                    f"{tm.get('draft_n_accepted', '-')}/{tm.get('draft_n', '-')} drafts accepted")
                return {"prompt": i, "prompt_tokens": tm["prompt_n"], "tokens": tm["predicted_n"],
                        "wall_s": round(wall, 3), "decode_ms": tm["predicted_ms"],
                        "predicted_per_second": round(tm["predicted_per_second"], 2),
                        **{k: tm[k] for k in ("draft_n", "draft_n_accepted") if k in tm},
                        "token_ids": resp.get("tokens", []), "text": resp["content"]}

            with OtherLoad(srv["pid"]) as load:
                rows = best_of(prompts, a.rounds, one)
        results.append({"peer": "llama.cpp", "config": name, "command": srv["command"], "repack": srv["repack"],
                        "other_load_cores_before": before, "other_load_cores": load.cores,
                        "server_cores": load.server_cores, **summarize(rows), "prompts": rows})
    return results


# ----------------------------------------------------------------------------- vtool

def vtool_runs(target: Path, draft: Path, prompts: list[str], ks: list[int], a: argparse.Namespace
               ) -> list[dict[str, Any]]:
    os.environ.setdefault("VTOOL_CPU_THREADS", str(a.threads))  # read when the runtime starts
    if a.nice:
        own_sched_group(a.nice)  # vtool runs in this process: its own session at that nice
    from vtool import LLM, SamplingParams

    configs: list[tuple[str, dict[str, Any] | None]] = [("no draft", None)]
    for k in ks:
        configs.append((f"draft K={k}", {"model": str(draft), "num_speculative_tokens": k}))
        configs.append((f"ngram K={k}", {"method": "ngram", "num_speculative_tokens": k,
                                         "prompt_lookup_max": 4, "prompt_lookup_min": 2}))
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    results = []
    for name, spec in configs:
        try:
            t = time.perf_counter()
            # only pass speculative_config when set: the plain run must work before the API takes it
            llm = LLM(model=str(target), max_model_len=CTX, **({"speculative_config": spec} if spec else {}))
            load_s = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - whatever the API says today about an unknown config
            if spec is None:
                raise
            print(f"vtool {name}: speculative_config not accepted ({type(e).__name__}: {e}); skipped")
            results.append({"peer": "vtool", "config": name, "skipped": f"{type(e).__name__}: {e}"})
            continue
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # warm-up
        before = wait_quiet(a.quiet_cores, a.max_wait)

        def one(i: int, prompt: str) -> dict[str, Any]:
            t = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            wall = time.perf_counter() - t
            ids = list(out.outputs[0].token_ids)
            log(f"vtool {name}, prompt {i}: {len(ids) / wall:.2f} tok/s")
            return {"prompt": i, "prompt_tokens": len(out.prompt_token_ids), "tokens": len(ids),
                    "wall_s": round(wall, 3), "token_ids": ids, "text": out.outputs[0].text}

        rows = best_of(prompts, a.rounds, one)
        results.append({"peer": "vtool", "config": name, "speculative_config": spec, "load_s": round(load_s, 1),
                        "other_load_cores_before": before, **summarize(rows), "prompts": rows})
        llm = None  # one model in memory at a time
        gc.collect()
    return results


# ----------------------------------------------------------------------------- report

def same_tokens(results: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per run, how many leading tokens equal the first run's on each prompt (greedy: speculation
    must not change the output; across peers numerics may)."""
    runs = [r for r in results if "prompts" in r]
    if not runs:
        return {}
    ref = runs[0]["prompts"]

    def common(x: list[int], y: list[int]) -> int:
        return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))

    return {f"{r['peer']} {r['config']}": [common(p["token_ids"], q["token_ids"]) for p, q in zip(r["prompts"], ref)]
            for r in runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/coder-pair"), help="where coder_pair.py puts the pair")
    ap.add_argument("--k", default="4", help="draft lengths, comma-separated (llama.cpp --spec-draft-n-max, "
                                             "vtool num_speculative_tokens)")
    ap.add_argument("--num-prompts", type=int, default=2, choices=range(1, len(PROMPTS) + 1))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each prompt per configuration; fastest kept")
    ap.add_argument("--vtool", action="store_true", help="also measure vtool's offline API")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp")
    ap.add_argument("--quiet-cores", type=float, default=0.3,
                    help="before each measured run wait until other processes use at most this many cores")
    ap.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for that, at most")
    ap.add_argument("--nice", type=int, default=0,
                    help="run each peer in a scheduling group of its own at this nice (e.g. -10, root), "
                         "against other sessions' jobs on a shared machine; 0: leave as is")
    ap.add_argument("--result-json", type=Path)
    a = ap.parse_args()
    ks = [int(k) for k in a.k.split(",")]
    prompts = PROMPTS[:a.num_prompts]
    target, draft = coder_pair.fetch_target(a.dir), coder_pair.fetch_draft(a.dir)

    results = [] if a.no_llamacpp else llamacpp_runs(target, draft, prompts, ks, a)
    if a.vtool:
        results += vtool_runs(target, draft, prompts, ks, a)

    cpu = cpu_info()
    flags = {f: f in cpu["flags"] for f in ("avx2", "avx512f", "avx512_vnni")}
    result = {
        "what": "greedy decode of copy-heavy prompts, Qwen2.5-Coder-1.5B-Instruct Q4_K_M target, "
                "0.5B-Instruct Q4_K_M draft; llama.cpp figures are llama-server's own timings",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": {"model_name": cpu["model_name"], "cores": cpu["cores"], **flags},
        "threads": a.threads, "nice": a.nice, "rounds": a.rounds, "max_tokens": a.max_tokens, "ks": ks,
        "prompts": prompts,
        "target": {"file": target.name, "sha256": coder_pair.TARGET.sha256},
        "draft": {"file": draft.name, "sha256": coder_pair.DRAFT.sha256},
        "llama_cpp_build": llamacpp.llama_server_record() if not a.no_llamacpp else None,
        "same_leading_tokens_as_first_run": same_tokens(results),
        "runs": results,
    }
    print(f"CPU: {cpu['model_name']} ({cpu['cores']} cores; "
          + ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in flags.items())
          + f"), -t {a.threads}, nice {a.nice}, {len(prompts)} prompts x {a.max_tokens} tokens, "
          f"greedy, best of {a.rounds} rounds")
    print(f"{'peer':<10} {'config':<12} {'decode tok/s':>12} {'e2e tok/s':>10} {'accepted':>14} {'x no draft':>10}")
    base: dict[str, float] = {}
    for r in results:
        if "skipped" in r:
            print(f"{r['peer']:<10} {r['config']:<12} skipped: {r['skipped']}")
            continue
        key = "decode_tok_s" if "decode_tok_s" in r else "e2e_tok_s"
        base.setdefault(r["peer"], r[key])  # each peer's first run is its no-draft run
        acc = f"{r['draft_n_accepted']}/{r['draft_n']} {r['acceptance']:.0%}" if "draft_n" in r else "-"
        decode = f"{r['decode_tok_s']:.2f}" if "decode_tok_s" in r else "-"
        print(f"{r['peer']:<10} {r['config']:<12} {decode:>12} "
              f"{r['e2e_tok_s']:>10.2f} {acc:>14} {r[key] / base[r['peer']]:>10.2f}")
    print("leading tokens equal to the first run's, per prompt:",
          json.dumps(result["same_leading_tokens_as_first_run"]))
    if a.result_json:
        a.result_json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"JSON: {a.result_json}")


if __name__ == "__main__":
    main()
