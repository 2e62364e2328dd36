"""--hf-overrides (vLLM's flag): config.json fields replaced at build time, recorded in the
manifest and applied again by the runtime (runtime/weights/hf_overrides.py).

The case it exists for: a Qwen2 GGUF without rope scaling (as llama.cpp's converter writes a
Qwen2.5 file) given YaRN x4 by the flag gives transformers' logits for the same model with that
scaling in its config.json. The artifact records the overrides, loads against the unchanged
checkpoint, and is refused against it once the record is gone; the cache key, the plan and the
provenance carry them; bad JSON and a prebuilt artifact with other overrides are refused by name."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from eager_parity import eager_model
from hf_oracle import greedy
from hypothesis import given
from hypothesis import strategies as st

from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.artifact.manifest import ManifestError, artifact_config
from vtool.runtime.engine.generate import Generator
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.runtime.weights.hf_overrides import HfOverridesError, apply_hf_overrides, parse_hf_overrides
from vtool.toolchain.build import build_artifact
from vtool.toolchain.plan import BuildOptions, resolve_plan

PROMPT = [1] + np.random.default_rng(5).integers(3, 500, 39).tolist()
TOL = 1e-4
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


# -- parsing ------------------------------------------------------------------------------------

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                           max_leaves=8)


@given(st.dictionaries(st.text(min_size=1), JSON_VALUES, max_size=5), st.dictionaries(st.text(min_size=1), JSON_VALUES))
def test_each_top_level_field_replaces_the_checkpoints_whole(overrides, config):
    assert parse_hf_overrides(json.dumps(overrides)) == overrides
    merged = apply_hf_overrides(config, overrides)
    assert merged == {**config, **overrides} and set(merged) == set(config) | set(overrides)
    assert artifact_config(config, {"hf_overrides": overrides}) == merged
    assert artifact_config(config, {}) == config  # a build made without them


@given(JSON_VALUES.filter(lambda v: not isinstance(v, dict)))
def test_anything_but_an_object_is_refused_by_name(value):
    with pytest.raises(HfOverridesError, match="--hf-overrides must be a JSON object"):
        parse_hf_overrides(json.dumps(value))


@pytest.mark.parametrize("text", ["{rope_scaling: 1}", '{"factor": 4', "yarn", "{'a': 1}"])
def test_text_that_is_not_json_is_refused_by_name(text):
    with pytest.raises(HfOverridesError, match="--hf-overrides is not JSON"):
        parse_hf_overrides(text)


def test_none_and_empty_mean_no_overrides():
    assert parse_hf_overrides(None) == parse_hf_overrides("") == parse_hf_overrides("  ") == parse_hf_overrides("{}") == {}


# -- a build with them --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_gguf(tiny_shape_dir, tmp_path_factory) -> Path:
    """A tiny Qwen2 (q/k/v bias) written as llama.cpp's qwen2 GGUF, with no rope scaling."""
    import gguf
    from hf_gguf import write_hf_as_gguf

    return write_hf_as_gguf(tiny_shape_dir("qwen2-bias"), tmp_path_factory.mktemp("plain") / "plain.gguf",
                            gguf.MODEL_ARCH.QWEN2)


