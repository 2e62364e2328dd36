"""`vtool tune` and tuning records (toolchain/tune.py, toolchain/records.py).

A tiny GGUF model built with `--quantization none` (float32 NT-matmuls, the kernels the
CPU rules schedule): MetaSchedule tunes one prefill matmul (symbolic seq_len) at the
bucket seq_len=32 with a few trials; the build applies that record (forced to "use",
since a few trials rarely beat the rules) as a dispatch between the tuned bucket and the
rule schedule. The oracle for the numbers is the rule-scheduled kernel and the rules-only
build (themselves held to transformers by the parity tests), at sizes inside and outside
the bucket.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from quant_gguf import Q, write_tiny_gguf

from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.runtime.engine.generate import Generator
from vtool.runtime.sampling.params import SamplingParams
from vtool.toolchain import records as rec_mod
from vtool.toolchain.build import build_artifact
from vtool.toolchain.records import RecordSet, apply_trace, dispatch, read_record, specialize, write_record
from vtool.toolchain.tune import TuneOptions, extract_kernels, plan_tasks, rule_schedule, tune_model

TARGET = "x86-avx2"
QUANT = "none"
BUCKET = {"seq_len": 32}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tune") / "m.gguf", lambda name: Q.Q4_1, tie=True)


@pytest.fixture(scope="module")
def kernels(tiny):
    return extract_kernels(tiny, TARGET, quantization=QUANT)


@pytest.fixture(scope="module")
def kernel(kernels) -> str:
    """A prefill matmul: NT_matmul over a symbolic seq_len, fused with its residual add
    (FuseTIR's numbering changes with the model, so it is found by what it is)."""
    _, _, mod = kernels
    plan = plan_tasks(mod, pattern="fused_NT_matmul*_add*", prefill_buckets=(32,), decode_buckets=())
    names = sorted(t.kernel for t in plan.tasks if t.bindings == BUCKET)
    assert names, "no prefill matmul among the tasks"
    return names[0]


@pytest.fixture(scope="module")
def tuned_root(tiny, kernel, tmp_path_factory) -> Path:
    """Records from a short real MetaSchedule run, the one bucket forced to "use"."""
    root = tmp_path_factory.mktemp("records")
    summary = tune_model(tiny, TARGET, TuneOptions(trials=4, pattern=kernel, prefill_buckets=(32,), decode_buckets=(),
                                                   output=root, quantization=QUANT))
    assert summary["written"] == 1 and summary["candidates"] >= 1
    (path,) = (root / TARGET).glob("*.json")
    record = read_record(path)
    (bucket,) = record.buckets
    assert bucket.bindings == BUCKET and bucket.trials >= 1 and bucket.tuned_us > 0 and bucket.rule_us > 0
    # the empty stand-in for TVM's tensor intrinsics (CPU tuning) is gone again: a CUDA
    # build later in this process imports the real ones
    import sys

    intrin = sys.modules.get("tvm.s_tir.tensor_intrin")
    assert intrin is None or not (intrin.__doc__ or "").startswith("not loaded")
    bucket.use = True
    write_record(root, record)
    return root


def _kernel(mod, name: str):
    return next(f for gv, f in mod.functions_items() if gv.name_hint == name)


def test_plan_buckets_symbolic_kernels_and_skips_the_rest(kernels, kernel, tiny):
    _, _, mod = kernels
    plan = plan_tasks(mod, prefill_buckets=(32, 128), decode_buckets=(4,))
    labels = {t.label for t in plan.tasks}
    assert {f"{kernel}[seq_len=32]", f"{kernel}[seq_len=128]"} <= labels
    assert all(t.bindings for t in plan.tasks if t.kernel == kernel)
    assert any(t.bindings == {"batch_size": 4} for t in plan.tasks)  # batched decode
    assert any(not t.bindings for t in plan.tasks)  # batch-1 decode kernels are static
    skipped = {s.kernel: s.why for s in plan.skipped}
    assert "KV-cache" in skipped["batch_decode_paged_kv_cpu"]
    assert "scalar parameter" in skipped["fused_rope"]
    # the quantized build: its int8 / batch-1 GEMV kernels are hand-written, never tuned
    _, _, qmod = extract_kernels(tiny, TARGET, quantization="gguf")
    qplan = plan_tasks(qmod)
    assert not any("gemv" in t.kernel or "int8" in t.kernel for t in qplan.tasks)
    assert any("hand-written" in s.why for s in qplan.skipped)


@pytest.mark.slow
def test_tune_writes_a_record_and_a_rerun_resumes(tiny, kernel, tuned_root):
    again = tune_model(tiny, TARGET, TuneOptions(trials=4, pattern=kernel, prefill_buckets=(32,), decode_buckets=(),
                                                 output=tuned_root, quantization=QUANT))
    assert again["written"] == 0 and again["candidates"] == 0  # the finished task is not redone


@pytest.mark.slow
def test_bucket_dispatch_matches_the_rule_kernel_inside_and_outside_the_bucket(kernels, kernel, tuned_root):
    import tvm

    from vtool.toolchain.tune_measure import _compile, _random_args

    _, target, mod = kernels
    func = _kernel(mod, kernel)
    (path,) = (tuned_root / TARGET).glob("*.json")
    bucket = read_record(path).bucket(BUCKET)
    rule = rule_schedule(func, target, "x86", kernel)
    assert rule.script() != func.script()  # the rules schedule this kernel (by its name)
    tuned = apply_trace(specialize(func, BUCKET), bucket.trace)
    both = dispatch(func, rule, [(BUCKET, tuned)])
    assert tuned.script() != rule.script()
    dev = tvm.runtime.cpu()
    libs = [_compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target) for f in (rule, both)]
    for n in (32, 20, 33):  # in the bucket, below, above
        outs = []
        for lib, f in zip(libs, (rule, both)):
            args = _random_args(f, {"seq_len": n}, dev)
            lib["main"](*args)
            outs.append(args[-1].numpy())
        assert outs[0].shape[-2] == n
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_build_applies_records_and_generates_the_same_tokens(tiny, kernels, kernel, tuned_root, tmp_path,
                                                            monkeypatch):
    empty = tmp_path / "no-records"
    empty.mkdir()
    monkeypatch.setenv(rec_mod.ENV_ROOT, str(empty))
    ckpt = open_checkpoint(tiny)
    rules_dir = build_artifact(tiny, TARGET, "float32", output=tmp_path / "rules", checkpoint=ckpt, quantization=QUANT)
    monkeypatch.setenv(rec_mod.ENV_ROOT, str(tuned_root))
    tuned_dir = build_artifact(tiny, TARGET, "float32", output=tmp_path / "tuned", checkpoint=ckpt, quantization=QUANT)

    rules_tuning = json.loads((rules_dir / "manifest.json").read_text())["build"]["tuning"]
    tuning = json.loads((tuned_dir / "manifest.json").read_text())["build"]["tuning"]
    assert rules_tuning["from_records"] == 0 and rules_tuning["from_rules"] > 0
    assert tuning["from_records"] == 1 and tuning["applied"] == {kernel: "seq_len=32"}
    assert tuning["from_rules"] == rules_tuning["from_rules"] - 1 and tuning["digest"]

    # the tuned kernel's TIR is not the rule one
    _, target, mod = kernels
    import tvm

    from vtool.schedules import rules_for

    with target:
        by_rules = rules_for("cpu")(tvm.IRModule(dict(mod.functions_items())))
        by_records = rules_for("cpu", RecordSet.load(TARGET, _tvm_target()))(tvm.IRModule(dict(mod.functions_items())))
    assert _kernel(by_records, kernel).script() != _kernel(by_rules, kernel).script()
    assert _kernel(by_records, "rms_norm2").script() == _kernel(by_rules, "rms_norm2").script()

    rng = np.random.default_rng(1)
    for n in (32, 20):  # prefill inside the bucket (tuned body), outside it (rule body)
        prompt = [int(x) for x in rng.integers(3, 250, size=n)]
        runs = []
        for folder in (rules_dir, tuned_dir):
            seen: list[np.ndarray] = []
            gen = Generator(CompiledModel(folder, ckpt), max_model_len=64)
            out = gen.generate(prompt, SamplingParams(temperature=0, max_tokens=4), on_logits=seen.append)
            runs.append((out.token_ids, seen))
        assert runs[0][0] == runs[1][0]
        for a, b in zip(runs[0][1], runs[1][1]):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


