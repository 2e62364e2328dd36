"""`vtool tune`: MetaSchedule over a model's kernels, writing tuning records.

1. Extract the fused TIR kernels exactly as the schedule pass sees them (the build's own
   pipeline, stopped before the schedules), so the record hashes match at build time.
2. Plan tasks: a kernel with symbolic extents is tuned per static bucket (prefill sequence
   lengths, batched-decode batch sizes: MetaSchedule refuses dynamic loop bounds); a static
   kernel is tuned as it is. Left out: kernels with scalar parameters (the KV cache's
   attention and copy kernels, rope's offset: loops bound by runtime values), kernels
   already scheduled by TVM's KV cache, and the quantized batch-1 GEMVs (hand-written
   int8 dot-product kernels replace those).
3. Time each task's rule schedule first (the symbolic rule kernel called at the bucket's
   sizes: what the build would run otherwise) and tune the slowest first, so a budget goes
   where the time is.
4. Tune each task (MetaSchedule; tune_measure.py's pool of build processes and in-process
   runner), time the best candidate with the same timer, and write the record at once: an
   interrupted run keeps every finished task, and a rerun skips tasks whose record already
   holds at least the requested trials.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vtool import VtoolError
from vtool.toolchain.families import family_named, family_of
from vtool.toolchain.plan import BuildOptions, BuildPlan
from vtool.toolchain.records import (Bucket, Record, RecordError, becomes_view, kernel_hash, read_record,
                                     record_path, records_root, shape_vars, specialize, tvm_version, write_record)

# Symbolic extents by name: batched decode's batch size (and the GPU sampler's batch of
# sequences), else a token count (prefill).
DECODE_VARS = ("batch_size", "sample_batch")
DEFAULT_PREFILL_BUCKETS = (32, 128)
DEFAULT_DECODE_BUCKETS = (4, 8)
# Kernels whose scheduling comes with them (TVM's KV cache) or is not ours to tune here.
_SKIP_NAMES = re.compile(r"(paged_kv|ragged_kv|tree_attn|kv_cache|copy_single_page|compact_kv|merge_state)")
# Hand-written kernels (TIR with LLVM intrinsics, nothing to search over).
_HAND_WRITTEN = re.compile(r"int8_(gemv|matmul)")


class TuneError(VtoolError):
    """A tuning request that cannot be carried out."""


@dataclass
class Task:
    kernel: str
    hash: str
    func: Any  # the symbolic kernel as the schedule pass sees it
    bindings: dict[str, int]
    rule_us: float = 0.0

    @property
    def label(self) -> str:
        b = ",".join(f"{k}={v}" for k, v in sorted(self.bindings.items()))
        return f"{self.kernel}[{b}]" if b else self.kernel


@dataclass
class Skipped:
    kernel: str
    why: str


@dataclass
class Plan:
    tasks: list[Task] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def tune_build_plan(model_path: str | Path, target_name: str, options: BuildOptions,
                    progress: Callable[[str], None] | None = None) -> BuildPlan:
    """The BuildPlan `vtool build` would resolve for these options, without tuning records
    (tuning measures against the rules) and without the external tools (no nvcc needed
    to extract a CUDA build's kernels)."""
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.toolchain.plan import check_request, resolve_plan

    options = dataclasses.replace(options, records=False)
    spec = check_request(target_name, options)
    return resolve_plan(open_checkpoint(model_path), spec, options, notice=progress, tools=False)


def plan_kernels(plan: BuildPlan, progress: Callable[[str], None] | None = None):
    """(tvm target, IRModule of the model after legalize + fuse) for a plan: the same module
    as the build (toolchain/build.model_module), the same pipeline up to the schedule pass,
    under the same PassContext. Any difference would change the kernels' structural hashes,
    and a build would find no record for them."""
    from vtool.toolchain.build import model_module
    from vtool.toolchain.pipeline import build_pipeline

    progress = progress or (lambda _m: None)
    family = plan.family
    if family.tensor_intrinsics:  # its rules import TVM's tensor intrinsics: parse them the light way
        from vtool.schedules.cuda.tensor_intrinsics import preload_tensor_intrinsics

        preload_tensor_intrinsics()
    target, mod, _params, _eps = model_module(plan.config, plan.target, plan.dtype, progress, dict(plan.kept),
                                              plan.attention, plan.activations, plan.gemm)
    progress(f"extracting the kernels (gemm {plan.gemm}, attention {plan.attention}, activations {plan.activations})")
    with target, family.pass_context(plan.dtype):
        mod = build_pipeline(target, family.name, plan.gemm, until_schedules=True)(mod)
    return target, mod


def extract_kernels(model_path: str | Path, target_name: str, dtype: str = "float32",
                    quantization: str = "auto", progress: Callable[[str], None] | None = None,
                    gemm: str = "auto", attention: str = "auto", activations: str = "auto"):
    """(target spec, tvm target, IRModule of the model after legalize + fuse), made as
    `vtool build` with the same choices makes it: the choices resolved into the build's
    own BuildPlan (toolchain/plan.py), then `plan_kernels`."""
    options = BuildOptions(dtype=dtype, quantization=quantization, activations=activations, gemm=gemm,
                           attention=attention)
    plan = tune_build_plan(model_path, target_name, options, progress)
    target, mod = plan_kernels(plan, progress)
    return plan.target, target, mod


def matches(name: str, pattern: str) -> bool:
    """`pattern`: globs separated by commas; a name matching any of them is selected."""
    return any(fnmatch.fnmatch(name, p.strip()) for p in pattern.split(",") if p.strip())


def _is_batch1_qgemv(func: Any) -> bool:
    return "vtool_qmatmul" in func.script() and not shape_vars(func)


def plan_tasks(mod: Any, pattern: str | None = None, prefill_buckets: tuple[int, ...] = DEFAULT_PREFILL_BUCKETS,
               decode_buckets: tuple[int, ...] = DEFAULT_DECODE_BUCKETS) -> Plan:
    from tvm import tirx

    plan = Plan()
    seen: set[str] = set()
    for gv, func in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint):
        if not isinstance(func, tirx.PrimFunc):
            continue
        name = gv.name_hint
        if pattern and not matches(name, pattern):
            continue
        if _SKIP_NAMES.search(name):
            plan.skipped.append(Skipped(name, "KV-cache kernel (TVM schedules it)"))
            continue
        if any(not isinstance(p.ty, tirx.BufferType) for p in func.params):
            plan.skipped.append(Skipped(name, "scalar parameter (loops bound by a runtime value)"))
            continue
        if becomes_view(func):
            plan.skipped.append(Skipped(name, "a reshape (the build makes it a view: no kernel runs)"))
            continue
        if _HAND_WRITTEN.search(name) or _is_batch1_qgemv(func):
            plan.skipped.append(Skipped(name, "quantized int8 kernel or batch-1 GEMV (hand-written kernels)"))
            continue
        if any(str(p.ty.dtype) in ("int32", "int64") for p in func.params):
            # token ids or positions: MetaSchedule fills inputs with random values, and a
            # gather at random indices reads out of bounds (the in-process runner would crash)
            plan.skipped.append(Skipped(name, "index input (random measurement data would read out of bounds)"))
            continue
        khash = kernel_hash(func)
        if khash in seen:
            continue
        seen.add(khash)
        svars = shape_vars(func)
        if len(svars) > 1:
            plan.skipped.append(Skipped(name, f"more than one symbolic extent ({', '.join(sorted(svars))})"))
            continue
        if not svars:
            plan.tasks.append(Task(name, khash, func, {}))
            continue
        (var,) = svars
        for size in decode_buckets if var in DECODE_VARS else prefill_buckets:
            plan.tasks.append(Task(name, khash, func, {var: int(size)}))
    return plan


