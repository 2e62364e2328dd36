"""A float32 decoder's prompt on the CPU: vtool with the matmul rule as it is, or with its row
schedule only (the micro-kernel switched off, built into its own cache), against transformers
on the same random checkpoint and prompt, one process each.

    python tests/bench/cpu_prefill_f32.py [--schedule all|rows] [--tokens 512] [--folder DIR]

The checkpoint (SmolLM2-135M's layer shapes with Qwen3's 151,936-token vocabulary, random
float32 weights and the Qwen3 tokenizer from tests/support/assets.py) is made in DIR on first use.
Prefix caching is off, so every call prefills the whole prompt; best of 5 calls of one token.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))


def make_checkpoint(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import assets

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=151936, max_position_embeddings=2048,
                      tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    for f in assets.qwen3_tokenizer_dir().iterdir():
        if f.name.startswith("tokenizer"):
            (folder / f.name).write_bytes(f.read_bytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", choices=["all", "rows"], default="all")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--folder", type=Path, default=Path("smol-shape-f32"))
    args = ap.parse_args()
    if not (args.folder / "config.json").exists():
        make_checkpoint(args.folder)
    if args.schedule == "rows":  # the row schedule alone, in a cache of its own (same source digest)
        from vtool.runtime.paths import cache_root

        os.environ["VTOOL_CACHE_DIR"] = str(cache_root() / "bench-rows-only")
        import vtool.schedules.cpu.matmul as matmul

        matmul._schedule_gemm = lambda func, lanes: None
    os.environ.setdefault("VTOOL_CPU_THREADS", "2")
    from vtool import LLM, SamplingParams

    llm = LLM(str(args.folder), max_model_len=2048, enable_prefix_caching=False)
    ids = np.random.default_rng(0).integers(1000, 100000, args.tokens).tolist()
    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([{"prompt_token_ids": ids}], one)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], one)
        best = min(best, time.perf_counter() - t0)
    out = {"schedule": args.schedule, "tokens": args.tokens, "vtool_s": round(best, 4)}
    if args.schedule == "all":  # the peer: transformers' forward over the same tokens
        import torch
        from transformers import LlamaForCausalLM

        torch.set_num_threads(int(os.environ["VTOOL_CPU_THREADS"]))
        model = LlamaForCausalLM.from_pretrained(args.folder, dtype=torch.float32).eval()
        x = torch.tensor([ids])
        with torch.no_grad():
            model(x)
            peer = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                model(x)
                peer = min(peer, time.perf_counter() - t0)
        out["transformers_s"] = round(peer, 4)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