def _tvm_target() -> dict:
    from vtool.targets import buildable

    return dict(buildable(TARGET).tvm)


@pytest.mark.slow
def test_records_for_another_target_or_tvm_are_ignored_with_a_notice(kernels, tuned_root, tmp_path):
    import tvm

    from vtool.schedules import rules_for
    from vtool.targets import buildable

    (path,) = (tuned_root / TARGET).glob("*.json")
    other = tmp_path / "x86-avx512"
    other.mkdir()
    shutil.copy(path, other / path.name)  # an x86-avx2 record in the avx512 folder
    avx512 = RecordSet.load("x86-avx512", dict(buildable("x86-avx512").tvm), root=tmp_path)
    assert not avx512.by_hash and "target x86-avx2, not x86-avx512" in avx512.notices[0]

    _, target, mod = kernels
    with tvm.target.Target(buildable("x86-avx512").tvm):
        rules_for("cpu", avx512)(tvm.IRModule(dict(mod.functions_items())))
    assert avx512.summary()["from_records"] == 0

    stale = json.loads(path.read_text())
    stale["tvm"] = "0.26.0"
    (tmp_path / TARGET).mkdir()
    (tmp_path / TARGET / path.name).write_text(json.dumps(stale))
    (tmp_path / TARGET / "broken.json").write_text("{not json")
    avx2 = RecordSet.load(TARGET, _tvm_target(), root=tmp_path)
    assert not avx2.by_hash and avx2.digest == ""
    assert any("TVM 0.26.0" in n for n in avx2.notices) and any("unreadable" in n for n in avx2.notices)


