"""Building and timing MetaSchedule candidates in the tuning process itself.

MetaSchedule's LocalBuilder starts a fresh pool of worker processes for every batch of
candidates (a workaround for a worker memory leak), and each worker imports TVM, which
imports torch when it is installed: seconds per worker before the first build, and on a
busy 2-core machine each candidate took ~20 s, past LocalBuilder's 30 s timeout. Compiling
one TIR kernel takes well under a second, so here the builder compiles in this process
and the runner times in this process too (no worker start-up, no tar export/upload), which
is what makes tuning on a small machine practical. A candidate that fails to build or run
is reported as failed, as in MetaSchedule's own builder and runner.

With more than one core, candidates are compiled by a pool of worker processes forked
once at the start of a run (`PoolBuilder`): they share the already imported compiler, and
a GPU target's nvcc runs then overlap (16 at a time on the GPU machine).

`time_kernel` is the one timer for rule and tuned kernels, so the records compare them
under the same conditions. On a GPU each timed call starts with a cold L2 (a device copy
larger than the L2 runs before it, untimed): an H200's 60 MB L2 holds a whole decode
GEMV's weight, and a kernel timed over and over on it reads the weight from cache, which
the model's decode step never does.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import types
from typing import Any, Iterator

import numpy as np
import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, PyRunner
from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture
from tvm.s_tir.meta_schedule.runner.utils import alloc_argument_common, run_evaluator_common
from tvm.ir.utils import derived_object

EVALUATOR = EvaluatorConfig(number=3, repeat=1, min_repeat_ms=40, enable_cpu_cache_flush=False)
GPU_REPEATS = 40  # cold-L2 calls timed one by one (CUDA events); their median is the time
L2_FLUSH_BYTES = 256 << 20  # over 4x an H200's L2
_FLUSH_FUNC = "vtool.tune.flush_gpu_l2"
_flush_buffers: dict[str, tuple[Any, Any]] = {}


def _is_gpu(dev: Any) -> bool:
    return dev.dlpack_device_type() != tvm.runtime.cpu(0).dlpack_device_type()


def _flush_l2(*_args: Any) -> None:
    for src, dst in _flush_buffers.values():
        src.copyto(dst)


def _ensure_l2_flush(dev: Any) -> str:
    """The registered name of a function that evicts `dev`'s L2 (time_evaluator's f_preproc)."""
    key = str(dev)
    if key not in _flush_buffers:
        _flush_buffers.clear()  # one device per run
        _flush_buffers[key] = (tvm.runtime.empty((L2_FLUSH_BYTES,), "uint8", dev),
                               tvm.runtime.empty((L2_FLUSH_BYTES,), "uint8", dev))
        tvm.register_global_func(_FLUSH_FUNC, _flush_l2, override=True)
    return _FLUSH_FUNC


def _evaluator(rt_mod: Any, name: str, dev: Any, min_ms: int):  # noqa: ANN202 - time_evaluator's callable
    """CPU: `number` calls per sample over at least min_ms; GPU: one cold-L2 call per sample."""
    if _is_gpu(dev):
        return rt_mod.time_evaluator(name, dev, number=1, repeat=GPU_REPEATS, min_repeat_ms=0,
                                     f_preproc=_ensure_l2_flush(dev))
    return rt_mod.time_evaluator(name, dev, number=3, repeat=5, min_repeat_ms=int(min_ms))


def _compile(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.runtime.Module:
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    with target:  # TVM's nvcc callback reads the arch from the current target
        return tvm.tirx.build(mod, target=target)


@derived_object
class InProcessBuilder(PyBuilder):
    """Compiles each candidate here and exports it as a shared library in a scratch folder."""

    def __init__(self) -> None:
        super().__init__()
        self.scratch = tempfile.mkdtemp(prefix="vtool-tune-")

    def build(self, build_inputs: list) -> list:
        results = []
        for i, build_input in enumerate(build_inputs):
            try:
                rt_mod = _compile(build_input.mod, build_input.target)
                path = os.path.join(tempfile.mkdtemp(dir=self.scratch), f"cand{i}.so")
                rt_mod.export_library(path)
                results.append(BuilderResult(path, None))
            except Exception as err:  # noqa: BLE001 - a failed candidate is a result, not an abort
                results.append(BuilderResult(None, f"InProcessBuilder: {type(err).__name__}: {err}"))
        return results

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def _build_in_worker(mod_json: str, target_json: str, path: str) -> str | None:
    """A pool worker's build: None when `path` was written, else the error."""
    try:
        mod = tvm.ir.load_json(mod_json)
        _compile(mod, tvm.target.Target(json.loads(target_json))).export_library(path)
        return None
    except Exception as err:  # noqa: BLE001 - a failed candidate is a result, not an abort
        return f"PoolBuilder: {type(err).__name__}: {err}"


