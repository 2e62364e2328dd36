"""Tuning records: MetaSchedule traces for vtool's fused TIR kernels, applied at build time.

A record file is tuning_logs/<target>/<hash>.json, one per kernel. The kernel is named by
the structural hash of its PrimFunc exactly as the schedule pass sees it (after legalize
+ fuse, before any schedule), so a record applies to that kernel in any model that has
it and to no other. A kernel with symbolic extents (prefill's sequence length, batched
decode's batch size) is tuned per static bucket: each bucket holds the bindings
({"seq_len": 128}), the trace tuned on the kernel specialized to them, and the times of
the tuned and the rule schedule measured side by side. At build time a bucketed kernel
becomes `if extent == bucket: <tuned> else: <rule schedule>`, so sizes outside every
bucket run the rule schedule unchanged. Only buckets whose tuned time beat the rules
("use": true) are applied.

A record is applied only when its target name, its TVM target and the TVM version all
equal the build's; any other record is reported (`notices`) and ignored. The file format
is the same for every target family: sm_90a records are made on a GPU machine by
`vtool tune --target sm_90a` and dropped into tuning_logs/sm_90a/.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vtool import VtoolError

FORMAT = 1
_PACKAGE_LOGS = Path(__file__).resolve().parent.parent / "tuning_logs"
ENV_ROOT = "VTOOL_TUNING_LOGS"  # another records root (tests, or trying records before shipping them)


class RecordError(VtoolError):
    """A record file that cannot be read or does not fit its kernel."""


def records_root() -> Path:
    env = os.environ.get(ENV_ROOT)
    return Path(env) if env else _PACKAGE_LOGS


def tvm_version() -> str:
    """TVM's version (tvm.__version__ is the distribution's), read without importing TVM:
    the import costs a cached `vtool run` about 200 MB of resident memory."""
    import importlib.metadata

    try:
        return importlib.metadata.version("apache-tvm")
    except importlib.metadata.PackageNotFoundError:  # a TVM built from source
        import tvm

        return str(tvm.__version__)


# --- kernels: their key, their symbolic extents, their static specializations ---------------

def kernel_hash(func: Any) -> str:
    """The kernel's key: its structural hash, without the symbol name (FuseTIR's names
    change when unrelated kernels are added; the body is what the trace was tuned on)."""
    import tvm_ffi

    if func.attrs is not None and "global_symbol" in func.attrs:
        func = func.without_attr("global_symbol")
    return f"{tvm_ffi.structural_hash(func, map_free_vars=True) & (2**64 - 1):016x}"


def shape_vars(func: Any) -> dict[str, Any]:
    """The symbolic extents that the kernel's buffer parameters are declared with
    (name -> tirx.Var): the dimensions a bucket binds."""
    from tvm import tirx

    found: dict[str, Any] = {}
    for param in func.params:
        ty = param.ty
        if not isinstance(ty, tirx.BufferType):
            continue
        for dim in ty.shape:
            if isinstance(dim, tirx.Var):
                found.setdefault(dim.name, dim)
            elif not isinstance(dim, tirx.IntImm):
                found.update({v.name: v for v in tirx.analysis.undefined_vars(dim) if v is not None})
    return found


def specialize(func: Any, bindings: dict[str, int]) -> Any:
    """`func` with its symbolic extents bound to `bindings` (name -> value); every buffer
    parameter keeps its name, and its static dimensions keep their objects (Specialize
    matches dimensions by identity)."""
    from tvm import tirx

    svars = shape_vars(func)
    unknown = set(bindings) - set(svars)
    if unknown:
        raise RecordError(f"bucket binds {sorted(unknown)}, but the kernel's symbolic extents are {sorted(svars)}")
    values = {svars[name]: tirx.IntImm(svars[name].ty.dtype, int(v)) for name, v in bindings.items()}
    param_map = {}
    for param in func.params:
        ty = param.ty
        if not isinstance(ty, tirx.BufferType) or not any(isinstance(d, tirx.Var) and d in values for d in ty.shape):
            continue
        shape = [values.get(d, d) if isinstance(d, tirx.Var) else d for d in ty.shape]
        param_map[param] = tirx.decl_buffer(shape, ty.dtype, param.name)
    return func.specialize(param_map) if param_map else func


def apply_trace(func: Any, trace_json: Any) -> Any:
    """`func` scheduled by replaying a MetaSchedule trace (as Trace.as_json gave it)."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    s_tir.schedule.Trace.apply_json_to_schedule(trace_json, sch)
    return sch.mod["main"]