def rule_schedule(func: Any, target: Any, family: str, name: str) -> Any:
    """`func` scheduled by the family's rules (what a build without records runs). `name`
    is the kernel's own: some rules pick kernels by name (fused_NT_matmul*)."""
    import tvm

    with target:
        mod = family_named(family).rules()(tvm.IRModule({name: func}))
    return mod[name]


@dataclass
class TuneEvents:
    """What the progress display hears."""
    on_plan: Callable[[Plan], None] = lambda _p: None
    on_task: Callable[[int, Task, int], None] = lambda _i, _t, _n: None  # index, task, trials
    on_trials: Callable[[int, float], None] = lambda _done, _best_us: None
    on_done: Callable[[Task, Bucket | None, str], None] = lambda _t, _b, _why: None
    message: Callable[[str], None] = lambda _m: None


@dataclass
class TuneOptions:
    trials: int = 64
    budget_minutes: float | None = None
    pattern: str | None = None
    prefill_buckets: tuple[int, ...] = DEFAULT_PREFILL_BUCKETS
    decode_buckets: tuple[int, ...] = DEFAULT_DECODE_BUCKETS
    output: Path | None = None  # the records root (default: the package's tuning_logs)
    force: bool = False
    dtype: str = "float32"
    quantization: str = "auto"
    gemm: str = "auto"
    attention: str = "auto"
    activations: str = "auto"
    hf_overrides: str = ""  # --hf-overrides, as the build's: config fields decide kernels (eps, rope, shapes)
    seed: int = 0

    def build_options(self) -> BuildOptions:
        """The build options whose kernels are tuned (records never apply while tuning)."""
        return BuildOptions(dtype=self.dtype, quantization=self.quantization, activations=self.activations,
                            gemm=self.gemm, attention=self.attention, records=False, hf_overrides=self.hf_overrides)


