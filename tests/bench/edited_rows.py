"""A step's draw for rows with logit edits (repetition / frequency / presence penalties, logit_bias),
on the device (apply_logit_edits, then the usual draw) against what a GPU host did before: the
logits copied to the host and the host sampler. Greedy and random (temperature 0.8, top_p 0.95)
batches, and random ones asking for 5 logprobs (the device draws, the rows come to the host for
the top-N), ms a step (median), each request with a 200-token prompt and 50 generated tokens.

    python tests/bench/edited_rows.py SAMPLER.so VOCAB [--batches 1,8,64] [--steps 30]

SAMPLER.so: a sampler library (tests/test_gpu_sampler.py's CUDA build; a model's library holds the
same functions). Runs on the GPU machine with the vtool runtime.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("library", type=Path)
    ap.add_argument("vocab", type=int)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a host build of the sampler, to try the script (importing tvm registers its sort)")
    args = ap.parse_args()
    if args.device == "cpu":
        import tvm  # noqa: F401
    else:
        from vtool.runtime.artifact.tvm_runtime import cuda_runtime

        cuda_runtime()  # TVM's CUDA module loader, before the library loads
    from test_gpu_sampler import Library  # the standalone library wrapper the GPU tests use

    from vtool.runtime.sampling.device import DeviceSampler
    from vtool.runtime.sampling.host import SequenceSampler, sample_batch
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.artifact.tvm_runtime import global_func

    sync = global_func("runtime.Device_StreamSync")
    v = args.vocab
    sampler = DeviceSampler(Library(args.library, args.device, v))
    model = sampler.model
    rng = np.random.default_rng(0)
    kinds = {"greedy": dict(temperature=0.0), "random": dict(temperature=0.8, top_p=0.95, seed=1),
             "random, 5 logprobs": dict(temperature=0.8, top_p=0.95, seed=1, logprobs=5)}
    edits = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1, logit_bias={13: 2.0, 220: -1.0})
    for b in (int(x) for x in args.batches.split(",")):
        logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
        on_device = model.upload(logits, "float32")
        for kind, sampling in kinds.items():
            base = []
            for _ in range(b):
                seq = SequenceSampler(SamplingParams(**sampling, **edits), prompt_token_ids=rng.integers(0, v, 200),
                                      vocab_size=v)
                for t in rng.integers(0, v, 50):
                    seq.append_token(int(t))
                base.append(seq)
            times = {"device": [], "host": []}
            for step in range(args.steps + 3):
                seqs = copy.deepcopy(base)
                sync(model.device, 0)
                t0 = time.perf_counter()
                sampler.sample_batch(on_device, seqs)
                t1 = time.perf_counter()
                seqs = copy.deepcopy(base)
                sync(model.device, 0)
                t2 = time.perf_counter()
                sample_batch(model.to_numpy(on_device), seqs)
                t3 = time.perf_counter()
                if step >= 3:
                    times["device"].append(t1 - t0)
                    times["host"].append(t3 - t2)
            dev, host = (statistics.median(times[k]) * 1e3 for k in ("device", "host"))
            print(json.dumps({"vocab": v, "batch": b, "kind": kind, "device_ms": round(dev, 3), "host_ms": round(host, 3),
                              "host_over_device": round(host / dev, 2)}), flush=True)


if __name__ == "__main__":
    main()
