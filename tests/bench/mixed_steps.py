"""What a step that mixes a new prompt into running decodes costs, against a decode-only step,
in one process (issue 13: served runs at concurrency 64 spend a tenth of their token gaps in
such steps).

    python tests/bench/mixed_steps.py --artifact DIR --model CKPT [--batch 64] [--prompt 128]
                                      [--steps 160] [--arrive-every 4] [--profile 8]
                                      [--tokenizer DIR]

`--batch` requests of `--prompt` random token ids decode without end (ignore_eos); after a
warm-up, every `--arrive-every` steps the oldest request is aborted and a new one with a fresh
prompt is admitted, as in a served run where requests come and go one at a time. Each
Engine.step_core call is timed; with overlapped steps (a GPU) a call's wall time is the step
launched by the call before, and it is attributed to that step. One JSON line: median step
time by kind (decode only, or with prompt tokens), how many of each, and the engine's phase
seconds per step. `--profile N` adds the GPU kernels of N steps of each kind (torch.profiler,
CUPTI: TVM's kernels included), top kernels by time per step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def make_engine(artifact: Path, model: Path, a: argparse.Namespace):  # noqa: ANN201
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint

    if a.tokenizer is None:
        session = open_session(str(artifact), open_checkpoint(str(model)), None, a.prompt + a.context + 64)
    else:  # a GGUF file written by shape_gguf.py carries no vocabulary: the tokenizer comes from a folder
        from vtool.runtime.artifact.library import CompiledModel
        from vtool.runtime.engine.generate import Generator
        from vtool.runtime.session import Session
        from vtool.runtime.text.tokenizer import Tokenizer

        ckpt = open_checkpoint(str(model))
        compiled = CompiledModel(artifact, ckpt)
        length = a.prompt + a.context + 64
        session = Session(ckpt, compiled, Tokenizer.from_dir(a.tokenizer, None), [], length,
                          Generator(compiled, length))
    return Engine(session, EngineConfig(max_num_seqs=a.batch, max_num_batched_tokens=max(8192, a.batch * a.prompt),
                                        enable_prefix_caching=False, gpu_memory_utilization=0.3,
                                        max_model_len=a.prompt + a.context + 64))


class Workload:
    """Requests that come and go: `batch` running, one swapped every `arrive_every` steps."""

    def __init__(self, engine, a: argparse.Namespace):  # noqa: ANN001
        from vtool.runtime.sampling.params import SamplingParams

        self.engine, self.a = engine, a
        self.params = SamplingParams(max_tokens=a.context, ignore_eos=True, temperature=1.0, seed=0)
        self.rng = np.random.default_rng(0)
        self.live: list[str] = []
        self.count = 0
        for _ in range(a.batch):
            self.add()

    def add(self) -> None:
        request_id = f"r{self.count}"
        self.count += 1
        prompt = self.rng.integers(100, self.engine.vocab_size - 100, self.a.prompt).tolist()
        self.engine.add_request(request_id, prompt, self.params, with_text=False)
        self.live.append(request_id)

    def swap(self) -> None:
        self.engine.finish_request(self.live.pop(0), "abort", None)
        self.add()


def run(work: Workload, steps: int, arrive_every: int) -> list[tuple[float, int]]:
    """(seconds, prompt tokens of the step it measures) for each step after the warm-up."""
    engine = work.engine
    for _ in range(8):  # the first prefill wave (or the last swap's prompt), then plain decodes
        engine.step_core()
    overlap = bool(getattr(engine, "_overlap", False))
    records: list[tuple[float, int]] = []
    prior_prompt_tokens = 0
    for i in range(steps):
        if arrive_every and i % arrive_every == 0:
            work.swap()
        t = time.perf_counter()
        engine.step_core()
        seconds = time.perf_counter() - t
        launched_prompt_tokens = max(0, engine.last_step_tokens - len(work.live))
        records.append((seconds, prior_prompt_tokens if overlap else launched_prompt_tokens))
        prior_prompt_tokens = launched_prompt_tokens
    return records[1:]


def summarize(records: list[tuple[float, int]]) -> dict:
    decode = [s for s, p in records if p == 0]
    mixed = [s for s, p in records if p > 0]
    return {"decode_steps": len(decode), "decode_step_ms": round(1e3 * statistics.median(decode), 3) if decode else None,
            "mixed_steps": len(mixed), "mixed_step_ms": round(1e3 * statistics.median(mixed), 3) if mixed else None,
            "mixed_prompt_tokens": sorted({p for _, p in records if p > 0})}


def profile(work: Workload, steps: int) -> dict:
    """Top GPU kernels per step of decode-only steps and of mixed steps (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    gpu = torch.cuda.is_available()  # else the host's operators (to try the script on a CPU build)
    device = torch.autograd.DeviceType.CUDA if gpu else torch.autograd.DeviceType.CPU
    out = {}
    for kind, every in (("decode", 0), ("mixed", 1)):
        with torch_profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
            run(work, steps + 1, every)
            if gpu:
                torch.cuda.synchronize()
        groups: dict[str, list[float]] = {}
        for event in prof.events():
            if event.device_type == device:
                groups.setdefault(event.name, []).append(event.device_time_total)
        per_step = {k: sum(v) / steps for k, v in groups.items()}
        out[kind] = {"kernel_us_per_step": round(sum(per_step.values()), 1),
                     "top": [(k[:90], round(v, 1), len(groups[k]) // steps)
                             for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])[:12]]}
    return out


def engine_arguments(ap: argparse.ArgumentParser) -> None:
    """The arguments make_engine reads (wave_admission.py takes them too)."""
    ap.add_argument("--artifact", required=True, type=Path)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--tokenizer", type=Path, help="a folder with tokenizer.json (for a GGUF file without a vocabulary)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)


def main() -> None:
    ap = argparse.ArgumentParser()
    engine_arguments(ap)
    ap.add_argument("--context", type=int, default=512, help="tokens each request may decode (never reached)")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--arrive-every", type=int, default=4)
    ap.add_argument("--profile", type=int, default=0, help="steps of each kind under torch.profiler")
    a = ap.parse_args()
    engine = make_engine(a.artifact, a.model, a)
    work = Workload(engine, a)
    c0 = dict(vars(engine.counters))
    result = summarize(run(work, a.steps, a.arrive_every))
    c1 = vars(engine.counters)
    n = max(1, c1["steps"] - c0["steps"])
    result["phase_ms_per_step"] = {k.removesuffix("_seconds"): round(1e3 * (c1[k] - c0[k]) / n, 3)
                                   for k in c1 if k.endswith("_seconds")}
    print(json.dumps(result), flush=True)
    if a.profile:
        print(json.dumps(profile(work, a.profile)), flush=True)


if __name__ == "__main__":
    main()
