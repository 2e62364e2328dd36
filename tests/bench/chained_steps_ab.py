"""Chained decode steps against steps that wait for the previous step's tokens, in one process
on a GPU, alternating (runtime/engine/chained_steps.py; issue 13).

    python tests/bench/chained_steps_ab.py --artifact DIR --model CKPT [--batch 64] [--prompt 128]
                                           [--tokens 128] [--rounds 3] [--temperature 1.0]

Each round runs the same workload twice, once per mode: `--batch` requests of `--prompt` random
token ids admitted together, `--tokens` tokens each (ignore_eos, seeded sampling at
--temperature), stepped with Engine.step_core until all finish, no HTTP. It reports the decode
steps' mean time (the steps after the first token of every request until the first request
ends), output tok/s over the whole run, and how many steps were chained. One JSON line per run,
then the medians per mode.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def run_once(session, chain: bool, a: argparse.Namespace, seed: int) -> dict:  # noqa: ANN001
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.sampling.params import SamplingParams

    engine = Engine(session, EngineConfig(max_num_seqs=a.batch, max_num_batched_tokens=max(8192, a.batch * a.prompt),
                                          enable_prefix_caching=False, gpu_memory_utilization=0.3,
                                          max_model_len=a.prompt + a.tokens + 16, chain_steps=chain))
    rng = np.random.default_rng(seed)
    for i in range(a.batch):
        params = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=a.temperature, seed=seed + i)
        engine.add_request(f"r{i}", rng.integers(100, engine.vocab_size - 100, a.prompt).tolist(), params,
                           with_text=False)
    produced, step_times, first_done = 0, [], False
    start = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step_core()
        step_times.append((time.perf_counter() - t, len(outs)))
        produced += sum(len(o.new_token_ids) for o in outs)
        first_done = first_done or any(o.finish_reason for o in outs)
        if first_done:
            break
    while engine.has_unfinished():  # the rest, outside the decode-step timing
        produced += sum(len(o.new_token_ids) for o in engine.step_core())
    wall = time.perf_counter() - start
    decode = [s for s, n in step_times[3:] if n == a.batch]  # full-batch steps after the prefill
    result = {"chain": chain, "decode_step_ms": 1e3 * statistics.mean(decode) if decode else None,
              "output_tok_s": produced / wall, "steps": engine.counters.steps,
              "chained_steps": engine.counters.chained_steps, "tokens": produced}
    del engine
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", required=True, type=Path)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    a = ap.parse_args()
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint

    session = open_session(a.artifact, open_checkpoint(a.model), max_model_len=a.prompt + a.tokens + 16)
    run_once(session, True, a, 0)  # warm-up: graph captures, allocator pools
    runs = []
    for r in range(a.rounds):
        for chain in ((False, True) if r % 2 == 0 else (True, False)):
            runs.append(run_once(session, chain, a, 1000 * (r + 1)))
            print(json.dumps(runs[-1]), flush=True)
    for chain in (False, True):
        mine = [x for x in runs if x["chain"] is chain]
        print(json.dumps({"mode": "chained" if chain else "waiting",
                          "median_decode_step_ms": statistics.median(x["decode_step_ms"] for x in mine),
                          "median_output_tok_s": statistics.median(x["output_tok_s"] for x in mine),
                          "chained_steps": [x["chained_steps"] for x in mine], "steps": [x["steps"] for x in mine]}))


if __name__ == "__main__":
    main()