def test_cli_lists_tasks_and_refuses_bad_buckets(tiny):
    from vtool.toolchain.cli import main

    listed = CliRunner().invoke(main, ["tune", "--model", str(tiny), "--target", TARGET, "--list",
                                       "--prefill-buckets", "16", "--decode-buckets", "2"])
    assert listed.exit_code == 0, listed.output
    assert "[seq_len=16]" in listed.output and "[batch_size=2]" in listed.output
    assert "skipped batch_decode_paged_kv_cpu" in listed.output
    bad = CliRunner().invoke(main, ["tune", "--model", str(tiny), "--target", TARGET, "--prefill-buckets", "32,x"])
    assert bad.exit_code == 2 and "comma list of sizes" in bad.output


def test_tune_takes_the_builds_hf_overrides(tiny):
    """--hf-overrides decides kernels as in `vtool build` (here RMSNorm's eps, a constant in its
    kernel): the tasks tune lists are the overridden build's (other hashes for every RMSNorm, the
    rest unchanged); text that is not JSON is refused by name."""
    from vtool.toolchain.cli import main

    def listing(*extra: str) -> dict[str, str]:
        listed = CliRunner().invoke(main, ["tune", "--model", str(tiny), "--target", TARGET, "--list", *extra])
        assert listed.exit_code == 0, listed.output
        return dict(line.rsplit("  ", 1) for line in listed.output.splitlines() if "  " in line)

    plain, overridden = listing(), listing("--hf-overrides", '{"rms_norm_eps": 0.25}')
    assert plain.keys() == overridden.keys()
    changed = {label for label in plain if plain[label] != overridden[label]}
    assert changed and all(label.startswith("rms_norm") for label in changed), changed
    bad = CliRunner().invoke(main, ["tune", "--model", str(tiny), "--target", TARGET, "--list", "--hf-overrides", "{x"])
    assert bad.exit_code != 0 and "--hf-overrides is not JSON" in bad.output