def _ready() -> int:
    return os.getpid()


@derived_object
class PoolBuilder(PyBuilder):
    """Compiles candidates in `workers` forked processes. They are forked at once, before
    this process times anything (a GPU context must not be inherited; the workers never
    touch the device: the target names its arch, and a CUDA module loads lazily)."""

    TIMEOUT_S = 300.0

    def __init__(self, workers: int) -> None:
        super().__init__()
        self.scratch = tempfile.mkdtemp(prefix="vtool-tune-")
        self.pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
        # with fork, the first submit starts every worker
        self.pool.submit(_ready).result()

    def build(self, build_inputs: list) -> list:
        futures = []
        for i, build_input in enumerate(build_inputs):
            path = os.path.join(tempfile.mkdtemp(dir=self.scratch), f"cand{i}.so")
            futures.append((path, self.pool.submit(_build_in_worker, tvm.ir.save_json(build_input.mod),
                                                   str(build_input.target), path)))
        results = []
        for path, future in futures:
            try:
                err = future.result(timeout=self.TIMEOUT_S)
            except concurrent.futures.TimeoutError:
                err = f"PoolBuilder: no result in {self.TIMEOUT_S:g} s"
            except Exception as exc:  # noqa: BLE001 - a worker that died
                err = f"PoolBuilder: {type(exc).__name__}: {exc}"
            results.append(BuilderResult(None, err) if err else BuilderResult(path, None))
        return results

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self.scratch, ignore_errors=True)


@derived_object
class InProcessRunner(PyRunner):
    """Loads each built candidate here and times it with TVM's time_evaluator."""

    def __init__(self, evaluator: EvaluatorConfig = EVALUATOR) -> None:
        super().__init__()
        self.evaluator = evaluator
        self.f_random_fill = tvm.get_global_func("tvm.contrib.random.random_fill_for_measure", allow_missing=True)

    def run(self, runner_inputs: list) -> list:
        futures = []
        for runner_input in runner_inputs:
            try:
                rt_mod = tvm.runtime.load_module(runner_input.artifact_path)
                dev = tvm.runtime.device(runner_input.device_type, 0)
                args_info = [a.as_json() for a in runner_input.args_info]
                args = alloc_argument_common(self.f_random_fill, dev, args_info, 1)
                if _is_gpu(dev):
                    costs = list(_evaluator(rt_mod, rt_mod.entry_name, dev, 0)(*args[0]).results)
                else:
                    costs = run_evaluator_common(rt_mod, dev, self.evaluator, args)
                futures.append(LocalRunnerFuture(res=costs))
            except Exception as err:  # noqa: BLE001
                futures.append(LocalRunnerFuture(error_message=f"InProcessRunner: {type(err).__name__}: {err}"))
        # (MetaSchedule's RemoveBuildArtifact callback deletes the built files afterwards)
        return futures