def dispatch(func: Any, rule_func: Any, buckets: list[tuple[dict[str, int], Any]]) -> Any:
    """One kernel: the first bucket whose bindings equal the call's extents runs its tuned
    body, any other size runs the rule schedule's body. Each tuned body was specialized,
    so it reads its own static-shaped parameters; DeclBuffer binds them as views of the
    symbolic parameters' data. Both bodies go under one root block that allocates the
    scratch buffers of all of them (TIR lowers block allocations from the root only)."""
    from tvm import s_tir, tirx

    svars = shape_vars(func)
    rule_root = _root_block(rule_func)
    allocs = list(rule_root.alloc_buffers)
    body = rule_root.body
    for bindings, tuned in reversed(buckets):
        cond = None
        for name, value in sorted(bindings.items()):
            var = svars[name]
            term = var == tirx.IntImm(var.ty.dtype, int(value))
            cond = term if cond is None else tirx.And(cond, term)
        root = _root_block(tuned)
        # specialize keeps a static scratch buffer's Var: one allocation serves both branches
        allocs += [buf for buf in root.alloc_buffers if not any(buf.same_as(a) for a in allocs)]
        views = [tirx.DeclBuffer(static, data=symbolic.data)
                 for static, symbolic in zip(tuned.params, func.params) if not static.same_as(symbolic)]
        body = tirx.IfThenElse(cond, tirx.SeqStmt([*views, root.body]) if views else root.body, body)
    block = s_tir.stmt.SBlock([], [], [], "root", body, alloc_buffers=allocs, annotations=rule_root.annotations)
    return rule_func.with_body(s_tir.stmt.SBlockRealize([], True, block))


def _root_block(func: Any) -> Any:
    from tvm import s_tir

    realize = func.body
    if not isinstance(realize, s_tir.stmt.SBlockRealize) or realize.block.iter_vars:
        raise RecordError("a bucketed kernel needs a root block in both its rule and its tuned schedule")
    return realize.block


# --- record files ----------------------------------------------------------------------------

@dataclass
class Bucket:
    bindings: dict[str, int]
    trace: Any
    tuned_us: float
    rule_us: float
    trials: int  # candidates measured (a small design space can give fewer than requested)
    use: bool
    requested: int = 0  # the --trials of the run that made it (resuming compares against it)

    def to_json(self) -> dict[str, Any]:
        finite = 0 < self.tuned_us < float("inf")
        return {"bindings": self.bindings, "tuned_us": round(self.tuned_us, 3) if finite else None,
                "rule_us": round(self.rule_us, 3), "speedup": round(self.rule_us / self.tuned_us, 3) if finite else None,
                "trials": self.trials, "requested": max(self.requested, self.trials), "use": self.use,
                "trace": self.trace}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Bucket":
        tuned = d["tuned_us"]
        return cls({k: int(v) for k, v in d["bindings"].items()}, d["trace"],
                   float("inf") if tuned is None else float(tuned), float(d["rule_us"]), int(d["trials"]),
                   bool(d["use"]) and d["trace"] is not None, int(d.get("requested", d["trials"])))


@dataclass
class Record:
    kernel: str  # the kernel's name when it was tuned (for people; the hash is the key)
    hash: str
    target: str  # vtool target name
    tvm_target: dict[str, Any]
    tvm: str
    buckets: list[Bucket] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "kernel": self.kernel, "hash": self.hash, "target": self.target,
                "tvm_target": self.tvm_target, "tvm": self.tvm,
                "buckets": [b.to_json() for b in sorted(self.buckets, key=lambda b: sorted(b.bindings.items()))]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Record":
        if d.get("format") != FORMAT:
            raise RecordError(f"record format {d.get('format')!r}, this vtool reads {FORMAT}")
        return cls(d["kernel"], d["hash"], d["target"], dict(d["tvm_target"]), d["tvm"],
                   [Bucket.from_json(b) for b in d["buckets"]])

    def bucket(self, bindings: dict[str, int]) -> Bucket | None:
        return next((b for b in self.buckets if b.bindings == bindings), None)

    def put(self, bucket: Bucket) -> None:
        self.buckets = [b for b in self.buckets if b.bindings != bucket.bindings] + [bucket]


def record_path(root: Path, target: str, khash: str) -> Path:
    return root / target / f"{khash}.json"


def read_record(path: Path) -> Record:
    try:
        return Record.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RecordError(f"tuning record {path} is unreadable: {err}") from err


