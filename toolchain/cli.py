"""The full `vtool` command: the runtime's commands (vtool.runtime.cli: run, serve, bench,
tokenize) plus the compiler's (build, tune, targets, dist). Loading this module registers
the builder that lets run/serve/bench compile a model on first use."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import click

from vtool.runtime.cli import (activations_option, console, hf_overrides_option, main, model_options, out,
                               quantization_option, register_builder, resolve_model)
from vtool.toolchain.dist_cli import dist


def build_with_progress(model_path: Path, target: str, dtype: str, output: str | None = None,
                        force: bool = False, gemm: str = "auto", quantization: str = "auto",
                        attention: str = "auto", activations: str = "auto", cuda_graph_sizes: str = "auto",
                        hf_overrides: str = "", draft_cache_len: int = 0) -> Path:
    """Build with vtool's own progress line; what TVM's C++ side prints while compiling goes to
    a log file (named on failure) instead of the terminal."""
    from vtool.toolchain.build import build_artifact
    from vtool.toolchain.native_log import native_output_to_log

    from rich.text import Text

    with native_output_to_log("build") as (terminal, log_path):
        # Text, not str: a str goes through rich's markup, which loads its 1 MiB emoji table into a
        # `vtool run` that only looks its build up in the cache (issue 16)
        with terminal.status(Text("building")) as status:
            def report(msg: str) -> None:
                status.update(Text(msg))
                if msg.startswith(("built", "using cached", "tuning")):  # "tuning ...": records used / ignored
                    terminal.print(f"[dim]{msg}[/]", highlight=False)

            def note(msg: str) -> None:  # why an auto choice fell back: kept on the terminal, not a status line
                terminal.print(Text.assemble(("note: ", "yellow"), msg), highlight=False)

            return build_artifact(model_path, target, dtype, output=output, progress=report, force=force, gemm=gemm,
                                  quantization=quantization, attention=attention, activations=activations,
                                  cuda_graph_sizes=cuda_graph_sizes, hf_overrides=hf_overrides,
                                  draft_cache_len=draft_cache_len, notice=note)


def _builder(model_path: Path, target: str, dtype: str, *, quantization: str = "auto",
             activations: str = "auto", hf_overrides: str = "", draft_cache_len: int = 0) -> Path:
    return build_with_progress(model_path, target, dtype, quantization=quantization, activations=activations,
                               hf_overrides=hf_overrides, draft_cache_len=draft_cache_len)


register_builder(_builder)


def _gemm_option(fn: Callable) -> Callable:
    return click.option(
        "--gemm", default="auto", show_default=True, type=click.Choice(["auto", "tir", "cublas"]),
        help="CUDA: kernels for the prefill and batched-decode matmuls (auto = cuBLAS for bf16/f16, "
             "vtool's TIR kernels for float32); batch-1 decode always uses vtool's GEMV kernels")(fn)


def _attention_option(fn: Callable) -> Callable:
    return click.option(
        "--attention", default="auto", show_default=True, type=click.Choice(["auto", "tir", "flashinfer"]),
        help="CUDA: kernels for paged prefill/decode attention (flashinfer: FlashInfer's, compiled "
             "ahead of time, needs flashinfer-python at build time, see toolchain/flashinfer_attention.py; "
             "auto: flashinfer when a fitting one is importable and the model's shape suits it, else tir)")(fn)


@main.command()
@model_options
@click.option("--output", default=None, help="artifact folder (default: the user build cache)")
@click.option("--force", is_flag=True, help="rebuild even when the cache has this build")
@_gemm_option
@_attention_option
@quantization_option
@activations_option
@click.option("--cuda-graph-sizes", "cuda_graph_sizes", default="auto", show_default=True,
              help="CUDA: batch sizes at which batched decode runs from CUDA graphs, e.g. 1,2,4,8,16 (a step is "
                   "padded up to the next; larger batches run uncaptured); auto = 1,2,4,8,16,24,32,48,64,96,128; "
                   "none = batched decode uncaptured")
@click.option("--draft-cache-len", "draft_cache_len", default=0, show_default=True, type=click.IntRange(min=0),
              help="for a model that will serve as a speculative draft: positions of a draft cache of its own, "
                   "through which it drafts every token with no host work between them (a CUDA graph a token); "
                   "at most 8192 on CUDA; 0 = none (the draft then runs as the engine runs a model)")
@hf_overrides_option
def build(model: str | None, revision: str | None, target: str, dtype: str, output: str | None, force: bool, gemm: str,
          attention: str, quantization: str, activations: str, cuda_graph_sizes: str, draft_cache_len: int,
          hf_overrides: str | None) -> None:
    """Compile a model into an artifact folder (model.so + manifest.json)."""
    folder = build_with_progress(resolve_model(model, revision), target, dtype, output, force, gemm, quantization, attention,
                                 activations, cuda_graph_sizes, hf_overrides or "", draft_cache_len)
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


def _bucket_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected a comma list of sizes, got {value!r}") from None
    if any(x < 1 for x in sizes):
        raise click.BadParameter(f"sizes must be >= 1, got {value!r}")
    return sizes


@main.command()
@model_options
@click.option("--trials", default=64, show_default=True, type=click.IntRange(min=1),
              help="MetaSchedule candidates measured per task (kernel x bucket)")
@click.option("--budget-minutes", default=None, type=click.FloatRange(min=0, min_open=True),
              help="stop starting new tasks after this long (the slowest kernels are tuned first)")
@click.option("--kernels", "pattern", default=None, help="only kernels whose name matches this glob (e.g. 'q4_1_matmul*')")
@click.option("--prefill-buckets", default="32,128", show_default=True, callback=_bucket_list,
              help="token counts a symbolic-length kernel is tuned at")
@click.option("--decode-buckets", default="4,8", show_default=True, callback=_bucket_list,
              help="batch sizes a batched-decode kernel is tuned at")
@click.option("--output", default=None, type=click.Path(file_okay=False),
              help="records root (default: the package's tuning_logs/, or $VTOOL_TUNING_LOGS); records go in <root>/<target>/")
@click.option("--force", is_flag=True, help="tune again tasks that already have a record with enough trials")
@click.option("--list", "list_only", is_flag=True, help="list the tasks and the skipped kernels, tune nothing")
@click.option("--recheck", is_flag=True, help="tune nothing: time the existing records' kernels again against the "
                                              "rules (alternately) and rewrite which ones a build uses")
@_gemm_option
@_attention_option
@quantization_option
@activations_option
@hf_overrides_option
def tune(model: str | None, revision: str | None, target: str, dtype: str, trials: int, budget_minutes: float | None, pattern: str | None,
         prefill_buckets: tuple[int, ...], decode_buckets: tuple[int, ...], output: str | None, force: bool,
         list_only: bool, recheck: bool, gemm: str, attention: str, quantization: str, activations: str,
         hf_overrides: str | None) -> None:
    """Tune the model's kernels with MetaSchedule and write tuning records (interrupt with
    Ctrl-C; a rerun resumes). `vtool build` applies the records for its target. Give the
    build's own --dtype/--gemm/--attention/--quantization/--activations/--hf-overrides: they
    decide which kernels exist, and a record applies only to the kernel it was tuned on."""
    from vtool.toolchain.tune import TuneOptions
    from vtool.toolchain.tune_cli import run_tune

    opts = TuneOptions(trials=trials, budget_minutes=budget_minutes, pattern=pattern, prefill_buckets=prefill_buckets,
                       decode_buckets=decode_buckets, output=Path(output) if output else None, force=force,
                       dtype=dtype, quantization=quantization, gemm=gemm, attention=attention,
                       activations=activations, hf_overrides=hf_overrides or "")
    sys.exit(run_tune(resolve_model(model, revision), target, opts, list_only, console, out, recheck))




main.add_command(dist)

if __name__ == "__main__":
    main()