def _random_args(func: Any, bindings: dict[str, int], dev: Any) -> list[Any]:
    """Random inputs for `func`'s buffer parameters, symbolic extents set by `bindings`."""
    from tvm import tirx

    rng = np.random.default_rng(0)
    args = []
    for param in func.params:
        ty = param.ty
        if not isinstance(ty, tirx.BufferType):
            raise ValueError(f"scalar parameter {param.name}: not timed")
        shape = []
        for d in ty.shape:
            if isinstance(d, tirx.IntImm):
                shape.append(int(d))
            elif isinstance(d, tirx.Var) and d.name in bindings:
                shape.append(int(bindings[d.name]))
            else:
                raise ValueError(f"extent {d} of {param.name} is not bound")
        dtype = str(ty.dtype)
        if dtype.startswith(("int", "uint")):
            data = rng.integers(0, 16, size=shape).astype(dtype)
        else:
            data = (rng.standard_normal(size=shape) * 0.1).astype(dtype)
        args.append(tvm.runtime.tensor(data, dev))
    return args


def kernel_timer(func: Any, target: tvm.target.Target, bindings: dict[str, int] | None = None,
                 min_ms: int = 100):  # noqa: ANN201 - () -> float
    """Compiles `func` (a scheduled PrimFunc; symbolic extents take their values from
    `bindings`) once; the returned function gives the median microseconds of one call."""
    rt_mod = _compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    dev = tvm.runtime.cpu(0) if target.kind.name == "llvm" else tvm.runtime.device(target.kind.name, 0)
    args = _random_args(func, bindings or {}, dev)
    timer = _evaluator(rt_mod, "main", dev, min_ms)
    return lambda: float(np.median(timer(*args).results)) * 1e6


def time_kernel(func: Any, target: tvm.target.Target, bindings: dict[str, int] | None = None,
                min_ms: int = 100) -> float:
    """Median time in microseconds of one call of `func`."""
    return kernel_timer(func, target, bindings, min_ms)()


def compare(rule: Any, tuned: Any, target: tvm.target.Target, bindings: dict[str, int] | None = None,
            rounds: int = 3) -> tuple[float, float]:
    """(rule us, tuned us): each the best of `rounds` timings taken alternately, so a load
    spike on this shared machine hits both alike and a one-off measurement cannot decide."""
    t_rule, t_tuned = kernel_timer(rule, target, bindings), kernel_timer(tuned, target, bindings)
    pairs = [(t_rule(), t_tuned()) for _ in range(rounds)]
    return min(p[0] for p in pairs), min(p[1] for p in pairs)


def make_builder(workers: int) -> InProcessBuilder | PoolBuilder:
    """A pool of `workers` build processes, or this process alone when workers == 1."""
    return PoolBuilder(workers) if workers > 1 else InProcessBuilder()


def make_runner() -> InProcessRunner:
    return InProcessRunner()


@contextlib.contextmanager
def tensor_intrinsics_for(target: tvm.target.Target) -> Iterator[None]:
    """While the block runs: MetaSchedule's TuneContext imports tvm.s_tir.tensor_intrin,
    which parses hundreds of TVMScript intrinsics (GPU MMA/WMMA, ARM, Hexagon, ...): 40 s
    to minutes of CPU on a loaded 2-core machine, paid again by every LocalBuilder worker
    (its default_build imports them too). The CPU schedule rules used here never tensorize,
    so for an llvm target an empty module stands in for it (unless it was imported
    already), and is taken out again afterwards: a CUDA build later in the same process
    needs the real one. For a GPU they are parsed once, before the build workers fork."""
    name = "tvm.s_tir.tensor_intrin"
    if target.kind.name != "llvm":  # GPU rules may tensorize: load them, the light way the CUDA build does
        from vtool.schedules.cuda.tensor_intrinsics import preload_tensor_intrinsics

        preload_tensor_intrinsics()
    if target.kind.name != "llvm" or name in sys.modules:
        yield
        return
    stand_in = types.ModuleType(name, "not loaded: vtool tune's CPU rules do not tensorize")
    sys.modules[name] = stand_in
    try:
        yield
    finally:
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]
        if vars(tvm.s_tir).get("tensor_intrin") is stand_in:
            delattr(tvm.s_tir, "tensor_intrin")


__all__ = ["InProcessBuilder", "InProcessRunner", "PoolBuilder", "make_builder", "make_runner", "tensor_intrinsics_for",
           "compare", "kernel_timer", "time_kernel", "ms"]
