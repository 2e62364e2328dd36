"""The BuildPlan (toolchain/plan.py) and the target-family table (toolchain/families.py).

* Every combination of target x dtype x quantization x activations x gemm x attention x
  source kind resolves as the build resolved it before there was a plan (the oracle below
  is that code, kept as it was), or is refused with the same message, which names the
  option (and the value) it refuses.
* The plan's dict and cache key are stable: the same inputs give the same key, and every
  resolved option that changes the library changes it.
* The family table has an entry for every family the target table can build, and a
  target whose family has none is refused by name at build.
No compiler runs here: plans only (the CUDA rows need no nvcc: `nvcc --version` is stubbed).
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vtool import VtoolError
from vtool.models.config import parse_hf_config
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.targets import ROWS, TargetSpec, buildable
from vtool.toolchain import flashinfer_attention as fa
from vtool.toolchain.families import FAMILIES, FamilyError, family_named, family_of
from vtool.toolchain.plan import BuildOptions, cache_key, check_request, resolve_plan

TARGETS = ["host", *(r.name for r in ROWS), "sm_80,sm_90a"]
# each option's values, then one it does not know
DTYPES = ["float32", "float16", "bfloat16", "int8"]
QUANTIZATIONS = ["auto", "none", "gguf", "q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "fp8", "q3"]
ACTIVATIONS = ["auto", "decode", "q8_0", "none", "int4"]
GEMMS = ["auto", "tir", "cublas", "cutlass"]
ATTENTIONS = ["auto", "tir", "flashinfer", "flash"]


def _mostly_known(values: list[str]) -> st.SearchStrategy[str]:
    """An unknown value one time in ~10: five options at once would otherwise be refused
    for one of them most of the time."""
    return st.sampled_from(values[:-1] * (9 // (len(values) - 1) + 1) + values[-1:])
SOURCES = ["st-hd64", "st-hd16", "gguf-q4_1", "gguf-mixed", "gguf-f32", "gguf-q5_0"]


# --- checkpoints -------------------------------------------------------------------------------

def _safetensors(folder: Path, head_dim: int, heads: int, kv: int) -> Path:
    """A one-layer Llama of zeros: only shapes and dtypes matter to a plan."""
    import safetensors.numpy

    from vtool.models.weights import expected_source_shapes

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": head_dim, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "max_position_embeddings": 512, "hidden_act": "silu"}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    shapes = expected_source_shapes(parse_hf_config(config))
    safetensors.numpy.save_file({n: np.zeros(s, np.float16) for n, s in shapes.items()},
                                str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    from quant_gguf import K_SHAPE, Q, write_tiny_gguf

    tmp = tmp_path_factory.mktemp("plan")
    paths = {
        # head_dim 64, 2 query heads per KV head: FlashInfer's kernels fit it
        "st-hd64": _safetensors(tmp / "hd64", 64, 2, 1),
        # head_dim 16, MHA: TVM's CUDA decode attention cannot launch it
        "st-hd16": _safetensors(tmp / "hd16", 16, 8, 8),
        "gguf-q4_1": write_tiny_gguf(tmp / "q41.gguf", lambda _n: Q.Q4_1),
        # K-quants: a q|k|v whose parts differ (Q4_K q/k, Q6_K v) keeps each part in its own blocks
        "gguf-mixed": write_tiny_gguf(tmp / "mixed.gguf", lambda n: Q.Q4_K if ".attn_q." in n or ".attn_k." in n
                                      else Q.Q6_K, shape=K_SHAPE),
        "gguf-f32": write_tiny_gguf(tmp / "f32.gguf", lambda _n: Q.F32),
        # a format batched decode has no tensor-core kernel for: `auto` dequantizes it on CUDA
        "gguf-q5_0": write_tiny_gguf(tmp / "q50.gguf", lambda _n: Q.Q5_0),
    }
    return {k: open_checkpoint(p) for k, p in paths.items()}


@pytest.fixture(autouse=True, scope="module")
def no_external_tools():
    """The external tools' versions are constants here: CUDA rows resolve without a toolkit,
    aarch64 without the zig cross linker."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("vtool.toolchain.cuda.nvcc_version", lambda nvcc=None: "13.0.0")
        mp.setattr("vtool.toolchain.cross_link.record",
                   lambda spec: {"linker": "zig cc 0.0.0"} if spec.family == "arm" else {})
        yield