def write_record(root: Path, record: Record) -> Path:
    path = record_path(root, record.target, record.hash)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record.to_json(), indent=1, sort_keys=True) + "\n")
    tmp.replace(path)  # a record appears whole: an interrupted run leaves the previous one
    return path


# --- the build-time set ----------------------------------------------------------------------

@dataclass
class RecordSet:
    """The records that apply to one build, and what happened to them."""
    target: str
    by_hash: dict[str, Record]
    notices: list[str]
    digest: str  # of the applicable records (part of the build cache key)
    applied: dict[str, str] = field(default_factory=dict)  # kernel name -> "static" | bucket list
    kernels: int = 0  # PrimFuncs the schedule pass saw

    @classmethod
    def empty(cls, target_name: str) -> "RecordSet":
        """No records: a build whose plan applies none (BuildOptions.records=False)."""
        return cls(target_name, {}, [], "")

    @classmethod
    def load(cls, target_name: str, tvm_target: dict[str, Any], root: Path | None = None) -> "RecordSet":
        root = root or records_root()
        folder = root / target_name
        paths = sorted(folder.glob("*.json")) if folder.is_dir() else []
        version = tvm_version() if paths else ""
        by_hash: dict[str, Record] = {}
        notices: list[str] = []
        h = hashlib.sha256()
        for path in paths:
            try:
                rec = read_record(path)
            except RecordError as err:
                notices.append(f"{err}; ignored")
                continue
            why = _mismatch(rec, target_name, tvm_target, version)
            if why:
                notices.append(f"tuning record {path.name} ({rec.kernel}) is for {why}; ignored, not applied")
                continue
            if not any(b.use for b in rec.buckets):
                continue
            by_hash[rec.hash] = rec
            h.update(path.name.encode())
            h.update(path.read_bytes())
        return cls(target_name, by_hash, notices, h.hexdigest()[:16] if by_hash else "")

    def schedule_pass(self, rules: Any) -> Any:
        """Records first, then `rules` on the rest: a kernel with a record gets the traces
        (and, for buckets, the rule schedule as its fallback branch)."""
        import tvm
        from tvm import tirx

        @tvm.transform.module_pass(opt_level=0, name="VtoolTuningRecords")
        def _apply(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
            matched = {}
            self.kernels = 0
            for gv, func in mod.functions_items():
                if isinstance(func, tirx.PrimFunc):
                    self.kernels += 1
                    rec = None if becomes_view(func) else self.by_hash.get(kernel_hash(func))
                    if rec is not None:
                        matched[gv] = (func, rec)
            scheduled = rules(mod)
            for gv, (func, rec) in matched.items():
                scheduled[gv] = self._schedule(gv.name_hint, func, scheduled[gv], rec)
            return scheduled

        return _apply

    def _schedule(self, name: str, func: Any, rule_func: Any, rec: Record) -> Any:
        used = [b for b in rec.buckets if b.use]
        if any(not b.bindings for b in used):  # a static kernel: the trace replaces the rules
            self.applied[name] = "static"
            return apply_trace(func, next(b for b in used if not b.bindings).trace)
        tuned = [(b.bindings, apply_trace(specialize(func, b.bindings), b.trace)) for b in used]
        self.applied[name] = ", ".join(",".join(f"{k}={v}" for k, v in sorted(b.items())) for b, _ in tuned)
        return dispatch(func, rule_func, tuned)

    def summary(self) -> dict[str, Any]:
        """The manifest's build.tuning entry."""
        return {"records": len(self.by_hash), "digest": self.digest, "from_records": len(self.applied),
                "from_rules": self.kernels - len(self.applied), "applied": dict(sorted(self.applied.items())),
                "ignored": list(self.notices)}


def becomes_view(func: Any) -> bool:
    """schedules/views.becomes_view (imported here lazily: this module is on the cached
    build path, which must not import the compiler)."""
    from vtool.schedules.views import becomes_view as _becomes_view

    return _becomes_view(func)


def _mismatch(rec: Record, target_name: str, tvm_target: dict[str, Any], version: str) -> str:
    if rec.target != target_name:
        return f"target {rec.target}, not {target_name}"
    if _norm(rec.tvm_target) != _norm(tvm_target):
        return f"TVM target {rec.tvm_target}, not {tvm_target}"
    if rec.tvm != version:
        return f"TVM {rec.tvm}, not {version}"
    return ""


def _norm(d: dict[str, Any]) -> str:
    return json.dumps(d, sort_keys=True, default=str)


Notice = Callable[[str], None]
