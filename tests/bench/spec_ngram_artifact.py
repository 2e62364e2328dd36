"""Speculation on any built model (a GPU artifact and its checkpoint or GGUF) against the same
engine without it, greedy, best of 3 after a warm-up: decode tok/s (after the first token), the
drafts kept, whether the tokens are identical. n-gram lookup by default; a draft model with
--draft-artifact/--draft-model. Prompts: spec_ngram_cpu.py's copy-heavy one (`copy`) or a
write-new-code one (`write`), through the model's chat template unless --raw.

    python tests/bench/spec_ngram_artifact.py --artifact ART --model FILE.gguf [--k 2,4,8] [--tokens 256]
        [--prompt copy|write] [--raw] [--draft-artifact ART --draft-model FILE.gguf]

The report counts the verification steps that took the argmax of every row on the device, and
gives the host seconds of the target's and the draft's model runners (launch / wait-and-sample)
over all runs. With a draft model each k runs up to three times: `k4` as the engine runs it (when both
libraries were built with --draft-cache-len, the request alone runs over both models' own caches
("own_caches": true, also on the CPU),
runtime/engine/lone_chain.py, `lone_rounds` counts those rounds; a draft library with the cache alone
drafts through it, runtime/engine/draft_chain.py, `chain_rounds`), `k4-paged` with the target's own
cache off (verification through the paged cache; only when the target has one), and `k4-engine` with
the draft's off too (each draft token an engine step of the draft, its logits row scanned on the
host). Each row also gives the time to the first token of a prompt no cache holds (first_token_ms:
a request alone on the own caches prefills through draft_extend, not the paged prefill).
--profile N prints the N most costly functions (cProfile, cumulative) of one speculative run.
"""
from __future__ import annotations

import argparse
import dataclasses
import cProfile
import io
import json
import pstats
import sys
import time
from types import SimpleNamespace
from pathlib import Path

from spec_ngram_cpu import PROMPT
from spec_oracle import decode_rate, step_times

from vtool.runtime.engine.draft_chain import has_chain_verify
from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.engine.spec_config import parse_speculative_config
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.session import open_session
from vtool.runtime.weights.checkpoint import open_checkpoint


WRITE = ("Write a Python class LRUCache with get and put methods, a capacity given to the constructor, and "
         "docstrings; then write five unit tests for it with unittest.")


def count_device_verifies(engine: Engine) -> dict[str, int]:
    """A counter of the target's verification steps that took each row's argmax on the device
    (the runner's greedy rows: only token ids come to the host), filled as the engine runs."""
    calls = {"device_verifies": 0}
    rows = engine.runner._finish_greedy_rows

    def counted_rows(*args):
        calls["device_verifies"] += 1
        return rows(*args)

    engine.runner._finish_greedy_rows = counted_rows
    return calls


