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
from vtool.runtime.engine.draft_chain import ChainVerifier, DraftChain, chain_generate, has_chain_verify
from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.sampling.device import can_sample_on_device
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.session import Session, open_session


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


def chain_pair(engine: Engine, params: SamplingParams) -> tuple[ChainVerifier, DraftChain, int] | None:
    """The target's and the draft's own caches when this run can speculate through them (a greedy
    run with nothing that reads or edits the rows, a draft model of --speculative-config built with
    --draft-cache-len, a target built with it too); None: the engine's way."""
    spec = engine.speculator
    chain = getattr(spec.proposer, "chain", None) if spec is not None else None
    # the rows' argmax is all it computes: nothing may edit or read them (as a device draw), and
    # stop strings, a grammar, prompt logprobs and n > 1 need the engine
    if chain is None or not has_chain_verify(engine.model) or not params.greedy or not can_sample_on_device(params) \
            or params.structured_outputs or params.stop or params.prompt_logprobs is not None or params.n != 1:
        return None
    target = ChainVerifier(engine.model)
    return target, chain, min(spec.config.num_speculative_tokens, target.max_verify - 1)


def run_chain_once(session: Session, pair: tuple[ChainVerifier, DraftChain, int], request_id: str,
                   prompt_ids: list[int], params: SamplingParams, on_text=None) -> tuple[str, RunStats, dict] | None:
    """One greedy completion through the two caches (runtime/engine/draft_chain.py chain_generate):
    the target's greedy tokens, as the engine gives them; None when the sequence cannot fit them."""
    target, draft, k = pair
    budget = session.max_model_len - len(prompt_ids)
    max_tokens = min(params.max_tokens or budget, budget)
    if max_tokens < 1 or not target.fits(len(prompt_ids) + max_tokens - 1, 0) \
            or not draft.fits(len(prompt_ids) + max_tokens - 1, 1):
        return None
    stops = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else session.stop_ids)
    tokens: list[int] = []
    shown = ""

    def show(new: list[int]) -> None:
        nonlocal shown
        tokens.extend(new)
        text = session.tokenizer.decode(tokens[:-1] if tokens[-1] in stops else tokens,
                                        skip_special_tokens=params.skip_special_tokens)
        if on_text and text != shown and text.startswith(shown):
            on_text(text[len(shown):])
        shown = text

    start = time.perf_counter()
    first = target.verify(request_id, list(prompt_ids), [])[0]  # the prompt into the target's cache
    show([first])
    t_first = time.perf_counter()
    stats = {"rounds": 0, "drafted": 0, "accepted": 0}
    if first not in stops and max_tokens > 1:
        _, stats = chain_generate(target, draft, list(prompt_ids) + [first], max_tokens - 1, k, stops,
                                  request_id, on_tokens=show)
    finish = "stop" if tokens[-1] in stops else "length"
    return shown, RunStats(len(prompt_ids), len(tokens), finish, t_first - start, time.perf_counter() - t_first), stats


def _chain_acceptance(stats: dict) -> str:
    if not stats["drafted"]:
        return ""
    accepted, drafts, rounds = stats["accepted"], stats["drafted"], stats["rounds"]
    return (f"; drafts accepted {accepted}/{drafts} ({accepted / drafts:.0%}), "
            f"{1 + accepted / rounds:.2f} tokens per verified step (both models on their own caches)")


def _acceptance(before: dict, after: dict) -> str:
    """Speculative decoding's share of accepted drafts between two engine snapshots ('' without it)."""
    drafts = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    if not drafts:
        return ""
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    steps = after["spec_num_drafts"] - before["spec_num_drafts"]
    return (f"; drafts accepted {accepted}/{drafts} ({accepted / drafts:.0%}), "
            f"{1 + accepted / steps:.2f} tokens per verified step")


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
    # both models on their own caches when the libraries have them (docs/USAGE.md, speculative decoding)
    pair = chain_pair(engine, params)
    chain_warm = {"rounds": 0, "drafted": 0, "accepted": 0}  # runs 2.. through the two caches
    repeat = 1 if opts.stream else opts.repeat  # as vllm-cli: streaming runs once
    rates = []
    for i in range(repeat):
        def on_text(delta: str) -> None:
            out.print(delta, end="", highlight=False, markup=False, soft_wrap=True)

        before = engine.stats()
        chained = run_chain_once(session, pair, f"run-{i}", prompt_ids, params,
                                 on_text if opts.stream else None) if pair is not None else None
        if chained is not None:
            text, stats, chain_stats = chained
            if i:
                chain_warm = {key: chain_warm[key] + chain_stats[key] for key in chain_warm}
        else:
            text, stats = run_once(engine, f"run-{i}", prompt_ids, params, on_text if opts.stream else None)
        if opts.stream:
            out.print("", highlight=False)
        elif i == 0:
            out.print(text, highlight=False, markup=False, soft_wrap=True)
        rates.append(stats.decode_tokens_per_second)
        if i == 0:
            first_done = engine.stats()
        accepted = _chain_acceptance(chained[2]) if chained is not None else _acceptance(before, engine.stats())
        err.print(f"[dim]run {i + 1}: prompt {stats.prompt_tokens} tokens, first token {stats.ttft_seconds * 1e3:.0f} ms; "
                  f"{stats.tokens} tokens ({stats.finish_reason}), decode {stats.decode_tokens_per_second:.1f} tok/s"
                  f"{accepted}[/]", highlight=False)
    if repeat > 1:
        warm = rates[1:]
        overall = _chain_acceptance(chain_warm) if chained is not None else _acceptance(first_done, engine.stats())
        err.print(f"warm decode: {sum(warm) / len(warm):.1f} tok/s (mean of runs 2..{repeat}){overall}",
                  highlight=False)
