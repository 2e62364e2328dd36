"""The `vtool tune` display: a rich progress view over toolchain/tune.py's events."""
from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from vtool.toolchain.records import Bucket
from vtool.toolchain.tune import (Plan, Task, TuneEvents, TuneOptions, plan_kernels, plan_tasks, tune_build_plan,
                                  tune_model)
from vtool.toolchain.tune import recheck as recheck_records


def _us(x: float) -> str:
    return "-" if x == float("inf") else f"{x:,.1f} us"


def run_tune(model_path: Path, target: str, opts: TuneOptions, list_only: bool, console: Console, out: Console,
             recheck: bool = False) -> int:
    trials = opts.trials
    if recheck:
        with console.status("timing the records again") as status:
            changed = recheck_records(model_path, target, opts, lambda m: status.update(escape(m)))
        table = Table("task", "rule", "tuned", "speedup", "used")
        for label, old, new in changed:
            table.add_row(escape(label), _us(new.rule_us), _us(new.tuned_us), f"{new.rule_us / new.tuned_us:.2f}x",
                          ("yes" if new.use else "no") + (" (changed)" if new.use != old.use else ""))
        out.print(table)
        return 0
    if list_only:
        with console.status("extracting the kernels"):
            _target, mod = plan_kernels(tune_build_plan(model_path, target, opts.build_options()))
        plan = plan_tasks(mod, opts.pattern, opts.prefill_buckets, opts.decode_buckets)
        for task in plan.tasks:  # plain lines: labels are long, and scripts read them
            out.print(f"{task.label}  {task.hash}", highlight=False, soft_wrap=True, markup=False)
        for s in plan.skipped:
            out.print(f"[dim]skipped {s.kernel}: {s.why}[/]", highlight=False, soft_wrap=True)
        return 0

    results = Table("task", "rule", "tuned", "speedup", "trials", "applied")
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), console=console)
    state: dict[str, object] = {}

    def on_plan(plan: Plan) -> None:
        state["kernels"] = progress.add_task("tasks", total=len(plan.tasks), info=f"{len(plan.skipped)} kernels skipped")
        state["trials"] = progress.add_task("trials", total=trials, info="", visible=False)

    def on_task(_i: int, task: Task, n: int) -> None:
        state["t0"] = time.monotonic()
        state["task"] = task
        progress.update(state["trials"], description=escape(task.label), completed=0, total=n, visible=True,
                        info=f"rule {_us(task.rule_us)}")

    def on_trials(done: int, best_us: float) -> None:
        task = state["task"]
        progress.update(state["trials"], completed=done, info=f"best {_us(best_us)} (rule {_us(task.rule_us)})")

    def on_done(task: Task, bucket: Bucket | None, why: str) -> None:
        progress.advance(state["kernels"])
        if bucket is None:
            results.add_row(escape(task.label), _us(task.rule_us), "-", "-", "0", why)
            return
        speed = f"{bucket.rule_us / bucket.tuned_us:.2f}x" if bucket.tuned_us not in (0, float("inf")) else "-"
        verdict = "yes" if bucket.use else "no (rules win)" if bucket.trace is not None else \
            "no valid candidate (none passed MetaSchedule's checks)"
        results.add_row(escape(task.label), _us(bucket.rule_us), _us(bucket.tuned_us), speed, str(bucket.trials),
                        verdict + (f"; {why}" if why else ""))

    def message(msg: str) -> None:
        progress.console.print(f"[dim]{msg}[/]", highlight=False)

    events = TuneEvents(on_plan=on_plan, on_task=on_task, on_trials=on_trials, on_done=on_done, message=message)
    try:
        with progress:
            summary = tune_model(model_path, target, opts, events)
    except KeyboardInterrupt:
        out.print(results)
        console.print("[yellow]interrupted[/]: finished tasks keep their records; run the same command again to resume")
        return 130
    out.print(results)
    console.print(f"{summary['written']} records written to {summary['root']}; {summary['candidates']} candidates, "
                  f"{summary['candidates_per_minute']} candidates/minute", highlight=False)
    return 0