@pytest.fixture(autouse=True)
def _restore_flashinfer_probe():
    """_flashinfer fakes the module-wide probe: put the real answer back after each test, or a
    later CUDA build elsewhere in the session resolves `--attention auto` to a FlashInfer that
    is not there."""
    saved = fa._PROBE
    yield
    fa._PROBE = saved


def _flashinfer(installed: bool) -> None:
    """probe()'s answer, as if flashinfer-python were (not) installed and fitting."""
    fa._PROBE = ({"version": "0.6.15.post1", "location": "-"} if installed
                 else {"error": fa.FlashInferError("flashinfer-python is not importable (test)")})


# --- the oracle: the build's resolution before the plan (toolchain/build.py, gemm_offload.py,
# flashinfer_attention.py as they were), family names and all --------------------------------

def _old_resolution(ckpt, target, dtype, quantization, activations, gemm, attention):  # noqa: ANN001, C901
    from vtool.models.int8_activations import DOT_FORMATS, int8_isa
    from vtool.models.weights import check_checkpoint_shapes, kept_formats, weight_modules
    from vtool.toolchain.cuda import check_attention_shape, check_prefill_tiling
    from vtool.toolchain.quantize import SCHEMES, plan_formats

    families = ("x86", "arm")  # --quantization auto keeps a GGUF file's blocks (CUDA: a rule of its own)
    quant_families = (*families, "cuda")  # explicit --quantization gguf / q4_0 / q4_1 / q8_0
    if dtype not in ("float32", "float16", "bfloat16"):
        raise VtoolError(f"unsupported dtype {dtype!r}; supported: float32, float16, bfloat16")
    spec = buildable(target)
    cfg = parse_hf_config(ckpt.config())
    check_checkpoint_shapes(cfg, {n: t.shape for n, t in ckpt.tensors().items()}, str(ckpt.path))
    if spec.family == "cuda":
        check_attention_shape(cfg)
        check_prefill_tiling(cfg, dtype)  # added with the rule (toolchain/cuda.py)
    quants = ("auto", "none", "gguf", *SCHEMES, "fp8")  # fp8: added with the plan (session 25)
    if quantization not in quants:
        raise VtoolError(f"unknown quantization {quantization!r}; supported: {', '.join(quants)}")
    if quantization == "fp8":
        if ckpt.format == "gguf":
            raise VtoolError(f"--quantization fp8 quantizes a float (safetensors) checkpoint, but {ckpt.path} is a "
                             "GGUF file: use --quantization gguf (or auto) to keep its blocks, or none")
        infos = ckpt.tensors()
        kept = {m: "FP8_E4M3" for m, srcs in weight_modules(cfg).items()
                if m.rsplit(".", 1)[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
                and all(infos[x].dtype in ("F32", "F16", "BF16") and infos[x].shape[-1] % 16 == 0 for x in srcs)}
        scheme, dense = "fp8", {}
    elif quantization == "none" or (quantization == "auto" and ckpt.format != "gguf"):
        scheme, kept, dense = "none", {}, {}
    elif quantization in SCHEMES:
        if ckpt.format == "gguf":
            raise VtoolError(f"--quantization {quantization} quantizes a float (safetensors) checkpoint at build "
                             f"time, but {ckpt.path} is a GGUF file, whose blocks are kept as they are: use "
                             "--quantization gguf (or auto); re-quantizing already quantized weights would only add "
                             "error")
        if spec.family not in quant_families:
            raise VtoolError(f"--quantization {quantization} has kernels for CPU targets only ({', '.join(families)}), "
                             f"not {spec.name} ({spec.family}): there are no quantized CUDA kernels yet; use "
                             "--quantization none")
        scheme, dense = quantization, {}
        kept, _ = plan_formats(cfg, {n: t.shape for n, t in ckpt.tensors().items()}, quantization)
        if not kept:
            raise VtoolError(f"--quantization {quantization}: no weight of {ckpt.path} fits the quantized kernels' "
                             "tiles (rows a multiple of 4, columns a multiple of 32); use --quantization none")
    else:
        if ckpt.format != "gguf":
            raise VtoolError(f"--quantization gguf keeps a GGUF file's quantized blocks, but {ckpt.path} is a "
                             f"{ckpt.format} checkpoint; use --quantization none")
        if spec.family not in quant_families:
            raise VtoolError(f"--quantization gguf has kernels for x86 CPU targets only, not {spec.name} "
                             f"({spec.family}); use --quantization none there")
        kept, dense = kept_formats(cfg, {n: (t.dtype, t.shape) for n, t in ckpt.tensors().items()})
        formats = {f for v in kept.values() for f in v.split(",")}
        if quantization == "auto" and spec.family == "cuda" and not (  # session 29: tensor-core batches
                dtype in ("bfloat16", "float16") and formats <= {"Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"}):
            kept = {}
        scheme = "gguf" if kept else "none"
        if not kept:
            if quantization != "auto":
                raise VtoolError(f"--quantization gguf: {ckpt.path} has no weight stored as Q8_0, Q4_0, Q4_1, Q5_0, "
                                 "Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS (the formats with kernels); use "
                                 "--quantization none")
            dense = {}
    if gemm not in ("auto", "tir", "cublas"):
        raise VtoolError(f"--gemm {gemm!r} is not one of auto, tir, cublas")
    if gemm == "auto":
        gemm = "cublas" if spec.family == "cuda" and dtype in ("bfloat16", "float16") else "tir"
    elif gemm == "cublas" and spec.family != "cuda":
        raise VtoolError(f"--gemm cublas needs a CUDA target; this build's target family is {spec.family}")
    attention = _old_attention(attention, spec.family, dtype, cfg)
    if activations not in ("auto", "decode", "q8_0", "none"):
        raise VtoolError(f"unknown --activations {activations!r}; supported: auto, decode, q8_0, none")
    isa = int8_isa(str(spec.tvm.get("mcpu", "")), list(spec.tvm.get("mattr", []))) if spec.family == "x86" else None
    usable = isa is not None and bool({f for v in kept.values() for f in v.split(",")} & set(DOT_FORMATS))
    if activations == "none" or (activations == "auto" and not usable):
        activations = "none"
    elif activations == "auto":  # "decode" (float prompts) until issue 16 made prompts integer too
        activations = "q8_0"
    elif isa is None:
        raise VtoolError(f"--activations {activations} needs an x86 target with integer dot products (AVX2 or "
                         f"AVX-512 VNNI); {spec.name} has none: use --activations none")
    elif not usable:
        raise VtoolError(f"--activations {activations} applies to weights kept as Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                         "IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS blocks and "
                         "this build keeps none: use --activations none (or --quantization gguf / q4_1 / q8_0)")
    return scheme, kept, dense, activations, gemm, attention


def _old_attention(choice: str, family: str, dtype: str, cfg) -> str:  # noqa: ANN001
    if choice not in ("auto", "tir", "flashinfer"):
        raise VtoolError(f"--attention {choice!r} is not one of auto, tir, flashinfer")
    if choice == "auto":
        if family != "cuda":
            return "tir"
        try:
            chosen = _old_attention("flashinfer", family, dtype, cfg)
            fa.probe()
            return chosen
        except VtoolError:
            return "tir"
    if choice == "tir":
        return "tir"
    if family != "cuda":
        raise VtoolError(f"--attention flashinfer needs a CUDA target; this build's target family is {family}")
    if dtype not in ("float16", "bfloat16"):
        raise VtoolError(f"--attention flashinfer has kernels for float16, bfloat16, not {dtype}")
    if cfg.head_dim not in (64, 128, 256):
        raise VtoolError(f"--attention flashinfer supports head_dim (64, 128, 256), this model has {cfg.head_dim}; "
                         "use --attention tir")
    group, rem = divmod(cfg.num_attention_heads, cfg.num_key_value_heads)
    if rem or group not in (1, 2, 3, 4, 8):
        raise VtoolError(f"--attention flashinfer's decode kernels take (1, 2, 3, 4, 8) query heads per KV head "
                         f"(DISPATCH_GQA_GROUP_SIZE), this model has {cfg.num_attention_heads}/"
                         f"{cfg.num_key_value_heads}; use --attention tir")
    return "flashinfer"


def _outcome(fn):  # noqa: ANN001, ANN202
    try:
        return "ok", fn()
    except VtoolError as err:
        return "refused", str(err)


def _names_the_option(message: str, target: str, options: BuildOptions) -> bool:
    """A refusal names what it refuses: an option with its value, the target, or the model
    field a family's kernels cannot take."""
    named = [f"dtype {options.dtype!r}", f"target {target!r}", f"target {target.split(',')[0]!r}", "head_dim="]
    for option in ("quantization", "activations", "gemm", "attention"):
        value = getattr(options, option)
        if value != "auto":  # auto never refuses
            named += [f"--{option} {value}", f"--{option} {value!r}", f"{option} {value!r}"]
    return any(n in message for n in named)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(TARGETS), dtype=_mostly_known(DTYPES), quantization=_mostly_known(QUANTIZATIONS),
       activations=_mostly_known(ACTIVATIONS), gemm=_mostly_known(GEMMS), attention=_mostly_known(ATTENTIONS),
       source=st.sampled_from(SOURCES), flashinfer=st.booleans(), records=st.booleans())
