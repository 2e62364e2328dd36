"""`vtool run`: one prompt, one completion (or N with --repeat), like vllm-cli.

It drives the same engine as the server, so stop ids, detokenization and sampling
behave identically in both.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from vtool.runtime.weights.checkpoint import Checkpoint
from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.session import open_session


@dataclasses.dataclass(frozen=True)
class RunOptions:
    prompt: str
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stream: bool = False
    repeat: int = 1
    chat: bool = False
    tokenizer_config: str | None = None
    max_model_len: int | None = None
    # a grammar the output follows (vLLM's structured_outputs fields, e.g. {"regex": R})
    structured_outputs: dict | None = None


@dataclasses.dataclass
class RunStats:
    prompt_tokens: int
    tokens: int
    finish_reason: str | None
    ttft_seconds: float
    decode_seconds: float

    @property
    def decode_tokens_per_second(self) -> float:
        return (self.tokens - 1) / self.decode_seconds if self.tokens > 1 and self.decode_seconds > 0 else 0.0


def run_once(engine: Engine, request_id: str, prompt_ids: list[int], params: SamplingParams,
             on_text=None) -> tuple[str, RunStats]:
    start = time.perf_counter()
    engine.add_request(request_id, prompt_ids, params)
    text, tokens, first, last, finish = "", 0, None, start, None
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            first = first or now
            last = now
            tokens += len(out.new_token_ids)
            text += out.new_text
            if on_text and out.new_text:
                on_text(out.new_text)
            finish = out.finish_reason or finish
    return text, RunStats(len(prompt_ids), tokens, finish, (first or start) - start, last - (first or start))


def _acceptance(before: dict, after: dict) -> str:
    """Speculative decoding's share of accepted drafts between two engine snapshots ('' without it),
    and whether its rounds ran with both models on their own caches (engine/lone_chain.py)."""
    drafts = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    if not drafts:
        return ""
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    steps = after["spec_num_drafts"] - before["spec_num_drafts"]
    own = after["lone_chain_rounds"] > before["lone_chain_rounds"]
    return (f"; drafts accepted {accepted}/{drafts} ({accepted / drafts:.0%}), "
            f"{1 + accepted / steps:.2f} tokens per verified step"
            f"{' (both models on their own caches)' if own else ''}")


def _lone_rounds(before: dict, after: dict) -> str:
    """The rounds decoded on the library's own cache between two engine snapshots
    (engine/lone_decode.py); '' when none ran."""
    rounds = after["lone_decode_rounds"] - before["lone_decode_rounds"]
    return f"; {rounds} rounds on the library's own cache" if rounds else ""


def run_completion(artifact: Path, checkpoint: Checkpoint, opts: RunOptions, out: Console, err: Console,
                   engine_config: EngineConfig | None = None) -> None:
    """engine_config: KV sizing (num_blocks, kv_memory_bytes, gpu_memory_utilization) and the
    like; one sequence at a time without prefix caching is imposed on it."""
    params = SamplingParams(temperature=max(opts.temperature, 0.0), top_p=opts.top_p, top_k=opts.top_k,
                            seed=opts.seed, max_tokens=opts.max_tokens if opts.max_tokens > 0 else None,
                            structured_outputs=opts.structured_outputs)
    # markup off: rich's markup loads its 1 MiB emoji table, resident for the rest of the run
    with Progress(TextColumn("loading weights", markup=False), BarColumn(),
                  TextColumn("{task.completed}/{task.total}", markup=False), console=err, transient=True) as bar:
        task = bar.add_task("load", total=None)
        session = open_session(artifact, checkpoint, opts.tokenizer_config, opts.max_model_len,
                               progress=lambda done, total: bar.update(task, completed=done, total=total))
    manifest = session.model.manifest
    err.print(f"[dim]loaded {checkpoint.path.name} ({manifest['target']['name']}, {manifest['dtype']}) "
              f"in {session.model.load_seconds:.1f} s[/]", highlight=False)
    # One sequence at a time; prefix caching would make repeats skip the prefill they measure.
    engine = Engine(session, dataclasses.replace(engine_config or EngineConfig(), max_num_seqs=1,
                                                 enable_prefix_caching=False))
    prompt_ids = session.encode_prompt(opts.prompt, chat=opts.chat)
    repeat = 1 if opts.stream else opts.repeat  # as vllm-cli: streaming runs once
    rates = []
    for i in range(repeat):
        def on_text(delta: str) -> None:
            out.print(delta, end="", highlight=False, markup=False, soft_wrap=True)

        before = engine.stats()
        text, stats = run_once(engine, f"run-{i}", prompt_ids, params, on_text if opts.stream else None)
        if opts.stream:
            out.print("", highlight=False)
        elif i == 0:
            out.print(text, highlight=False, markup=False, soft_wrap=True)
        rates.append(stats.decode_tokens_per_second)
        if i == 0:
            first_done = engine.stats()
        err.print(f"[dim]run {i + 1}: prompt {stats.prompt_tokens} tokens, first token {stats.ttft_seconds * 1e3:.0f} ms; "
                  f"{stats.tokens} tokens ({stats.finish_reason}), decode {stats.decode_tokens_per_second:.1f} tok/s"
                  f"{_acceptance(before, engine.stats())}{_lone_rounds(before, engine.stats())}[/]", highlight=False)
    if repeat > 1:
        warm = rates[1:]
        err.print(f"warm decode: {sum(warm) / len(warm):.1f} tok/s (mean of runs 2..{repeat})"
                  f"{_acceptance(first_done, engine.stats())}{_lone_rounds(first_done, engine.stats())}", highlight=False)