def _with_yarn(src: Path, dst: Path) -> Path:
    """transformers' side of the comparison: src's checkpoint with YARN in its config.json."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    cfg["rope_parameters"] = {"rope_theta": theta, **YARN}
    cfg.pop("rope_scaling", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_gguf_gets_yarn_from_the_flag(plain_gguf, tiny_shape_dir, tmp_path):
    overrides = json.dumps({"rope_scaling": YARN})
    ckpt = open_checkpoint(plain_gguf)
    plan = resolve_plan(ckpt, "host", BuildOptions(hf_overrides=overrides))
    plain = resolve_plan(ckpt, "host", BuildOptions())
    assert plan.config.model_rope and plan.config.rope_scaling["rope_type"] == "yarn"
    assert plain.config.rope_scaling is None
    assert plan.cache_key() != plain.cache_key()
    assert plan.as_dict()["model"]["hf_overrides"] == {"rope_scaling": YARN}
    assert "hf_overrides" not in plain.as_dict()["model"]

    artifact = build_artifact(plain_gguf, "host", "float32", checkpoint=ckpt, hf_overrides=overrides)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["hf_overrides"] == {"rope_scaling": YARN}
    assert manifest["build"]["provenance"]["options"]["hf_overrides"] == overrides

    ref_prompt, ref_tokens, _ = greedy(eager_model(_with_yarn(tiny_shape_dir("qwen2-bias"), tmp_path / "yarn")),
                                       PROMPT, 8)
    gen = Generator(CompiledModel(artifact, ckpt), max_model_len=256)  # the unchanged GGUF loads
    err = float(np.abs(gen.prompt_logits(PROMPT) - ref_prompt).max())
    print("gguf + --hf-overrides yarn: prompt max |diff|", err)
    assert err < TOL
    assert gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8)).token_ids == ref_tokens
    # the scaling bites: the plain model is far from it
    plain_gen = Generator(CompiledModel(build_artifact(plain_gguf, "host", "float32", checkpoint=ckpt), ckpt), 256)
    assert float(np.abs(plain_gen.prompt_logits(PROMPT) - ref_prompt)[1:].max()) > 100 * TOL

    # the runtime applies the manifest's record: without it the checkpoint no longer matches
    stripped = tmp_path / "stripped"
    shutil.copytree(artifact, stripped)
    del manifest["hf_overrides"]
    (stripped / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="built for another config.*rope_scaling"):
        CompiledModel(stripped, ckpt)


def test_the_cli_builds_with_them_and_refuses_bad_json_or_other_overrides(tiny_model_dir):
    """`vtool build --hf-overrides` then `vtool run --artifact` on the tiny chat model (linear
    scaling x2): the artifact needs the flag no more, the same flag again is accepted, other
    overrides and text that is not JSON are refused by name."""
    overrides = json.dumps({"rope_scaling": {"rope_type": "linear", "factor": 2.0}})

    def vtool(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "vtool.toolchain.cli", *args, "--model", str(tiny_model_dir)],
                              capture_output=True, text=True, timeout=600)

    built = vtool("build", "--hf-overrides", overrides)
    assert built.returncode == 0, built.stderr
    artifact = built.stdout.strip().splitlines()[-1]
    assert json.loads((Path(artifact) / "manifest.json").read_text())["hf_overrides"] == json.loads(overrides)
    plain = build_artifact(tiny_model_dir, "host", "float32")
    assert Path(artifact) != plain

    run = ("run", "--max-tokens", "8", "--prompt", "The capital of France is")
    alone = vtool(*run, "--artifact", artifact)  # the artifact carries its own
    assert alone.returncode == 0, alone.stderr
    same = vtool(*run, "--artifact", artifact, "--hf-overrides", overrides)
    assert same.returncode == 0 and same.stdout == alone.stdout, same.stderr
    unscaled = vtool(*run, "--artifact", str(plain))
    assert unscaled.returncode == 0 and unscaled.stdout != alone.stdout  # the scaling changes the text

    for flags, message in ((("--hf-overrides", "{rope_scaling: 1}"), "--hf-overrides is not JSON"),
                           (("--artifact", artifact, "--hf-overrides", '{"max_position_embeddings": 512}'),
                            "differ from those")):
        refused = vtool(*run, *flags)
        assert refused.returncode != 0 and message in refused.stderr + refused.stdout, refused.stderr
        assert "Traceback" not in refused.stderr


def test_bench_serves_the_build_its_overrides_make(tiny_model_dir, tmp_path):
    """`vtool bench` (a local server of the build it makes) takes --hf-overrides as build and
    run do: the same overrides reuse build and run's cached artifact and the run completes; text
    that is not JSON, an --artifact built with other overrides, and the flag beside --url (a
    server already running) are refused by name, before any server starts."""
    overrides = json.dumps({"rope_scaling": {"rope_type": "linear", "factor": 2.0}})

    def vtool(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "vtool.toolchain.cli", *args], capture_output=True, text=True,
                              timeout=600)

    built = vtool("build", "--model", str(tiny_model_dir), "--hf-overrides", overrides)
    assert built.returncode == 0, built.stderr
    artifact = built.stdout.strip().splitlines()[-1]
    bench = ("bench", "--model", str(tiny_model_dir), "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
             "--concurrency", "1")
    report = tmp_path / "bench.json"
    done = vtool(*bench, "--hf-overrides", overrides, "--result-json", str(report))
    assert done.returncode == 0, done.stderr
    assert f"using cached build {artifact}" in done.stdout + done.stderr  # build's artifact: the same key
    assert [run["completed"] for run in json.loads(report.read_text())["runs"]] == [2]
    for flags, message in ((("--hf-overrides", "{rope_scaling: 1}"), "--hf-overrides is not JSON"),
                           (("--artifact", artifact, "--hf-overrides", '{"max_position_embeddings": 512}'),
                            "differ from those"),
                           (("--url", "http://127.0.0.1:9", "--hf-overrides", overrides), "with --url")):
        refused = vtool(*bench, *flags)
        assert refused.returncode != 0 and message in refused.stderr + refused.stdout, refused.stderr
        assert "Traceback" not in refused.stderr


@pytest.mark.parametrize("command", ["run", "serve"])
def test_bad_json_is_refused_before_the_model_is_looked_for(command, tmp_path):
    """The flag is checked first: with a model that does not exist, the error is still the JSON's."""
    done = subprocess.run([sys.executable, "-m", "vtool.toolchain.cli", command, "--model", str(tmp_path / "absent"),
                           "--hf-overrides", "{x"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--hf-overrides is not JSON" in done.stderr + done.stdout, done.stderr
    assert "Traceback" not in done.stderr
