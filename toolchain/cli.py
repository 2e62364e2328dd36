"""The `vtool` command (click + rich). Flags mirror vllm-cli / vLLM where they have a name."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import click
from rich.console import Console

from vtool import VtoolError, __version__

console = Console(stderr=True)
out = Console()


def _fail(err: Exception) -> None:
    console.print(f"[bold red]error:[/] {err}", highlight=False)
    sys.exit(2)


class VtoolGroup(click.Group):
    """Turns VtoolError (and the target table's refusals) into one clear line and exit 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except VtoolError as err:
            _fail(err)


@click.group(cls=VtoolGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vtool")
def main() -> None:
    """vtool: compile LLMs ahead of time with Apache TVM, then run and serve them."""


def resolve_model(model: str | None) -> Path:
    """--model, or the embedded default (SmolLM2-135M-Instruct Q4_1), fetched on first use."""
    if model:
        return Path(model)
    from vtool.runtime.default_model import default_model_path

    with console.status("fetching the default model (SmolLM2-135M-Instruct Q4_1, 98 MB)"):
        return default_model_path()


def build_with_progress(model_path: Path, target: str, dtype: str, output: str | None = None,
                        force: bool = False) -> Path:
    from vtool.toolchain.build import build_artifact

    with console.status("building") as status:
        def report(msg: str) -> None:
            status.update(msg)
            if msg.startswith(("built", "using cached")):
                console.print(f"[dim]{msg}[/]", highlight=False)

        return build_artifact(model_path, target, dtype, output=output, progress=report, force=force)


def _model_options(fn: Callable) -> Callable:
    fn = click.option("--dtype", default="float32", show_default=True,
                      type=click.Choice(["float32", "float16", "bfloat16"]), help="compute dtype")(fn)
    fn = click.option("--target", default="host", show_default=True,
                      help="target name (see `vtool targets`); host = best tier this CPU runs")(fn)
    fn = click.option("--model", default=None,
                      help="model folder (config.json + safetensors) or .gguf file; default: SmolLM2-135M-Instruct")(fn)
    return fn


@main.command()
@_model_options
@click.option("--output", default=None, help="artifact folder (default: the user build cache)")
@click.option("--force", is_flag=True, help="rebuild even when the cache has this build")
def build(model: str | None, target: str, dtype: str, output: str | None, force: bool) -> None:
    """Compile a model into an artifact folder (model.so + manifest.json)."""
    folder = build_with_progress(resolve_model(model), target, dtype, output, force)
    out.print(str(folder), highlight=False)


@main.command()
def targets() -> None:
    """List the target table: every name, its feature set and whether it builds here."""
    from rich.table import Table

    from vtool.targets import ROWS, lookup

    table = Table("target", "family", "features", "builds")
    host = lookup("host").name
    table.add_row("host", "x86", f"= {host} on this machine", "yes")
    for row in ROWS:
        table.add_row(row.name, row.family, ", ".join(row.features),
                      "yes" if row.buildable else f"no: {row.not_buildable_reason}")
    out.print(table)


@main.command()
@_model_options
@click.option("--prompt", default="The capital of France is", show_default=True, help="prompt text")
@click.option("--tokenizer-config", default=None, help="override tokenizer_config.json")
@click.option("--max-tokens", default=16, show_default=True, type=int, help="tokens to generate (<= 0: up to the context)")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="<= 0 means greedy")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int, help="0 means all")
@click.option("--seed", default=None, type=int, help="RNG seed for sampling")
@click.option("--stream", is_flag=True, help="print tokens as they are generated")
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(min=1),
              help="load once, run N times, report warm decode tok/s")
@click.option("--chat", is_flag=True, help="wrap the prompt in the model's chat template")
@click.option("--max-model-len", default=None, type=int, help="context length (default: model's, capped at 4096)")
def run(model: str | None, target: str, dtype: str, prompt: str, tokenizer_config: str | None, max_tokens: int,
        temperature: float, top_p: float, top_k: int, seed: int | None, stream: bool, repeat: int, chat: bool,
        max_model_len: int | None) -> None:
    """Generate text from a prompt (builds the model on first use)."""
    from vtool.runtime.checkpoint import open_checkpoint
    from vtool.runtime.run_cmd import RunOptions, run_completion

    model_path = resolve_model(model)
    checkpoint = open_checkpoint(model_path)
    artifact = build_with_progress(model_path, target, dtype)
    options = RunOptions(prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                         seed=seed, stream=stream, repeat=repeat, chat=chat, tokenizer_config=tokenizer_config,
                         max_model_len=max_model_len)
    run_completion(artifact, checkpoint, options, out, console)


@main.command()
@click.argument("tokenizer", type=click.Path(exists=True, dir_okay=True))
@click.argument("corpus", type=click.Path(exists=True, dir_okay=False))
def tokenize(tokenizer: str, corpus: str) -> None:
    """Tokenize CORPUS with TOKENIZER (tokenizer.json, a model folder, or model.gguf): counts and ids."""
    from vtool.runtime.tokenize_cmd import run_tokenize

    sys.exit(run_tokenize(tokenizer, corpus, out))


if __name__ == "__main__":
    main()
