"""Decode through the engine against the model step, in one process, alternating (CPU): the
figure issue 16 asks to be within 5% (`vtool run --repeat`'s engine: scheduler, sampler,
output path), without the cross-process noise that hides a few percent on a 2-core host.

    python tests/bench/engine_vs_step.py --artifact DIR --model FILE.gguf [--rounds 40] [--steps 128]
                                         [--with-logsumexp]

Each round times `--steps` model decode steps (the `decode` entry plus a host argmax, as
cpu_vs_llamacpp.py's tg128), then the same number of greedy engine steps of one request.
--with-logsumexp adds a third column: the engine with the per-step logsumexp that the sampler
computed for `cumulative_logprob` before it was skipped for requests without logprobs.
Prints one JSON line per round (t/s) and a summary (medians of the per-round ratios).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", required=True, type=Path)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--with-logsumexp", action="store_true")
    a = ap.parse_args()
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.sampling import host
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint

    n = a.steps
    session = open_session(a.artifact, open_checkpoint(a.model), max_model_len=n + 32)
    gen = session.generator
    engine = Engine(session, EngineConfig(max_num_seqs=1, enable_prefix_caching=False, max_model_len=n + 32))
    params = SamplingParams(temperature=0.0, max_tokens=n + 1, ignore_eos=True)
    current = host.raw_logprobs

    def with_logsumexp(raw, raw_max, token, num, s, lse=None):  # noqa: ANN001, ANN202 - the old behaviour
        if num is None:
            lse = host._raw_logsumexp(raw, raw_max, s) if lse is None else lse
            return host.SampleResult(token, float(raw[token]) - lse)
        return current(raw, raw_max, token, num, s, lse)

    def model_steps() -> float:
        gen._fresh_sequence(n + 1)
        token, t = 1000, time.perf_counter()
        for _ in range(n):
            token = int(np.argmax(gen._forward("decode", [token])))
        return n / (time.perf_counter() - t)

    count = 0

    def engine_steps(raw_logprobs) -> float:  # noqa: ANN001
        nonlocal count
        count += 1
        host.raw_logprobs = raw_logprobs
        try:
            engine.add_request(f"r{count}", [1000], params)
            first = last = None
            while engine.has_unfinished():
                for _ in engine.step():
                    last = time.perf_counter()
                    first = first or last
        finally:
            host.raw_logprobs = current
        return n / (last - first)  # the first token is the prompt's: n decode steps follow it

    variants = {"model": model_steps, "engine": lambda: engine_steps(current)}
    if a.with_logsumexp:
        variants["engine_with_logsumexp"] = lambda: engine_steps(with_logsumexp)
    for fn in variants.values():  # warm-up
        fn()
    rows = []
    for _ in range(a.rounds):
        rows.append({k: round(fn(), 1) for k, fn in variants.items()})
        print(json.dumps(rows[-1]), flush=True)
    m = np.array([r["model"] for r in rows])
    summary = {f"median_{k}_over_model": round(float(np.median(np.array([r[k] for r in rows]) / m)), 3)
               for k in variants if k != "model"}
    summary.update({f"median_{k}_tok_s": float(np.median([r[k] for r in rows])) for k in variants})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
