"""Structured output's cost per decode step (issue 14's target: <= 10% of the step at batch 32):
the same engine, the same batch of requests, decoding with and without a JSON-schema grammar.

    python tests/bench/grammar_overhead.py --artifact ART --model CHECKPOINT [--batch 32] [--tokens 96]
    python tests/bench/grammar_overhead.py --model DIR            # the host: built (cached) for this CPU

The grammar is a JSON array of at least 64 small integers, so no request ends early, few tokens
are forced (jump-forward is off: the point is the per-step price of masking) and every step
masks the whole batch. The modes alternate for --rounds rounds (default 2): the faster run of
each mode counts (warm caches, compiled grammar in the cache) for `overhead`, and each round's
grammar run over its free run gives `round_overheads` and their median (on a shared GPU host
the free step itself moves by up to 10% between rounds). Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

from llamacpp import cpu_name  # tests/bench: the script's folder is on sys.path

# minItems: the array cannot close within --tokens (a random model would close it at once)
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 64}


def run(engine, prompt: list[int], batch: int, tokens: int, grammar: dict | None,  # noqa: ANN001
        profile: bool = False) -> dict:
    from vtool.runtime.sampling.params import SamplingParams

    for i in range(batch):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                                           structured_outputs=grammar))
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step_core():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    while any(r.num_computed < len(r.prompt_ids) for r in engine.requests.values()) or engine.grammar.has_pending:
        step()  # prefill (and compile) apart from the timed decode steps
    steps = 0
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        step()
        steps += 1
    seconds = time.perf_counter() - t0
    if profiler is not None:
        import pstats

        profiler.disable()
        print(f"--- {'json_schema' if grammar else 'free'}: {steps} steps, host time by function (tottime)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
    texts = [engine.tokenizer.decode(t) for t in tokens.values()]
    if grammar is not None:  # the grammar did constrain them: a JSON array of integers, cut by max_tokens
        bad = [t for t in texts if not re.fullmatch(r"\[(\d+(,\d+)*,?)?\]?", t.replace(" ", ""))]
        if bad:
            raise SystemExit(f"{len(bad)} outputs are not the grammar's: {bad[0]!r}")
    return {"steps": steps, "ms_per_step": 1e3 * seconds / max(steps, 1), "sample": texts[0][:40]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, type=Path, help="checkpoint folder (tokenizer, weights)")
    ap.add_argument("--artifact", type=Path, help="a built library (default: build for the host)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--device-sampling", choices=["on", "off"], default="on")
    ap.add_argument("--rounds", type=int, default=2,
                    help="free and grammar runs alternate this many times; best of each, and each round's ratio")
    ap.add_argument("--profile", action="store_true", help="a third run of each mode under cProfile (not timed)")
    a = ap.parse_args()
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.sampling.grammar import GrammarSpec, spec_fields
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint

    artifact = a.artifact
    if artifact is None:
        from vtool.toolchain.build import build_artifact

        artifact = build_artifact(a.model, "host", "float32")
    session = open_session(artifact, open_checkpoint(a.model), None, 1024)
    engine = Engine(session, EngineConfig(max_num_seqs=a.batch, max_num_batched_tokens=8192,
                                          grammar_jump_forward=False, device_sampling=a.device_sampling == "on"))
    engine.prepare_grammar()
    prompt = session.tokenizer.encode("List some numbers as a JSON array:", add_special_tokens=True)
    grammar = spec_fields(GrammarSpec.json_schema(SCHEMA, any_whitespace=False))
    best: dict[str, dict] = {}
    ratios = []  # per round: the grammar run over the free run just before it
    for _ in range(a.rounds):
        times = {}
        for name, g in (("free", None), ("json_schema", grammar)):
            r = run(engine, prompt, a.batch, a.tokens, g)
            times[name] = r["ms_per_step"]
            if name not in best or r["ms_per_step"] < best[name]["ms_per_step"]:
                best[name] = r
        ratios.append(times["json_schema"] / times["free"] - 1)
    if a.profile:
        for g in (None, grammar):
            run(engine, prompt, a.batch, a.tokens, g, profile=True)
    on_gpu = bool(getattr(session.model, "on_gpu", False))
    device_sampler = engine.device_sampler
    masks_on_device = bool(device_sampler is not None and getattr(device_sampler, "masks_supported", False))
    overhead = best["json_schema"]["ms_per_step"] / best["free"]["ms_per_step"] - 1
    print(json.dumps({"bench": "grammar_overhead", "device": "gpu" if on_gpu else "cpu", "cpu": cpu_name(),
                      "batch": a.batch, "tokens": a.tokens, "masks_on_device": masks_on_device, **{
                          f"{k}_ms_per_step": round(v["ms_per_step"], 3) for k, v in best.items()},
                      "sample_output": best["json_schema"]["sample"],
                      "overhead": round(overhead, 4), "round_overheads": [round(r, 4) for r in ratios],
                      "median_round_overhead": round(statistics.median(ratios), 4)}))


if __name__ == "__main__":
    main()