def first_token_ms(engine: Engine, prompt: list[int], runs: int = 3) -> float:
    """Milliseconds from admission to the first token, best of `runs`, for prompts no cache holds
    any of (the first token changed each run: the paged prefix cache and the own caches alike
    would otherwise hand the prompt back)."""
    best = float("inf")
    for run in range(runs):
        ids = [(prompt[0] + 1 + run) % engine.vocab_size] + list(prompt[1:])
        engine.add_request(f"ttft{run}", ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        t0, first = time.perf_counter(), None
        while engine.has_unfinished():
            if any(o.new_token_ids for o in engine.step()) and first is None:
                first = time.perf_counter()
        best = min(best, (first - t0) * 1e3)
    engine.reset_prefix_cache()
    return round(best, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--k", default="4", help="draft lengths, comma-separated")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--lookup", default="2,4", help="prompt_lookup_min,max")
    ap.add_argument("--draft-artifact", type=Path, help="speculate with this draft model instead of n-gram lookup")
    ap.add_argument("--draft-model", type=Path, help="the draft's checkpoint or GGUF")
    ap.add_argument("--prompt", choices=("copy", "write"), default="copy",
                    help="copy: repeat a piece of code; write: write new code (drafts must guess)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--raw", action="store_true", help="the prompt as plain text, not through the chat template")
    ap.add_argument("--profile", type=int, default=0, help="print this many top functions of one profiled run")
    a = ap.parse_args()
    session = open_session(a.artifact, open_checkpoint(a.model), max_model_len=a.max_model_len)
    text = PROMPT if a.prompt == "copy" else WRITE
    tok = session.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False) \
        if tok.chat_template is not None and not a.raw else tok.encode(text)
    lo, hi = (int(x) for x in a.lookup.split(","))
    report: dict = {"bench": "spec_draft" if a.draft_artifact else "spec_ngram", "prompt": a.prompt, "raw": a.raw,
                    "artifact": a.artifact.name, "model": a.model.name, "tokens": a.tokens,
                    "prompt_tokens": len(prompt)}
    base = Engine(session, EngineConfig(max_num_seqs=4))
    decode_rate(base, prompt, 16)
    rates = [decode_rate(base, prompt, a.tokens) for _ in range(3)]
    report["no_spec_tok_s"] = max(r for r, _ in rates)
    report["no_spec_first_token_ms"] = first_token_ms(base, prompt)
    reference = rates[0][1]
    ks = [int(x) for x in a.k.split(",")]
    report["target_step_ms"] = step_times(base, max(ks))  # the model alone, logits copied back
    del base
    for k in ks:
        if a.draft_artifact:
            config = parse_speculative_config({"model": str(a.draft_model), "num_speculative_tokens": k,
                                               "own_caches": True}) \
                .resolved(str(a.draft_artifact), str(a.draft_model))
        else:
            config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": k,
                                               "prompt_lookup_min": lo, "prompt_lookup_max": hi})
        variants = ("", "-paged", "-engine") if has_chain_verify(session.model) else ("", "-engine")
        for variant in variants if a.draft_artifact else ("",):
            own = dataclasses.replace(config, own_caches=variant != "-engine") if a.draft_artifact else config
            engine = Engine(session, EngineConfig(max_num_seqs=4, speculative=own))
            draft_runner = getattr(engine.speculator.proposer, "runner", None)
            if draft_runner is not None and "draft_step_ms" not in report:
                proposer = engine.speculator.proposer
                report["draft_step_ms"] = step_times(SimpleNamespace(model=proposer.model, kv=proposer.kv), 1)
            if variant == "-paged":  # the draft's own cache, the target's verification through the paged one
                engine.lone_chain = None
            calls = count_device_verifies(engine)
            decode_rate(engine, prompt, 16)
            t0 = time.perf_counter()
            runs = [decode_rate(engine, prompt, a.tokens) for _ in range(3)]
            wall = time.perf_counter() - t0
            s = engine.stats()
            best = max(r for r, _ in runs)
            report[f"k{k}{variant}"] = {
                "tok_s": best, "speedup": best / report["no_spec_tok_s"],
                "same_tokens": all(t == reference for _, t in runs),
                "kept": s["spec_num_accepted_tokens"], "drafted": s["spec_num_draft_tokens"], "steps": s["steps"],
                "wall_s_3_runs": round(wall, 3),
                "target_runner_s": {n: round(v, 3) for n, v in engine.runner.seconds.items()},
                "draft_runner_s": ({n: round(v, 3) for n, v in draft_runner.seconds.items()}
                                   if draft_runner is not None else None),
                "chain_rounds": getattr(engine.speculator.proposer, "chain_rounds", 0),
                "lone_rounds": s["lone_chain_rounds"], **calls}
            report[f"k{k}{variant}"]["first_token_ms"] = first_token_ms(engine, prompt)
            if a.profile and variant == "":
                prof = cProfile.Profile()
                prof.enable()
                decode_rate(engine, prompt, a.tokens)
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(a.profile)
                print(f"== profile k={k}\n{out.getvalue()}", file=sys.stderr)
            del engine
    print(json.dumps(report))


if __name__ == "__main__":
    main()