def _mcpu_target(target: Any) -> Any:
    """MetaSchedule needs the core count in a CPU target (num-cores) for its parallel rules."""
    import tvm

    if target.kind.name != "llvm":
        return target
    cfg = dict(target.export())
    cfg["num-cores"] = len(os.sched_getaffinity(0))
    return tvm.target.Target(cfg)


def same_threads_as_runtime() -> int:
    """Candidates and rule kernels must run on as many threads as `vtool run` gives the
    kernels (the physical cores, or --threads / VTOOL_CPU_THREADS): TVM's own default is
    one thread on a 2-core x86 machine, and a kernel tuned for one thread can be several
    times slower on two. TVM's thread pool reads the count at its first parallel kernel."""
    from vtool.runtime.artifact.tvm_runtime import apply_cpu_threads

    return apply_cpu_threads(None)


def tune_model(model_path: str | Path, target_name: str, opts: TuneOptions,
               events: TuneEvents | None = None) -> dict[str, Any]:
    """Tune, write records; returns a summary (tasks, records written, candidates/minute)."""
    events = events or TuneEvents()
    same_threads_as_runtime()
    import importlib.util

    if importlib.util.find_spec("xgboost") is None:  # MetaSchedule's cost model
        raise TuneError("vtool tune needs XGBoost for MetaSchedule's cost model: pip install 'vtool[tune]'")
    root = opts.output or records_root()
    _check_device(target_name, opts.build_options())
    build = tune_build_plan(model_path, target_name, opts.build_options(), events.message)
    spec = build.target
    target, mod = plan_kernels(build, events.message)
    plan = plan_tasks(mod, opts.pattern, opts.prefill_buckets, opts.decode_buckets)
    if not plan.tasks:
        raise TuneError(f"no tunable kernel matches {opts.pattern!r}" if opts.pattern else "no tunable kernel")
    from vtool.toolchain.tune_measure import make_builder, tensor_intrinsics_for

    with tensor_intrinsics_for(target):
        # forked before anything is timed (no GPU context yet), and once for the whole run
        builder = make_builder(build_workers())
        try:
            return _tune_plan(plan, spec, target, root, opts, events, builder)
        finally:
            builder.close()


def _check_device(target_name: str, options: BuildOptions) -> None:
    """Candidates are timed on the family's device: a GPU target needs its GPU here (a CPU
    target is this machine, which `buildable` has checked)."""
    import tvm

    from vtool.toolchain.plan import check_request

    spec = check_request(target_name, options)
    device = family_of(spec).device
    if device != "cpu" and not tvm.runtime.device(device, 0).exist:
        raise TuneError(f"tuning for {spec.name} times candidates on its GPU, and this machine has no {device} device; "
                        f"run `vtool tune` on a machine with the GPU and copy the records into "
                        f"tuning_logs/{spec.name}/ (docs/USAGE.md)")


def build_workers() -> int:
    """Processes that compile candidates: the cores this process may run on. A record does
    not depend on how many compiled it (candidates are timed one at a time)."""
    return len(os.sched_getaffinity(0))


