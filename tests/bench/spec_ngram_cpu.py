"""n-gram speculation on the default model (SmolLM2-135M Q4_1) against the same engine without it:
a copy-heavy prompt (repeat a piece of Python), greedy, best of 3 after a warm-up. Then the
model step alone at the prompt's context: decode of 1 token against batch_verify of 1 + k
(best and median of 15), the ratio that decides whether speculation can pay.

    python tests/bench/spec_ngram_cpu.py [--tokens 128] [--k 4] [--target host|x86-avx2|...]

(--target x86-avx2 runs the AVX2 kernels on an AVX-512 machine: the AVX2-only CPUs' code.)
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from vtool import LLM, SamplingParams

CODE = Path(__file__).resolve().parents[2].joinpath("runtime", "engine", "ngram_proposer.py").read_text()[:1200]
PROMPT = f"Repeat the following code exactly, without any change:\n\n{CODE}\n\nHere is the code, repeated exactly:\n\n"


def step_times(llm: LLM, context: list[int], k: int, reps: int = 15) -> dict[str, tuple[float, float]]:
    """(best, median) ms of one model call after `context` is in the KV cache: decode of one
    token, batch_verify of 1 + k (what a speculative step runs)."""
    from vtool.runtime.artifact.tvm_runtime import global_func

    m, kv = llm.engine.model, llm.engine.kv
    view = global_func("runtime.TVMTensorCreateView")
    seq = 1_000_000
    kv.add(seq)
    ids = np.asarray(context, dtype=np.int32)
    kv.begin_forward([seq], [len(ids)])
    emb = m.function("embed")(m.upload(ids), m.params)
    m.function("prefill")(view(emb, m.ffi.Shape([1, len(ids), m.hidden_size]), m.dtype, 0), kv.tvm, m.params)
    kv.end_forward()
    result = {}
    for name, n in (("decode", 1), ("batch_verify", 1 + k)):
        e = m.function("embed")(m.upload(ids[:n]), m.params)
        positions = m.upload(np.arange(n, dtype=np.int32))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            kv.begin_forward([seq], [n])
            x = view(e, m.ffi.Shape([1, n, m.hidden_size]), m.dtype, 0)
            if name == "decode":
                logits, _ = m.function(name)(x, kv.tvm, m.params)
            else:
                logits, _ = m.function(name)(x, positions, kv.tvm, m.params)
            kv.end_forward()
            m.to_numpy(logits)
            times.append(time.perf_counter() - t)
            kv.pop(seq, n)
        result[f"{name} of {n}"] = (min(times) * 1e3, statistics.median(times) * 1e3)
    kv.remove(seq)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--target", default="host")
    a = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    outputs, rates = {}, {}
    llm = None
    for name, spec in (("none", None), ("ngram", {"method": "ngram", "num_speculative_tokens": a.k,
                                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2})):
        llm = LLM(target=a.target, max_model_len=2048, speculative_config=spec)
        llm.generate(PROMPT, params)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            out = llm.generate(PROMPT, params)
            best = min(best, time.perf_counter() - t)
        outputs[name] = out[0].outputs[0].token_ids
        rates[name] = a.tokens / best
        s = llm.engine.stats()
        print(f"{name}: {rates[name]:.1f} tok/s end to end; drafts kept {s['spec_num_accepted_tokens']}/"
              f"{s['spec_num_draft_tokens']}; engine steps {s['steps']}")
    print("tokens identical:", outputs["none"] == outputs["ngram"])
    print(f"speed-up: {rates['ngram'] / rates['none']:.2f}x")
    context = list(out[0].prompt_token_ids)
    times = step_times(llm, context, a.k)
    print(f"model step at a {len(context)}-token context (best / median of 15): "
          + "; ".join(f"{name} {b:.2f} / {med:.2f} ms" for name, (b, med) in times.items())
          + f"; verify / decode {times[f'batch_verify of {1 + a.k}'][0] / times['decode of 1'][0]:.2f}x")


if __name__ == "__main__":
    main()
