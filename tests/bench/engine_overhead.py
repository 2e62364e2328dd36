"""The engine's own host time per step, with the model and the sampler stubbed out: what the
scheduler, the output path and the metrics cost at a given batch, apart from any device.

    python tests/bench/engine_overhead.py --model DIR [--batch 64] [--steps 40]

DIR: any small model folder (config.json, safetensors, tokenizer.json); it is built for the
host once (cached). Each running sequence "samples" token 5 every step. Run it against another
tree (PYTHONPATH pointing at its package) to compare: an Engine without step_core (before the
engine core process) is timed through Engine.step, which then also makes the text.
"""
from __future__ import annotations

import argparse
import time
import types
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.engine.step_types import ModelRunnerOutput, SequenceResult
    from vtool.runtime.sampling.host import SampleResult
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.toolchain.build import build_artifact

    artifact = build_artifact(a.model, "host", "float32")
    session = open_session(artifact, open_checkpoint(a.model), None, 512)
    engine = Engine(session, EngineConfig(max_num_seqs=a.batch, max_num_batched_tokens=8192))
    new = hasattr(engine, "step_core")

    def results(step):  # noqa: ANN001, ANN202
        out = []
        for s in step.sequences:
            r = SequenceResult(s.request_id)
            if s.sample:
                s.sampler.append_token(5)
                r.sampled = SampleResult(token_id=5, logprob=-1.0)
            out.append(r)
        return ModelRunnerOutput(out)

    if new:
        from vtool.runtime.serving.metrics import ServerMetrics

        engine.observer = ServerMetrics("m", max_model_len=512)
        engine.runner.launch = lambda step: types.SimpleNamespace(step=step)
        engine.runner.finish = lambda flight: results(flight.step)
    else:
        engine.runner.execute = results
    rng = np.random.default_rng(0)
    for i in range(a.batch):
        extra = {"with_text": False} if new else {}
        engine.add_request(f"r{i}", rng.integers(10, min(40000, session.model.vocab_size), 128).tolist(),
                           SamplingParams(max_tokens=a.steps * 4 + 16, ignore_eos=True, temperature=1.0), **extra)
    run = engine.step_core if new else engine.step
    for _ in range(4):
        run()
    best = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(a.steps):
            run()
        best.append((time.perf_counter() - t) / a.steps * 1e3)
    what = "step_core, metrics observer on" if new else "step, text made in the engine"
    print(f"{what}: {min(best):.3f} ms per step at {a.batch} running (best of 3 x {a.steps})")


if __name__ == "__main__":
    main()
