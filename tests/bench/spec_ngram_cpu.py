"""n-gram speculation on the default model (SmolLM2-135M Q4_1) against the same engine without it:
a copy-heavy prompt (repeat a piece of Python), greedy, best of 3 after a warm-up.

    python tests/bench/spec_ngram_cpu.py [--tokens 128] [--k 4]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from vtool import LLM, SamplingParams

CODE = Path(__file__).resolve().parents[2].joinpath("runtime", "engine", "ngram_proposer.py").read_text()[:1200]
PROMPT = f"Repeat the following code exactly, without any change:\n\n{CODE}\n\nHere is the code, repeated exactly:\n\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    a = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    outputs = {}
    for name, spec in (("none", None), ("ngram", {"method": "ngram", "num_speculative_tokens": a.k,
                                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2})):
        llm = LLM(max_model_len=2048, speculative_config=spec)
        llm.generate(PROMPT, params)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            out = llm.generate(PROMPT, params)
            best = min(best, time.perf_counter() - t)
        outputs[name] = out[0].outputs[0].token_ids
        s = llm.engine.stats()
        print(f"{name}: {a.tokens / best:.1f} tok/s end to end; drafts kept {s['spec_num_accepted_tokens']}/"
              f"{s['spec_num_draft_tokens']}; engine steps {s['steps']}")
    print("tokens identical:", outputs["none"] == outputs["ngram"])


if __name__ == "__main__":
    main()
