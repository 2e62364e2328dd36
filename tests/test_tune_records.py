"""Tuning records against the builds they are for. No GPU and no nvcc needed: `vtool tune`
extracts kernels up to the schedule pass, and the schedule pass itself is TIR to TIR.

* Extraction follows the build's choices. A bf16 CUDA build sends the prefill and
  batched-decode matmuls to cuBLAS (`--gemm auto`), so those kernels do not exist to be
  tuned; with `--gemm tir` they do. Kernels tuned from the wrong module would have hashes
  no build looks up.
* The shipped records are current. Every record in tuning_logs/<target>/ keys a kernel
  that the model it was tuned on still has, and the build's schedule pass applies every
  record marked `use`. A compiler change that alters those kernels fails here, and the
  records are made again with the commands in docs/BENCHMARKS.md (sm_90a: on the GPU
  machine).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from vtool.toolchain.records import RecordSet, kernel_hash, records_root
from vtool.toolchain.tune import extract_kernels, plan_tasks

BENCH = Path(__file__).resolve().parent / "bench"


def _kernels(mod) -> dict[str, str]:  # noqa: ANN001 - name -> hash of every PrimFunc
    from tvm import tirx

    return {gv.name_hint: kernel_hash(f) for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _shipped(target: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((records_root() / target).glob("*.json"))]


def _applied_hashes(target_name: str, family: str, target, mod) -> set[str]:  # noqa: ANN001
    """Hashes of the kernels the build's schedule pass gives a record (run on the kernels
    that have a record only: the rules on a whole model take minutes here)."""
    import tvm

    from vtool.targets import buildable
    from vtool.toolchain.families import family_named

    records = RecordSet.load(target_name, dict(buildable(target_name).tvm))
    assert not records.notices, records.notices
    kernels = _kernels(mod)
    subset = tvm.IRModule({gv: f for gv, f in mod.functions_items() if kernels.get(gv.name_hint) in records.by_hash})
    with target:
        family_named(family).rules(records)(subset)
    return {kernels[name] for name in records.summary()["applied"]}


@pytest.fixture(scope="module")
def tiny_bf16(tiny_shape_dir) -> Path:  # tests/conftest.py; read only
    return tiny_shape_dir("qwen2-bias")


def test_extraction_follows_the_builds_gemm_choice(tiny_bf16):
    _, _, by_cublas = extract_kernels(tiny_bf16, "sm_90a", "bfloat16", "none", gemm="auto", attention="tir")
    _, _, by_tir = extract_kernels(tiny_bf16, "sm_90a", "bfloat16", "none", gemm="tir", attention="tir")
    symbolic = {"tir": plan_tasks(by_tir, "*NT_matmul*", (32,), (8,)), "cublas": plan_tasks(by_cublas, "*NT_matmul*",
                                                                                          (32,), (8,))}
    bucketed = {k: {t.label for t in p.tasks if t.bindings} for k, p in symbolic.items()}
    # prefill and batched-decode matmuls: TIR kernels only when the build keeps them in TIR
    assert any("seq_len=32" in label for label in bucketed["tir"])
    assert any("batch_size=8" in label for label in bucketed["tir"])
    assert not bucketed["cublas"], bucketed["cublas"]
    # the batch-1 decode GEMVs are vtool's own kernels either way, with the same hashes
    static = {k: {t.hash for t in p.tasks if not t.bindings} for k, p in symbolic.items()}
    assert static["cublas"] and static["cublas"] == static["tir"]
    # the GPU sampler's kernels are part of a CUDA build, so they are extracted too
    assert any(name.startswith("sampler_") for name in _kernels(by_cublas))


@pytest.mark.slow
def test_shipped_x86_records_match_the_default_models_builds():
    from vtool.runtime.weights.default_model import default_model_path

    shipped = _shipped("x86-avx2")
    assert shipped, "no x86-avx2 records shipped"
    seen: set[str] = set()
    applied: set[str] = set()
    for quantization in ("auto", "none"):  # the two builds the records were tuned on (BENCHMARKS.md)
        spec, target, mod = extract_kernels(default_model_path(), "x86-avx2", "float32", quantization)
        seen |= set(_kernels(mod).values())
        applied |= _applied_hashes("x86-avx2", spec.family, target, mod)
    stale = [r["kernel"] for r in shipped if r["hash"] not in seen]
    assert not stale, f"records for kernels the default model no longer has: {stale}"
    used = {r["hash"] for r in shipped if any(b["use"] for b in r["buckets"])}
    assert used and used <= applied


@pytest.mark.slow
def test_shipped_sm90a_records_match_the_8b_shaped_bf16_build(tmp_path):
    sys.path.insert(0, str(BENCH))
    from shape_checkpoint import write_shape_checkpoint

    shipped = _shipped("sm_90a")
    assert shipped, "no sm_90a records shipped"
    ckpt = write_shape_checkpoint(BENCH / "llama8b_config.json", tmp_path / "llama8b")  # sparse: no weights
    spec, target, mod = extract_kernels(ckpt, "sm_90a", "bfloat16", "none", attention="tir")
    kernels = set(_kernels(mod).values())
    stale = [r["kernel"] for r in shipped if r["hash"] not in kernels]
    assert not stale, f"records for kernels the 8B-shaped bf16 build no longer has: {stale}"
    used = {r["hash"] for r in shipped if any(b["use"] for b in r["buckets"])}
    assert used and used <= _applied_hashes("sm_90a", spec.family, target, mod)