def test_the_plan_resolves_every_combination_as_the_build_did(sources, target, dtype, quantization, activations,
                                                             gemm, attention, source, flashinfer, records):
    ckpt = sources.get(source) or sources["gguf-q4_1"]
    _flashinfer(flashinfer)
    options = BuildOptions(dtype, quantization, activations, gemm, attention, records)
    old = _outcome(lambda: _old_resolution(ckpt, target, dtype, quantization, activations, gemm, attention))
    new = _outcome(lambda: resolve_plan(ckpt, target, options, tools=False))
    assert new[0] == old[0], (old, new)
    event(new[0])  # --hypothesis-show-statistics: how many resolved, how many were refused
    if new[0] == "refused":
        assert new[1] == old[1]
        assert _names_the_option(new[1], target, options), new[1]
        return
    plan = new[1]
    assert (plan.quantization, dict(plan.kept), dict(plan.dense), plan.activations, plan.gemm,
            plan.attention) == old[1]
    assert plan.target.name == buildable(target).name and plan.dtype == dtype and plan.records == records
    assert plan.source_format == ckpt.format
    # a build resolves the same plan and adds the tools' versions; asked for by name, a
    # FlashInfer that is not installed is refused there (a tuning plan needs none of it)
    status, built = _outcome(lambda: resolve_plan(ckpt, target, options))
    if status == "refused":
        assert plan.attention == "flashinfer" and not flashinfer and "not importable" in built
        return
    assert {**built.as_dict(), "toolchain": None, "attention_backend": None} == plan.as_dict()
    assert built.attention_backend == (f"flashinfer-{fa.probe()['version']}" if plan.attention == "flashinfer"
                                       else "tir")


