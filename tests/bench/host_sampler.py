"""The host sampler (runtime/sampling/host.py sample_batch): milliseconds per step by kind of
request, and the same with a temperature-1 row copied before it is read (as before the copy was
skipped), in one run.

    python tests/bench/host_sampler.py [--vocab 49152,151936] [--batch 8,64] [--repeats 10]

Each request kind (greedy, greedy with a repetition penalty, temperature 1, temperature 0.7 with
top_p 0.95, temperature 1 with 5 logprobs, frequency/presence penalties, top_k 40) is a batch of
that many identical requests with a 200-token prompt and 50 generated tokens of history; the
logits are a real-looking row shape (a few tokens far above a normal bulk). Prints one JSON line
per (vocab, batch, kind): ms per step, best of --repeats, now and with the copy, and whether both
drew the same tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

KINDS = {
    "greedy": dict(temperature=0.0),
    "greedy+repetition": dict(temperature=0.0, repetition_penalty=1.1),
    "t1": dict(temperature=1.0),
    "t0.7 top_p 0.95": dict(temperature=0.7, top_p=0.95),
    "t1 logprobs 5": dict(temperature=1.0, logprobs=5),
    "t0.8 freq+presence": dict(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.3),
    "t0.8 top_k 40": dict(temperature=0.8, top_k=40),
}


def _logits(rng: np.random.Generator, batch: int, vocab: int) -> np.ndarray:
    x = rng.standard_normal((batch, vocab), dtype=np.float32) * 2.0
    for row in x:  # a handful of likely tokens, as a trained model's rows have
        row[rng.integers(0, vocab, 8)] += rng.uniform(6, 14, 8).astype(np.float32)
    return x


def _copying(raw, raw_max, p, s):  # noqa: ANN001, ANN202 - _scaled_copy before T = 1 skipped the copy
    t = np.float32(p.sampling_temperature)
    return np.divide(raw, t, out=s.x), raw_max / t


def _step_ms(logits: np.ndarray, kw: dict, copy: bool, repeats: int, rng_seed: int) -> tuple[float, list[int]]:
    """Best ms per sample_batch call, and the tokens of the first; copy: with _copying in place."""
    from vtool.runtime.sampling import host

    now = host._scaled_copy
    host._scaled_copy = _copying if copy else now
    try:
        return _timed(logits, kw, repeats, rng_seed)
    finally:
        host._scaled_copy = now


def _timed(logits: np.ndarray, kw: dict, repeats: int, rng_seed: int) -> tuple[float, list[int]]:
    from vtool.runtime.sampling.host import SequenceSampler, sample_batch
    from vtool.runtime.sampling.params import SamplingParams

    batch, vocab = logits.shape
    rng = np.random.default_rng(rng_seed)
    seqs = []
    for i in range(batch):
        s = SequenceSampler(SamplingParams(max_tokens=None, seed=i, **kw), prompt_token_ids=rng.integers(0, vocab, 200),
                            vocab_size=vocab)
        for t in rng.integers(0, vocab, 50):
            s.append_token(int(t))
        seqs.append(s)
    tokens = [r.token_id for r in sample_batch(logits, seqs)]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        sample_batch(logits, seqs)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", default="49152,151936")
    ap.add_argument("--batch", default="8,64")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(json.dumps({"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "numpy": np.__version__}), flush=True)
    rng = np.random.default_rng(0)
    for vocab in (int(v) for v in args.vocab.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            logits = _logits(rng, batch, vocab)
            for name, kw in KINDS.items():
                line = {"vocab": vocab, "batch": batch, "kind": name}
                drawn = []
                for name_, copy in (("ms", False), ("ms_with_copy", True)):
                    ms, tokens = _step_ms(logits, kw, copy, args.repeats, rng_seed=1)
                    line[name_] = round(ms, 3)
                    drawn.append(tokens)
                line["same_tokens"] = drawn[0] == drawn[1]
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
