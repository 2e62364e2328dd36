"""Embedding speed: vtool's `LLM.embed` against transformers on the same checkpoint, same
threads, same texts, in one run (the peer: transformers' encoder in float32 with its default
sdpa attention, or eager, then the checkpoint's sentence-transformers pooling).

    python tests/bench/embed_speed.py --model DIR [--lengths 16,128,455] [--batch 8] [--repeats 3]

DIR is a sentence-transformers folder (EmbeddingGemma-300M: tests/support/assets.py
embeddinggemma_dir; all-MiniLM-L6-v2: minilm_dir). Each length makes `--batch` texts of about
that many tokens (distinct words, so no two are equal); a row is the best of `--repeats` calls
embedding them all at once. Prints one JSON line per length and the cosines of vtool's
vectors against the peer's, so a fast wrong answer shows.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_info import cpu_info, cpu_name  # noqa: E402



def texts_of(tokenizer, length: int, count: int) -> list[str]:  # noqa: ANN001 - a tokenizers/transformers one
    """`count` different texts of about `length` tokens each."""
    words = ["apple", "river", "mountain", "number", "quiet", "engine", "yellow", "garden", "window", "music"]
    out = []
    for i in range(count):
        text, n = "", 0
        j = i
        while n < length:
            text += f" {words[j % len(words)]} {j * 7 + i}"
            j += 1
            n = len(tokenizer(text)["input_ids"])
        out.append(text.strip())
    return out


def best_of(fn, repeats: int) -> tuple[float, object]:  # noqa: ANN001
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def peer(folder: Path, threads: int, attention: str):  # noqa: ANN201 - returns a callable texts -> vectors
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from embed_oracle import st_reference

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(str(folder))
    arch = AutoConfig.from_pretrained(str(folder)).architectures[0]
    if arch == "Gemma3TextModel":
        from transformers import Gemma3TextModel as cls
    else:
        from transformers import BertModel as cls
    model = cls.from_pretrained(str(folder), dtype=torch.float32, attn_implementation=attention).eval()

    def embed(texts: list[str]) -> np.ndarray:
        enc = tok(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**enc).last_hidden_state
        return st_reference(folder, hidden, enc["attention_mask"])

    return tok, embed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--lengths", default="16,128,455")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-attention", default="sdpa", choices=["sdpa", "eager"],
                    help="transformers' attention for the peer (sdpa: its default)")
    args = ap.parse_args()

    from embed_oracle import cosines
    from vtool import LLM

    tok, hf_embed = peer(args.model, args.threads, args.peer_attention)
    os.environ["VTOOL_CPU_THREADS"] = str(args.threads)  # the runtime's thread count (read at load)
    llm = LLM(str(args.model))
    print(json.dumps({"cpu": cpu_name(), "flags": cpu_info()["simd_flags"], "threads": args.threads, "model": args.model.name,
                      "peer": f"transformers float32, {args.peer_attention} attention"}),
          flush=True)
    for length in (int(x) for x in args.lengths.split(",")):
        texts = texts_of(tok, length, args.batch)
        tokens = sum(len(tok(t)["input_ids"]) for t in texts)
        llm.embed(texts[:1])  # first call of this width: allocations
        ours, got = best_of(lambda: np.array(llm.embed(texts)), args.repeats)
        theirs, want = best_of(lambda: hf_embed(texts), args.repeats)
        cos = cosines(got, want)
        print(json.dumps({"tokens_per_text": length, "texts": len(texts), "tokens": tokens,
                          "vtool_s": round(ours, 4), "transformers_s": round(theirs, 4),
                          "vtool_tokens_per_s": round(tokens / ours, 1), "speedup": round(theirs / ours, 3),
                          "min_cosine": float(cos.min())}), flush=True)


if __name__ == "__main__":
    main()
