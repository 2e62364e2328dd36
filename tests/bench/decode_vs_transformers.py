"""Decode speed of vtool's CPU build against transformers on the same weights, same run.

    python tests/bench/decode_vs_transformers.py [--tokens 64] [--repeat 5]

Both decode the default model (SmolLM2-135M-Instruct, Q4_1 dequantized to float32) greedily
from the same prompt with a KV cache, one sequence; the first run of each is warm-up.
Prints tok/s for both and the ratio. Not a test: timings are recorded in docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # hf_oracle


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    import torch
    from hf_oracle import load_gguf_model, load_gguf_tokenizer
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.runtime.weights.default_model import default_model_path
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.session import open_session
    from vtool.toolchain.build import build_artifact

    path = default_model_path()
    checkpoint = open_checkpoint(path)
    session = open_session(build_artifact(path, "host", checkpoint=checkpoint), checkpoint, max_model_len=1024)
    prompt = session.tokenizer.encode("The history of the printing press begins", add_special_tokens=False)

    ours = []
    for _ in range(args.repeat):
        r = session.generator.generate(prompt, SamplingParams(temperature=0, max_tokens=args.tokens))
        ours.append(r.decode_tokens_per_second)

    model = load_gguf_model(path)
    torch.set_num_threads(os.cpu_count() or 1)
    theirs = []
    ids = torch.tensor([prompt])
    for _ in range(args.repeat):
        with torch.no_grad():
            out = model(ids, use_cache=True)
            past, token = out.past_key_values, out.logits[0, -1].argmax()
            t = time.perf_counter()
            for _ in range(args.tokens - 1):
                out = model(token.view(1, 1), past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[0, -1].argmax()
            theirs.append((args.tokens - 1) / (time.perf_counter() - t))
    a, b = statistics.median(ours[1:]), statistics.median(theirs[1:])
    print(f"vtool (x86 build, float32):      {a:7.1f} tok/s  (median of runs 2..{args.repeat})")
    print(f"transformers {__import__('transformers').__version__} eager float32: {b:7.1f} tok/s")
    print(f"ratio vtool / transformers:      {a / b:7.2f}x")


if __name__ == "__main__":
    main()