def _tune_plan(plan: Plan, spec: Any, target: Any, root: Path, opts: TuneOptions, events: TuneEvents,
               builder: Any) -> dict[str, Any]:
    from vtool.toolchain.tune_measure import time_kernel

    events.message(f"timing the rule schedules of {len(plan.tasks)} tasks")
    rules: dict[str, Any] = {}
    for task in plan.tasks:
        done = _finished(root, spec.name, task, opts)
        if done is not None:  # resumed: its record's rule time, no need to measure again
            task.rule_us = done.rule_us
            continue
        if task.hash not in rules:
            rules[task.hash] = rule_schedule(task.func, target, spec.family, task.kernel)
        task.rule_us = time_kernel(rules[task.hash], target, task.bindings)
    floor = family_of(spec).min_rule_us
    small = [t for t in plan.tasks if t.rule_us < floor]
    plan.skipped += [Skipped(t.label, f"rule schedule takes {t.rule_us:.1f} us (< {floor:g})") for t in small]
    plan.tasks = sorted((t for t in plan.tasks if t.rule_us >= floor), key=lambda t: -t.rule_us)
    # (the slowest first: a budget goes where the time is)
    events.on_plan(plan)

    deadline = time.monotonic() + opts.budget_minutes * 60 if opts.budget_minutes else None
    t_start, candidates, written = time.monotonic(), 0, 0
    for i, task in enumerate(plan.tasks):
        if deadline is not None and time.monotonic() > deadline:
            events.on_done(task, None, "budget spent")
            continue
        done = _finished(root, spec.name, task, opts)
        if done is not None:
            events.on_done(task, done, "record exists (resumed)")
            continue
        rec = _existing(root, spec.name, task, target_name=spec.name)
        events.on_task(i, task, opts.trials)
        if task.hash not in rules:
            rules[task.hash] = rule_schedule(task.func, target, spec.family, task.kernel)
        bucket, n = _tune_task(task, rules[task.hash], target, opts, events, builder)
        candidates += n
        if rec is None:
            rec = Record(task.kernel, task.hash, spec.name, dict(spec.tvm), tvm_version())
        rec.put(bucket)
        write_record(root, rec)
        written += 1
        events.on_done(task, bucket, "")
    minutes = (time.monotonic() - t_start) / 60
    return {"tasks": len(plan.tasks), "written": written, "candidates": candidates,
            "candidates_per_minute": round(candidates / minutes, 1) if minutes > 0 and candidates else 0.0,
            "root": str(root / spec.name), "skipped": [(s.kernel, s.why) for s in plan.skipped]}


def _finished(root: Path, target: str, task: Task, opts: TuneOptions) -> Bucket | None:
    """The task's bucket when its record already holds the requested trials (and no --force)."""
    rec = None if opts.force else _existing(root, target, task, target_name=target)
    old = rec.bucket(task.bindings) if rec else None
    return old if old is not None and old.requested >= opts.trials else None


def _existing(root: Path, target: str, task: Task, target_name: str) -> Record | None:
    path = record_path(root, target, task.hash)
    if not path.exists():
        return None
    try:
        rec = read_record(path)
    except RecordError:
        return None  # rewritten below
    if rec.target != target_name or rec.tvm != tvm_version():
        return None  # a stale record is replaced, not extended
    return rec


def _tune_task(task: Task, rule: Any, target: Any, opts: TuneOptions, events: TuneEvents,
               builder: Any) -> tuple[Bucket, int]:
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from vtool.toolchain.tune_measure import make_runner

    static = specialize(task.func, task.bindings).with_attr("global_symbol", "main")
    mod = tvm.IRModule({"main": static})
    ms_target = _mcpu_target(target)
    progress = _progress_callback(events)
    # a batch per iteration that keeps every build worker busy
    per_iter = max(1, min(max(16, 2 * build_workers()), opts.trials))
    strategy = ms.search_strategy.EvolutionarySearch(population_size=max(64, 2 * per_iter), init_min_unmeasured=16,
                                                     genetic_num_iters=2)
    # MetaSchedule's console handler takes the level its logger has before the run: keep its
    # per-iteration reports in the work folder's log files, off the progress display.
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="vtool-ms-") as work_dir:
        db = ms.tune_tir(mod, ms_target, work_dir, max_trials_global=opts.trials, num_trials_per_iter=per_iter,
                         builder=builder, runner=make_runner(), database="memory", strategy=strategy,
                         space=_space(ms_target),
                         measure_callbacks=ms.measure_callback.MeasureCallback.create("default") + [progress],
                         seed=opts.seed, num_tuning_cores=len(os.sched_getaffinity(0)))
        sch = ms.tir_integration.compile_tir(db, mod, ms_target)
    n = progress.count
    if sch is None:  # no candidate built and ran
        return Bucket(task.bindings, None, float("inf"), task.rule_us, n, False, opts.trials), n
    trace = json.loads(json.dumps(_plain(sch.trace.as_json(remove_postproc=False))))
    return decide(task, rule, trace, target, n, opts.trials), n


