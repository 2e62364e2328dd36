"""`vtool run`: one prompt, one completion (or N with --repeat), like vllm-cli."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from vtool.runtime.checkpoint import Checkpoint
from vtool.runtime.sampler import SamplingConfig
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


def run_completion(artifact: Path, checkpoint: Checkpoint, opts: RunOptions, out: Console, err: Console) -> None:
    sampling = SamplingConfig(temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k, seed=opts.seed)
    with Progress(TextColumn("loading weights"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  console=err, transient=True) as bar:
        task = bar.add_task("load", total=None)
        session = open_session(artifact, checkpoint, opts.tokenizer_config, opts.max_model_len,
                               progress=lambda done, total: bar.update(task, completed=done, total=total))
    err.print(f"[dim]loaded {checkpoint.path.name} ({session.model.manifest['target']['name']}, "
              f"{session.model.manifest['dtype']}) in {session.model.load_seconds:.1f} s[/]", highlight=False)
    prompt_ids = session.encode_prompt(opts.prompt, chat=opts.chat)
    repeat = 1 if opts.stream else opts.repeat  # as vllm-cli: streaming runs once
    rates = []
    for i in range(repeat):
        detok = session.tokenizer.incremental(prompt_ids=prompt_ids)
        on_token = None
        if opts.stream:
            def on_token(token: int) -> None:
                if token not in session.stop_ids:
                    out.print(detok.push(token), end="", highlight=False, markup=False, soft_wrap=True)
        result = session.generator.generate(prompt_ids, opts.max_tokens, sampling, session.stop_ids, on_token)
        text_ids = [t for t in result.token_ids if t not in session.stop_ids]
        if opts.stream:
            out.print(detok.flush(), highlight=False, markup=False, soft_wrap=True)
        elif i == 0:
            out.print(session.tokenizer.decode(text_ids), highlight=False, markup=False, soft_wrap=True)
        rates.append(result.decode_tokens_per_second)
        err.print(f"[dim]run {i + 1}: prompt {len(prompt_ids)} tokens, prefill {result.prefill_seconds * 1e3:.0f} ms; "
                  f"{len(result.token_ids)} tokens ({result.finish_reason}), decode "
                  f"{result.decode_tokens_per_second:.1f} tok/s[/]", highlight=False)
    if repeat > 1:
        warm = rates[1:]
        err.print(f"warm decode: {sum(warm) / len(warm):.1f} tok/s (mean of runs 2..{repeat})", highlight=False)
