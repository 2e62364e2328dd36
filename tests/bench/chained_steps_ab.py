"""Chained decode steps against steps that wait for the previous step's tokens, chained steps with
and without the model thread, and the engine's default, in one process on a GPU, alternating
(runtime/engine/chained_steps.py, runtime/engine/model_thread.py; issue 13). A step that does not
chain never uses the model thread, so "waiting" is also what the engine did before it.

    python tests/bench/chained_steps_ab.py --artifact DIR --model CKPT [--batch 64] [--prompt 128]
                                           [--tokens 128] [--rounds 3] [--temperature 1.0]
                                           [--modes waiting,chained,chained+thread,default,lone]

Each round runs the same workload once per mode: `--batch` requests of `--prompt` random
token ids admitted together, `--tokens` tokens each (ignore_eos, seeded sampling at
--temperature), stepped with Engine.step_core until all finish, no HTTP. It reports the decode
steps' mean time (the steps after the first token of every request until the first request
ends), output tok/s over the whole run, how many steps were chained and how many model calls ran
beside host work on the model thread. One JSON line per run, then the medians per mode.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

import numpy as np


# mode -> (chain_steps, overlap_model_calls, lone_decode); "default" is EngineConfig's (chained steps of
# 2+ sequences on the model thread); "waiting" never chains, as the engine did before the model thread;
# "lone": a library built with --draft-cache-len decodes a greedy request alone on its own cache
# (runtime/engine/lone_decode.py); the default engine does not
MODES = {"waiting": (False, False, False), "chained": (True, False, False), "chained+thread": (True, True, False),
         "default": (None, True, False), "lone": (None, True, True)}


def run_once(session, mode: str, a: argparse.Namespace, seed: int) -> dict:  # noqa: ANN001
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.sampling.params import SamplingParams

    engine = Engine(session, EngineConfig(max_num_seqs=a.batch, max_num_batched_tokens=max(8192, a.batch * a.prompt),
                                          enable_prefix_caching=False, gpu_memory_utilization=0.3,
                                          max_model_len=a.prompt + a.tokens + 16, chain_steps=MODES[mode][0],
                                          overlap_model_calls=MODES[mode][1], lone_decode=MODES[mode][2]))
    rng = np.random.default_rng(seed)
    for i in range(a.batch):
        params = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=a.temperature, seed=seed + i)
        engine.add_request(f"r{i}", rng.integers(100, engine.vocab_size - 100, a.prompt).tolist(), params,
                           with_text=False)
    produced, step_times, first_done = 0, [], False
    tokens: dict[str, list[int]] = {}

    def take(outs) -> int:  # noqa: ANN001
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        return sum(len(o.new_token_ids) for o in outs)

    start = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step_core()
        got = take(outs)
        step_times.append((time.perf_counter() - t, len(outs), got))
        produced += got
        first_done = first_done or any(o.finish_reason for o in outs)
        if first_done:
            break
    while engine.has_unfinished():  # the rest, outside the decode-step timing
        produced += take(engine.step_core())
    wall = time.perf_counter() - start
    decode = [(s, got) for s, n, got in step_times[3:] if n == a.batch]  # full-batch steps after the prefill
    # a lone-decode round gives several tokens a step: time per token of each sequence as well
    per_token = 1e3 * sum(s for s, _ in decode) / (sum(got for _, got in decode) / a.batch) if decode else None
    thread = engine.model_thread
    result = {"mode": mode, "decode_step_ms": 1e3 * statistics.mean(s for s, _ in decode) if decode else None,
              "decode_ms_per_token": per_token, "lone_decode_rounds": engine.counters.lone_decode_rounds,
              "output_tok_s": produced / wall, "steps": engine.counters.steps,
              "chained_steps": engine.counters.chained_steps, "tokens": produced,
              "overlapped_calls": thread.overlapped_calls if thread is not None else 0,
              # every mode of a round draws the same tokens (same seeds): the digest says they did
              "tokens_digest": hashlib.sha256(json.dumps(sorted(tokens.items())).encode()).hexdigest()[:16]}
    if thread is not None:
        thread.close()
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
    ap.add_argument("--modes", default="waiting,default")
    a = ap.parse_args()
    modes = a.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        raise SystemExit(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint

    session = open_session(a.artifact, open_checkpoint(a.model), max_model_len=a.prompt + a.tokens + 16)
    run_once(session, modes[0], a, 0)  # warm-up: graph captures, allocator pools
    runs = []
    for r in range(a.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            runs.append(run_once(session, mode, a, 1000 * (r + 1)))
            print(json.dumps(runs[-1]), flush=True)
    for mode in modes:
        mine = [x for x in runs if x["mode"] == mode]
        print(json.dumps({"mode": mode, "overlapped_calls": [x["overlapped_calls"] for x in mine],
                          "median_decode_step_ms": statistics.median(x["decode_step_ms"] for x in mine),
                          "median_decode_ms_per_token": statistics.median(x["decode_ms_per_token"] for x in mine),
                          "median_output_tok_s": statistics.median(x["output_tok_s"] for x in mine),
                          "chained_steps": [x["chained_steps"] for x in mine], "steps": [x["steps"] for x in mine]}))


if __name__ == "__main__":
    main()