# A tuned kernel is used only when it beats the rule schedule by this margin (timings on a
# shared machine scatter by a few percent even when taken alternately).
MARGIN = 0.95


def decide(task: Task, rule: Any, trace: Any, target: Any, trials: int, requested: int) -> Bucket:
    """The bucket for `trace`: the rule kernel (as a build runs it: the symbolic kernel at the
    bucket's sizes) and the traced kernel timed alternately, and used only if it wins."""
    from vtool.toolchain.records import apply_trace
    from vtool.toolchain.tune_measure import compare

    tuned = apply_trace(specialize(task.func, task.bindings), trace)
    rule_us, tuned_us = compare(rule, tuned, target, task.bindings)
    return Bucket(task.bindings, trace, tuned_us, rule_us, trials, tuned_us < MARGIN * rule_us, requested)


def recheck(model_path: str | Path, target_name: str, opts: TuneOptions,
            message: Callable[[str], None] = lambda _m: None) -> list[tuple[str, Bucket, Bucket]]:
    """Time every record of the model's kernels again, rule and tuned alternately, and
    rewrite `rule_us`, `tuned_us` and `use`: [(task label, old bucket, new bucket)]."""
    same_threads_as_runtime()
    root = opts.output or records_root()
    build = tune_build_plan(model_path, target_name, opts.build_options(), message)
    spec = build.target
    target, mod = plan_kernels(build, message)
    plan = plan_tasks(mod, opts.pattern, (), ())
    changed = []
    by_hash = {t.hash: t for t in plan.tasks}
    from tvm import tirx

    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        khash = kernel_hash(func)
        rec = _existing(root, spec.name, Task(gv.name_hint, khash, func, {}), spec.name)
        if rec is None or (opts.pattern and khash not in by_hash and not matches(gv.name_hint, opts.pattern)):
            continue
        rule = rule_schedule(func, target, spec.family, gv.name_hint)
        for old in list(rec.buckets):
            if old.trace is None:
                continue
            task = Task(gv.name_hint, khash, func, old.bindings)
            message(f"timing {task.label}")
            new = decide(task, rule, old.trace, target, old.trials, old.requested)
            rec.put(new)
            changed.append((task.label, old, new))
        write_record(root, rec)
    return changed


# MetaSchedule's default CPU unroll choices go up to 512 explicitly unrolled steps; LLVM
# then compiles one candidate for tens of seconds on a 2-core machine (a main cause of the
# ~20 s per candidate), and such unrolling has not won on these kernels. Cap it at 64.
UNROLL_STEPS = (0, 16, 64)


def _space(target: Any) -> Any:
    from tvm.s_tir import meta_schedule as ms

    if target.kind.name != "llvm":
        return "post-order-apply"
    rules = []
    for rule in ms.ScheduleRule.create("llvm"):
        if type(rule).__name__ == "ParallelizeVectorizeUnroll":
            rule = ms.schedule_rule.ParallelizeVectorizeUnroll(max_jobs_per_core=16, max_vectorize_extent=64,
                                                               unroll_max_steps=list(UNROLL_STEPS),
                                                               unroll_explicit=True)
        rules.append(rule)
    return ms.space_generator.PostOrderApply(sch_rules=rules, postprocs="llvm", mutator_probs="llvm")


def _plain(obj: Any) -> Any:
    """A trace's JSON (TVM containers, ints, strings) as plain Python."""
    import tvm

    if isinstance(obj, (str, bool)) or obj is None:
        return str(obj) if not isinstance(obj, (bool, type(None))) else obj
    if isinstance(obj, (int, float)):
        return obj
    if isinstance(obj, tvm.tirx.IntImm):
        return int(obj.value)
    if isinstance(obj, tvm.tirx.FloatImm):
        return float(obj.value)
    if hasattr(obj, "items"):
        return {str(k): _plain(v) for k, v in obj.items()}
    try:
        return [_plain(x) for x in obj]
    except TypeError:
        return str(obj)


def _progress_callback(events: TuneEvents):
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
    from tvm.ir.utils import derived_object

    @derived_object
    class _Progress(PyMeasureCallback):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0
            self.best = float("inf")

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:  # noqa: ANN001
            for res in runner_results:
                self.count += 1
                if res.error_msg is None and res.run_secs:
                    us = min(float(s) for s in res.run_secs) * 1e6
                    self.best = min(self.best, us)
            events.on_trials(self.count, self.best)

    return _Progress()
