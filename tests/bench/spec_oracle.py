"""What speculation can give on a machine, separate from how good the drafts are: batch-1 decode
through the engine with drafts that are the model's own greedy continuation (every draft kept),
with half of them wrong, and without speculation; plus the model step alone (decode of one token
against batch_verify of 1 + k). Random weights never repeat their prompt, so an n-gram proposer
cannot be measured on them; the oracle isolates the engine's and the verify step's cost.

    python tests/bench/spec_oracle.py --artifact ART --model CKPT [--k 4] [--tokens 128]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.engine.spec_config import parse_speculative_config
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.session import open_session
from vtool.runtime.weights.checkpoint import open_checkpoint


class Oracle:
    """Drafts from a known continuation; `wrong(position)` flips some of them."""

    def __init__(self, continuation: list[int], prompt_len: int, wrong, vocab: int):
        self.cont, self.prompt_len, self.wrong, self.vocab = continuation, prompt_len, wrong, vocab

    def propose_batch(self, requests, limits) -> None:
        for request, limit in zip(requests, limits):
            done = len(request.all_ids) - self.prompt_len
            drafts = self.cont[done:done + limit]
            request.draft_ids = [(t + 1) % self.vocab if self.wrong(done + j) else t for j, t in enumerate(drafts)]

    def release(self, request) -> None:
        pass


def decode_rate(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Tokens per second after the first token, and the tokens."""
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    out: list[int] = []
    first = last = None
    while engine.has_unfinished():
        for o in engine.step():
            now = time.perf_counter()
            first = first or now
            last = now
            out.extend(o.new_token_ids)
    engine.reset_prefix_cache()
    return (len(out) - 1) / (last - first), out


def step_times(engine: Engine, k: int, reps: int = 30) -> dict[str, float]:
    """Median ms of the model step alone: decode of 1 token, batch_verify of 1 + k tokens (and,
    on a CUDA build, its captured copy)."""
    m, kv = engine.model, engine.kv
    from vtool.runtime.artifact.tvm_runtime import global_func

    view = global_func("runtime.TVMTensorCreateView")
    seq = 10_000
    kv.add(seq)
    ids = np.arange(1000, 1128, dtype=np.int32)
    emb = m.function("embed")(m.upload(ids), m.params)
    kv.begin_forward([seq], [128])
    m.function("prefill")(view(emb, m.ffi.Shape([1, 128, m.hidden_size]), m.dtype, 0), kv.tvm, m.params)
    kv.end_forward()
    result = {}
    entries = [("decode", 1), ("batch_verify", 1 + k)]
    if m.has_function("batch_verify_captured"):  # CUDA builds: one graph per token count
        entries.append(("batch_verify_captured", 1 + k))
    for name, n in entries:
        e = m.function("embed")(m.upload(ids[:n]), m.params)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            kv.begin_forward([seq], [n])
            x = view(e, m.ffi.Shape([1, n, m.hidden_size]), m.dtype, 0)
            if name == "decode":
                logits, _ = m.function("decode")(x, kv.tvm, m.params)
            else:
                logits, _ = m.function(name)(x, m.upload(np.arange(n, dtype=np.int32)), kv.tvm, m.params)
            kv.end_forward()
            m.to_numpy(logits)  # waits for the device
            times.append(time.perf_counter() - t)
            kv.pop(seq, n)
        result[f"{name}_{n}_ms"] = float(np.median(times) * 1e3)
    kv.remove(seq)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    session = open_session(a.artifact, open_checkpoint(a.model), max_model_len=min(1024, json.loads((a.model / "config.json").read_text())["max_position_embeddings"]))
    prompt = list(range(1000, 1128))
    base = Engine(session, EngineConfig(max_num_seqs=4, num_blocks=256))
    decode_rate(base, prompt, 16)  # warm-up
    rate, tokens = decode_rate(base, prompt, a.tokens)
    report = {"tokens": a.tokens, "k": a.k, "no_spec_tok_s": rate, **step_times(base, a.k)}
    del base
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": a.k})
    for label, wrong in (("all_kept", lambda p: False), ("half_wrong", lambda p: p % 2 == 1)):
        engine = Engine(session, EngineConfig(max_num_seqs=4, num_blocks=256, speculative=config))
        engine.speculator.proposer = Oracle(tokens, len(prompt), wrong, engine.vocab_size)
        decode_rate(engine, prompt, 16)
        spec_rate, got = decode_rate(engine, prompt, a.tokens)
        s = engine.stats()
        report[label] = {"tok_s": spec_rate, "speedup": spec_rate / rate, "same_tokens": got == tokens,
                         "accepted": s["spec_num_accepted_tokens"], "drafted": s["spec_num_draft_tokens"]}
        del engine
    print(json.dumps({"bench": "spec_oracle", **report}))


if __name__ == "__main__":
    main()
