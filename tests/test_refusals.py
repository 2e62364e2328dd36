"""Each refusal is an error that names what it saw and what it accepts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from vtool import VtoolError
from vtool.models.config import ConfigError, parse_hf_config
from vtool.models.registry import ARCHITECTURES as SUPPORTED_ARCHITECTURES
from vtool.models.weights import WeightPlanError
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.runtime.artifact.manifest import ManifestError
from vtool.targets import TargetError
from vtool.toolchain.build import build_artifact


@pytest.fixture(scope="module")
def tiny_dir(tiny_shape_dir) -> Path:  # tests/conftest.py; read only (_copy_with copies it)
    return tiny_shape_dir("llama-gqa")


def _copy_with(tiny_dir: Path, dest: Path, config_edit=None, tensors_edit=None) -> Path:
    dest.mkdir()
    config = json.loads((tiny_dir / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (dest / "config.json").write_text(json.dumps(config))
    tensors = load_file(tiny_dir / "model.safetensors")
    if tensors_edit:
        tensors_edit(tensors)
    save_file(tensors, dest / "model.safetensors")
    return dest


def test_unknown_architecture_is_named(tiny_dir, tmp_path):
    bad = _copy_with(tiny_dir, tmp_path / "m", lambda c: c.update(architectures=["GPTNeoXForCausalLM"]))
    with pytest.raises(ConfigError) as err:
        build_artifact(bad, "host")
    assert "GPTNeoXForCausalLM" in str(err.value)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    bad = _copy_with(tiny_dir, tmp_path / "m", tensors_edit=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightPlanError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        build_artifact(bad, "host")


def test_shape_disagreeing_with_config_is_named(tiny_dir, tmp_path):
    bad = _copy_with(tiny_dir, tmp_path / "m", lambda c: c.update(intermediate_size=96))
    with pytest.raises(WeightPlanError, match=r"mlp\.gate_proj\.weight' has shape \[128, 64\] but the config implies \[96, 64\]"):
        build_artifact(bad, "host")


def test_artifact_built_for_another_config_is_refused(tiny_dir, tiny_shape_dir):
    artifact = build_artifact(tiny_dir, "host")
    other = tiny_shape_dir("qwen3-untied")
    with pytest.raises(ManifestError, match="built for another config") as err:
        CompiledModel(artifact, open_checkpoint(other))
    assert "architectures" in str(err.value)


def test_artifact_from_other_versions_is_refused(tiny_dir, tmp_path):
    import shutil

    artifact = build_artifact(tiny_dir, "host")
    copy = tmp_path / "art"
    shutil.copytree(artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["versions"]["tvm_ffi"] = "0.0.1"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="tvm_ffi 0.0.1"):
        CompiledModel(copy, open_checkpoint(tiny_dir))


def test_artifact_for_a_cpu_tier_this_machine_lacks_is_refused(tiny_dir, monkeypatch):
    import vtool.runtime.artifact.library as artifact_mod

    artifact = build_artifact(tiny_dir, "x86-avx2")
    monkeypatch.setattr(artifact_mod, "host_cpu_flags", lambda: {"sse2", "avx"})  # a pre-Haswell CPU
    with pytest.raises(ManifestError, match="x86-avx2, which this CPU cannot execute.*avx2"):
        CompiledModel(artifact, open_checkpoint(tiny_dir))


def test_unbuildable_and_unknown_targets_are_named(tiny_dir):
    with pytest.raises(TargetError, match="'rocm' cannot be built yet.*buildable targets: host, x86-portable"):
        build_artifact(tiny_dir, "rocm")
    with pytest.raises(TargetError, match="unknown target 'tpu-v9'; known targets: host"):
        build_artifact(tiny_dir, "tpu-v9")


def test_unsupported_dtype_is_named(tiny_dir):
    with pytest.raises(VtoolError, match="unsupported dtype 'int8'; supported: float32, float16, bfloat16"):
        build_artifact(tiny_dir, "host", "int8")


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5000), st.floats(allow_nan=True),
                     st.text(max_size=8), st.sampled_from(["llama3", "yarn", "default"]))
_values = st.one_of(_scalars, st.lists(st.integers(0, 5), max_size=3),
                    st.dictionaries(st.sampled_from(["rope_type", "type", "factor", "low_freq_factor",
                                                     "high_freq_factor", "original_max_position_embeddings"]),
                                    _scalars))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["architectures", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                        "head_dim", "intermediate_size", "num_hidden_layers", "vocab_size",
                                        "rope_theta", "rope_scaling", "hidden_act", "max_position_embeddings"]),
                       _values))
def test_config_parser_only_raises_config_errors(partial):
    """Whatever a config.json holds, the parser answers with a ModelConfig or a ConfigError."""
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 100}
    base.update(partial)
    try:
        cfg = parse_hf_config(base)
    except ConfigError as err:
        assert str(err)
    else:
        assert cfg.hidden_size > 0 and cfg.head_dim % 2 == 0
        assert cfg.num_attention_heads % cfg.num_key_value_heads == 0


def test_token_id_outside_vocabulary_is_refused_not_read(tiny_dir):
    """The compiled embedding gather has no bounds check; the runtime refuses the id first."""
    from vtool.runtime.engine.generate import Generator
    from vtool.runtime.sampling.params import SamplingParams

    gen = Generator(CompiledModel(build_artifact(tiny_dir, "host"), open_checkpoint(tiny_dir)), 64)
    for bad in (512, 10**6, -1):
        with pytest.raises(VtoolError, match=f"token id {bad} is outside the vocabulary \\(0..511\\)"):
            gen.generate([1, 2, bad], SamplingParams(temperature=0, max_tokens=4))
    assert len(gen.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4)).token_ids) == 4  # still usable afterwards