# --- the dict and the cache key ----------------------------------------------------------------

def _library_view(plan) -> str:  # noqa: ANN001
    """The plan's dict without what does not reach the library: whether records were asked
    for (only their digest does: a target without records builds the same either way)."""
    d = plan.as_dict()
    d["tuning"] = {"digest": d["tuning"]["digest"]}
    return json.dumps(d, sort_keys=True)


@pytest.mark.parametrize("target", ["x86-avx2", "aarch64-neon", "sm_90a", "sm_80,sm_90a"])
def test_same_inputs_same_key_any_change_another(sources, target):
    _flashinfer(True)
    plans = {}
    for source in ("st-hd64", "gguf-q4_1"):
        ckpt = sources[source]
        for dtype in DTYPES[:3]:
            for quantization in QUANTIZATIONS[:6]:
                for activations in ACTIVATIONS[:4]:
                    for gemm in GEMMS[:3]:
                        for attention in ATTENTIONS[:3]:
                            for records in (True, False):
                                options = BuildOptions(dtype, quantization, activations, gemm, attention, records)
                                try:
                                    plan = resolve_plan(ckpt, target, options)
                                except VtoolError:
                                    continue
                                again = resolve_plan(ckpt, target, options)
                                assert again.as_dict() == plan.as_dict() and again.cache_key() == plan.cache_key()
                                plans[(source, options)] = plan
    assert len(plans) > 20
    by_view: dict[str, str] = {}
    for plan in plans.values():
        by_view.setdefault(_library_view(plan), plan.cache_key())
        assert by_view[_library_view(plan)] == plan.cache_key()
    # distinct libraries, distinct keys
    assert len(set(by_view.values())) == len(by_view), "two different plans share a cache key"
    # the key of a plan is the build's key function of its parts (the key kept its form)
    for plan in list(plans.values())[:10]:
        assert plan.cache_key() == cache_key(dict(plan.source_config), plan.target, plan.dtype, plan.quantization_key(),
                                             plan.gemm, plan.attention_backend, plan.tuning_digest)
        json.dumps(plan.as_dict())  # JSON-ready


