"""Whole-step decode A/B of several artifacts of one model, alternating in one process (CPU):
on a 2-thread pool a kernel timed alone does not predict the step (a one-thread decode
attention was 4x faster alone and made the step slower), and across processes this host's
noise hides a few percent.

    python tests/bench/decode_ab.py --model FILE.gguf --rounds 40 [--steps 128] [--prompt N] ARTIFACT [ARTIFACT ...]

Each round decodes `--steps` tokens from a fresh sequence on every artifact (order reversed
every other round); prints each artifact's median ms a step and the median of its per-round
ratio to the first artifact (> 1: slower). --prompt N: time one N-token prefill of a fresh
sequence instead (the `prefill` entry point, N at most one prefill chunk), ms per prompt.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=0, help="time an N-token prefill instead of decode steps")
    a = ap.parse_args()
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint

    sessions = [open_session(art, open_checkpoint(a.model), max_model_len=max(a.steps, a.prompt) + 32)
                for art in a.artifacts]
    prompt = np.random.default_rng(0).integers(1000, 20000, a.prompt).tolist()

    def ms_per_step(gen) -> float:  # noqa: ANN001
        if a.prompt:
            gen._fresh_sequence(a.prompt + 2)
            t = time.perf_counter()
            gen._forward("prefill", prompt)
            return (time.perf_counter() - t) * 1e3
        gen._fresh_sequence(a.steps + 2)
        token, t = 1000, time.perf_counter()
        for _ in range(a.steps):
            token = int(np.argmax(gen._forward("decode", [token])))
        return (time.perf_counter() - t) / a.steps * 1e3

    for s in sessions:
        ms_per_step(s.generator)
    times: list[list[float]] = [[] for _ in sessions]
    for r in range(a.rounds):
        order = range(len(sessions)) if r % 2 == 0 else reversed(range(len(sessions)))
        for i in order:
            times[i].append(ms_per_step(sessions[i].generator))
    for art, ts in zip(a.artifacts, times):
        ratio = statistics.median(t / t0 for t, t0 in zip(ts, times[0]))
        print(f"{art.name:>24}  median {statistics.median(ts):.3f} ms  min {min(ts):.3f}  ratio to first {ratio:.3f}")


if __name__ == "__main__":
    main()
