"""A build with tuning records against the same build from rules alone, on one GPU, in one run.

    python tests/bench/gpu_tuned_vs_rules.py --tuned DIR --rules DIR [--checkpoint DIR]
        [--steps 128] [--rounds 3]

The two artifacts differ only in the tuning records applied at build time (build both
with the same --dtype/--gemm/--attention; tests/bench/shape_checkpoint.py makes the
checkpoint they are built from). Both load the same random Llama-3-8B-shaped checkpoint
(gpu_decode_8b.make_checkpoint), and in the same process:
  * the same answer: greedy tokens after a 128-token prompt from each build, and the
    largest difference of their prompt logits (a tuned kernel computes the same sums in
    another order, so bf16 logits may differ in the last bits, tokens should not);
  * batch-1 decode step time (the `decode` entry point, host synchronised once per loop)
    and `batch_decode` steps at batch 8 and 32, the two builds alternating for `rounds`
    rounds (the best round of each is reported);
  * the same batched answer: one `batch_decode` step at batch 8 and 32 from each build
    (these run the decode-bucket kernels), logits compared;
  * each build's per-kernel GPU time inside 16 batch-1 decode steps and 16 batch-32 steps
    (torch.profiler), side by side.
Writes $OUT/gpu-tuned-vs-rules.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode_8b import (RESULTS, batch_decode_timer, copy_bandwidth, decode_timer, kernel_times,  # noqa: E402
                           make_checkpoint, record, weight_bytes_per_step)

BATCHES = (8, 32)


def load(artifact: Path, checkpoint: Path):  # noqa: ANN201 - (CompiledModel, Generator)
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.runtime.engine.generate import Generator

    model = CompiledModel(artifact, open_checkpoint(checkpoint))
    return model, Generator(model, max_model_len=4096)


def batch_decode_logits(model, batch: int) -> np.ndarray:  # noqa: ANN001
    """Float32 logits [batch, vocab] of one `batch_decode` step: `batch` fresh sequences,
    each given a different token (the step that runs the decode-bucket kernels)."""
    from vtool.runtime.engine.kv_cache import PagedKVCache
    from vtool.runtime.artifact.tvm_runtime import global_func

    kv = PagedKVCache(model, num_blocks=batch * 2 + 8, block_size=16, max_num_seqs=batch, prefill_chunk=2048)
    for seq in range(batch):
        kv.add(seq)
    flat = model.function("embed")(model.upload(np.arange(1000, 1000 + batch, dtype=np.int32)), model.params)
    embeds = global_func("runtime.TVMTensorCreateView")(flat, model.ffi.Shape([batch, 1, model.hidden_size]),
                                                         model.dtype, 0)
    kv.begin_forward(list(range(batch)), [1] * batch)
    logits, _ = model.function("batch_decode")(embeds, kv.tvm, model.params)
    kv.end_forward()
    return model.to_numpy(logits).astype(np.float32).reshape(batch, -1)


def same_answer(builds: dict[str, tuple], steps: int = 32) -> None:
    from vtool.runtime.sampling.params import SamplingParams

    prompt = list(range(1000, 1128))
    tokens, logits = {}, {}
    for name, (_model, gen) in builds.items():
        logits[name] = gen.prompt_logits(prompt).astype(np.float32)
        tokens[name] = gen.generate(prompt, SamplingParams(temperature=0, max_tokens=steps)).token_ids
    diff = np.abs(logits["tuned"] - logits["rules"])
    first_diff = next((i for i, (a, b) in enumerate(zip(tokens["tuned"], tokens["rules"])) if a != b), None)
    record(step="same_answer", greedy_tokens=steps, tokens_equal=tokens["tuned"] == tokens["rules"],
           first_differing_token=first_diff, prompt_logits_max_abs_diff=round(float(diff.max()), 5),
           prompt_logits_mean_abs_diff=round(float(diff.mean()), 6),
           logit_std=round(float(logits["rules"].std()), 4),
           top1_agreement=round(float((logits["tuned"].argmax(-1) == logits["rules"].argmax(-1)).mean()), 4))
    for batch in BATCHES:  # where the decode-bucket records apply
        rows = {name: batch_decode_logits(model, batch) for name, (model, _gen) in builds.items()}
        diff = np.abs(rows["tuned"] - rows["rules"])
        record(step=f"same_answer_batch_decode_b{batch}", logits_max_abs_diff=round(float(diff.max()), 5),
               logits_mean_abs_diff=round(float(diff.mean()), 6), logit_std=round(float(rows["rules"].std()), 4),
               top1_agreement=round(float((rows["tuned"].argmax(-1) == rows["rules"].argmax(-1)).mean()), 4))


def alternate(builds: dict[str, tuple], steps: int, rounds: int) -> None:
    timers = {}
    for name, (model, gen) in builds.items():
        timers[(name, "decode_b1")] = decode_timer(model, gen)
        for batch in BATCHES:
            timers[(name, f"batch_decode_b{batch}")] = batch_decode_timer(model, batch, 16 + rounds * (steps + 4))
    for timer in timers.values():
        timer(8)  # warm: CUDA graph capture, first launches
    best: dict[tuple[str, str], float] = {}
    for r in range(rounds):
        for what in ("decode_b1", *(f"batch_decode_b{b}" for b in BATCHES)):
            for name in (("rules", "tuned") if r % 2 == 0 else ("tuned", "rules")):
                sec = timers[(name, what)](steps)
                best[(name, what)] = min(best.get((name, what), sec), sec)
    for what in ("decode_b1", *(f"batch_decode_b{b}" for b in BATCHES)):
        batch = 1 if what == "decode_b1" else int(what.rsplit("b", 1)[1])
        rule, tuned = best[("rules", what)], best[("tuned", what)]
        record(step=what, rules_ms=round(rule * 1e3, 4), tuned_ms=round(tuned * 1e3, 4),
               rules_tok_s=round(batch / rule, 1), tuned_tok_s=round(batch / tuned, 1),
               speedup=round(rule / tuned, 4), rounds=rounds, steps=steps)


def kernels_side_by_side(builds: dict[str, tuple], what: str, steps: int = 16) -> None:
    """Per-kernel GPU time inside `steps` steps of each build: `what` is decode_b1 or
    batch_decode_bN (the decode-bucket records apply to the batched steps only)."""
    per = {}
    for name, (model, gen) in builds.items():
        if what == "decode_b1":
            timer = decode_timer(model, gen)
        else:
            timer = batch_decode_timer(model, int(what.rsplit("b", 1)[1]), 2 * steps + 32)
        timer(4)
        per[name] = kernel_times(timer.steps_only(steps), steps)[:2]
    rules_us, rules_n = per["rules"]
    tuned_us, tuned_n = per["tuned"]
    rows = []
    for kernel in sorted(set(rules_us) | set(tuned_us), key=lambda k: -max(rules_us.get(k, 0), tuned_us.get(k, 0))):
        rows.append((kernel[:90], round(rules_us.get(kernel, 0.0), 2), round(tuned_us.get(kernel, 0.0), 2),
                     rules_n.get(kernel, 0), tuned_n.get(kernel, 0)))
    record(step=f"{what}_kernels_us_per_step", columns=["kernel", "rules_us", "tuned_us", "rules_launches",
                                                         "tuned_launches"],
           rules_total_us=round(sum(rules_us.values()), 1), tuned_total_us=round(sum(tuned_us.values()), 1),
           rows=rows[:40])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tuned", required=True, type=Path)
    ap.add_argument("--rules", required=True, type=Path)
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/llama8b-random"))
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for name, folder in (("tuned", args.tuned), ("rules", args.rules)):
        manifest = json.loads((folder / "manifest.json").read_text())
        record(step=f"{name}_artifact", tuning=manifest.get("build", {}).get("tuning"),
               gemm=manifest.get("gemm"), attention=manifest.get("attention"))
    make_checkpoint(args.checkpoint)
    bw = copy_bandwidth()
    record(step="copy_bandwidth", gb_s=round(bw, 1), roofline_ms=round(weight_bytes_per_step() / bw / 1e6, 3))
    builds = {"rules": load(args.rules, args.checkpoint), "tuned": load(args.tuned, args.checkpoint)}
    same_answer(builds)
    alternate(builds, args.steps, args.rounds)
    kernels_side_by_side(builds, "decode_b1")
    kernels_side_by_side(builds, f"batch_decode_b{BATCHES[-1]}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu-tuned-vs-rules.json").write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