@pytest.mark.parametrize("source, dtype, kept", [
    ("gguf-q4_1", "bfloat16", True), ("gguf-mixed", "float16", True),  # Q4_K/Q6_K: tensor-core batches
    ("gguf-q4_1", "float32", False),  # float32 batches would take the block GEMV
    ("gguf-q5_0", "bfloat16", False),  # no tensor-core kernel for Q5_0
])
def test_cuda_auto_keeps_gguf_blocks_only_where_batches_run_on_tensor_cores(sources, source, dtype, kept):
    """On CUDA, `--quantization auto` keeps a GGUF file's blocks when batched decode multiplies
    every kept format on the tensor cores; otherwise it dequantizes at load and says why, naming
    the formats and the explicit way to keep them. CPU targets keep them always, silently."""
    heard: list[str] = []
    plan = resolve_plan(sources[source], "sm_90a", BuildOptions(dtype=dtype, attention="tir"), notice=heard.append)
    assert plan.quantization == ("gguf" if kept else "none")
    assert bool(plan.kept) == kept
    if kept:
        assert not [m for m in heard if "--quantization" in m]
    else:
        why = [m for m in heard if "--quantization auto" in m]
        assert len(why) == 1 and "--quantization gguf" in why[0] and dtype in why[0]
        assert ("Q5_0" in why[0]) == (source == "gguf-q5_0")
    heard.clear()
    cpu = resolve_plan(sources[source], "x86-avx2", BuildOptions(dtype="float32"), notice=heard.append)
    assert cpu.quantization == "gguf" and not [m for m in heard if "--quantization" in m]


@pytest.mark.parametrize("target, dtype, told", [("x86-avx2", "float16", True), ("aarch64-neon", "float16", True),
                                                 ("x86-avx2", "bfloat16", False), ("x86-avx2", "float32", False),
                                                 ("sm_90a", "float16", False)])
def test_a_float16_cpu_build_is_told_its_prompts_are_slow(sources, target, dtype, told):
    heard: list[str] = []
    resolve_plan(sources["st-hd64"], target, BuildOptions(dtype=dtype), notice=heard.append, tools=False)
    about = [m for m in heard if m.startswith(f"--dtype {dtype}")]
    assert bool(about) == told, heard
    if told:
        assert "bfloat16" in about[0] and "BENCHMARKS.md" in about[0]