def test_reshape_kernels_are_not_tuned_and_no_record_touches_them(kernels, tmp_path):
    """A reshape kernel becomes a view after the schedules (no kernel runs); a record that
    scheduled or bucket-dispatched it would make it a real copy kernel (on an H200 this
    cost +52 us per batch-32 decode step before the guard)."""
    import tvm

    from vtool.schedules import rules_for
    from vtool.toolchain.records import Bucket, Record, becomes_view, kernel_hash, tvm_version

    _, target, mod = kernels
    plan = plan_tasks(mod, prefill_buckets=(32,), decode_buckets=(8,))
    reshapes = [s.kernel for s in plan.skipped if "reshape" in s.why]
    assert reshapes and not any(t.kernel in reshapes for t in plan.tasks)
    name = reshapes[0]
    func = _kernel(mod, name)
    assert becomes_view(func)
    assert not becomes_view(_kernel(mod, "rms_norm2"))
    # an identity trace marked "use": without the guard the build would dispatch on it
    rec = Record(name, kernel_hash(func), TARGET, _tvm_target(), tvm_version())
    for var in sorted(rec_mod.shape_vars(func)) or [None]:
        rec.put(Bucket({var: 32} if var else {}, [[], []], 1.0, 2.0, 1, True, 1))
    write_record(tmp_path, rec)
    records = RecordSet.load(TARGET, _tvm_target(), root=tmp_path)
    assert records.by_hash
    with target:
        rules_for("cpu", records)(tvm.IRModule(dict(mod.functions_items())))
    assert records.summary()["from_records"] == 0


def test_kernels_pattern_takes_comma_separated_globs(kernels):
    from vtool.toolchain.tune import matches

    assert matches("rms_norm2", "fused_NT_matmul*, rms_norm*")
    assert not matches("add1", "fused_NT_matmul*,rms_norm*")
    _, _, mod = kernels
    plan = plan_tasks(mod, "rms_norm*,fused_split*", prefill_buckets=(32,), decode_buckets=(8,))
    names = {t.kernel for t in plan.tasks}
    assert names and all(n.startswith(("rms_norm", "fused_split")) for n in names)
    assert any(n.startswith("rms_norm") for n in names) and any(n.startswith("fused_split") for n in names)


def test_cold_cache_timer_flushes_before_its_samples(kernels, monkeypatch):
    """The GPU timer's path (one call per sample, an L2-sized device copy before each) run
    on the CPU: the copy happens (the destination takes the source's bytes) and every
    sample is one call."""
    import tvm

    from vtool.toolchain import tune_measure

    _, target, mod = kernels
    monkeypatch.setattr(tune_measure, "_is_gpu", lambda dev: True)
    monkeypatch.setattr(tune_measure, "L2_FLUSH_BYTES", 1 << 20)
    monkeypatch.setattr(tune_measure, "_flush_buffers", {})
    rule = rule_schedule(_kernel(mod, "rms_norm2"), target, "x86", "rms_norm2")
    name = tune_measure._ensure_l2_flush(tvm.runtime.cpu(0))
    ((src, dst),) = tune_measure._flush_buffers.values()
    src.copyfrom(np.arange(1 << 20, dtype=np.uint32).astype(np.uint8))
    assert name == tune_measure._FLUSH_FUNC
    us = tune_measure.time_kernel(rule, target)
    assert us > 0
    np.testing.assert_array_equal(dst.numpy(), src.numpy())


def test_tuning_for_a_gpu_target_without_its_gpu_is_refused_by_name(tiny):
    import tvm

    from vtool.toolchain.tune import TuneError

    if tvm.runtime.device("cuda", 0).exist:
        pytest.skip("this machine has the GPU: tuning for it is allowed")
    with pytest.raises(TuneError, match="sm_90a times candidates on its GPU"):
        tune_model(tiny, "sm_90a", TuneOptions(trials=1, quantization="none"))