def test_records_change_the_key_only_where_there_are_records(sources):
    ckpt = sources["st-hd64"]
    keys = {(t, r): resolve_plan(ckpt, t, BuildOptions(records=r)).cache_key()
            for t in ("x86-avx2", "x86-portable") for r in (True, False)}
    assert keys[("x86-avx2", True)] != keys[("x86-avx2", False)]  # tuning_logs/x86-avx2/ holds records
    assert keys[("x86-portable", True)] == keys[("x86-portable", False)]


def test_a_tuning_plan_has_no_cache_key(sources):
    plan = resolve_plan(sources["st-hd64"], "sm_90a", BuildOptions(dtype="bfloat16"), tools=False)
    assert plan.toolchain is None and plan.as_dict()["toolchain"] is None
    with pytest.raises(VtoolError, match="without its tools"):
        plan.cache_key()


def test_the_plan_is_frozen(sources):
    plan = resolve_plan(sources["gguf-q4_1"], "x86-avx2", BuildOptions(), tools=False)
    with pytest.raises(Exception):
        plan.dtype = "float16"  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.kept["lm_head"] = "Q8_0"  # type: ignore[index]
    assert replace(plan, dtype="float16").dtype == "float16"


# --- the family table --------------------------------------------------------------------------

def test_every_buildable_family_has_an_entry_and_the_others_are_refused_by_name(sources):
    from vtool.runtime.artifact.library import DEVICES

    for row in ROWS:
        if row.buildable:
            family = family_of(row)
            assert family.name == row.family
            assert DEVICES[row.family][0] == family.device  # the runtime's device for it agrees
        else:
            with pytest.raises(VtoolError, match=f"{row.name!r} cannot be built yet"):
                resolve_plan(sources["st-hd64"], row.name, BuildOptions())
    assert {f.name for f in FAMILIES} == {r.family for r in ROWS if r.buildable}


def test_a_family_without_an_entry_is_refused_by_name_at_build(sources, monkeypatch, tmp_path):
    from vtool.toolchain import build

    rocm = TargetSpec("gfx942-test", "rocm", {"kind": "rocm", "mcpu": "gfx942"}, ("mfma",))
    with pytest.raises(FamilyError, match="target 'gfx942-test': target family 'rocm' has no entry .* "
                                          "families: x86, arm, cuda"):
        check_request(rocm, BuildOptions())
    monkeypatch.setattr("vtool.toolchain.plan.buildable", lambda name: rocm)
    with pytest.raises(FamilyError, match="family 'rocm' has no entry"):
        build.build_artifact(sources["st-hd64"].path, "gfx942-test", output=tmp_path / "a")
    assert not (tmp_path / "a").exists()
    with pytest.raises(FamilyError, match="'vulkan'"):
        family_named("vulkan")


def test_each_family_names_its_pipeline_parts():
    import importlib.util

    for family in FAMILIES:
        assert importlib.util.find_spec(f"vtool.schedules.{family.schedules}") is not None
        assert importlib.util.find_spec(f"{family.relax_backend}.pipeline") is not None
        assert family.gemm[0] == "tir" and family.attention[0] == "tir"
        assert set(family.gemm_auto.values()) <= set(family.gemm)
        if family.tensor_intrinsics:  # its rules import TVM's tensor intrinsics: the light way, as a build does
            from vtool.schedules.cuda.tensor_intrinsics import preload_tensor_intrinsics

            preload_tensor_intrinsics()
        assert family.describe_pipeline(family, family.gemm[-1])["passes"]


def test_no_family_branches_outside_the_table():
    """A new family plugs in at toolchain/families.py: nothing else in toolchain/ or
    schedules/ compares a family's name."""
    root = Path(__file__).resolve().parent.parent
    branch = re.compile(r"""family\s*(==|!=|\bin\b|\bnot in\b)\s*[("']""")
    found = [f"{p.relative_to(root)}:{i}: {line.strip()}"
             for folder in ("toolchain", "schedules") for p in sorted((root / folder).rglob("*.py"))
             if p.name != "families.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert not found, "\n".join(found)
