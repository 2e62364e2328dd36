"""Whole models with weights kept in GGUF blocks (`--quantization gguf`), on tiny llama
GGUF files quantized by gguf-py: greedy tokens and logits against transformers running
the same file through its own GGUF loader (which dequantizes to float32), the manifest's
record of what stayed quantized, and the refusals.

Tolerance: logits within 1e-4 of transformers (as the float32 parity tests): the weights
are dequantized exactly in both, only summation order differs.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_oracle import greedy
from quant_gguf import Q, write_tiny_gguf
from vtool import VtoolError
from vtool.runtime.artifact import CompiledModel
from vtool.runtime.checkpoint import open_checkpoint
from vtool.runtime.generate import Generator
from vtool.runtime.manifest import ManifestError
from vtool.runtime.sampling_params import SamplingParams
from vtool.toolchain.build import build_artifact

TOLERANCE = 1e-4
STEPS = 16
PROMPT = [1, 17, 42, 99, 7, 3, 250, 11, 64, 5, 200, 31]

# name -> (type of each 2-D tensor by GGUF name, tied embedding, what the manifest must keep)
VARIANTS = {
    "q8_0": (lambda name: Q.Q8_0, True, {"Q8_0": 9}),
    "q4_0": (lambda name: Q.Q8_0 if name == "token_embd.weight" else Q.Q4_0, False, {"Q4_0": 9, "Q8_0": 1}),
    # SmolLM2's mix: Q4_1 layers, Q8_0 tied embedding
    "q4_1": (lambda name: Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1, True, {"Q4_1": 8, "Q8_0": 1}),
    # v in another format than q/k: the fused qkv cannot be one block matrix and is dequantized
    "mixed": (lambda name: Q.Q8_0 if ".attn_v." in name else Q.Q4_1 if name != "output.weight" else Q.Q4_0,
              False, {"Q4_1": 7, "Q4_0": 1}),
}


def _hf_model(path: Path):
    import transformers

    kwargs = {"gguf_file": path.name, "dtype": torch.float32}
    if hasattr(transformers, "GgufConfig"):
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), **kwargs).eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    qtype_of, tie, kept = VARIANTS[request.param]
    path = write_tiny_gguf(tmp_path_factory.mktemp(request.param) / "m.gguf", qtype_of, tie=tie)
    ckpt = open_checkpoint(path)
    artifact = build_artifact(path, "host", "float32", checkpoint=ckpt, quantization="gguf")
    return request.param, path, artifact, Generator(CompiledModel(artifact, ckpt), max_model_len=128), kept


def test_manifest_records_the_kept_formats(variant):
    name, path, artifact, _, kept = variant
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"] == "gguf"
    assert manifest["quantized_weights"]["kept"] == kept
    quant_bytes = sum(int(np.prod(e["shape"])) * np.dtype(e["dtype"]).itemsize
                      for e in manifest["params"] if "quant" in e)
    assert quant_bytes > 0
    if name == "mixed":
        assert manifest["quantized_weights"]["dequantized"] == {
            f"model.layers.{i}.self_attn.qkv_proj": "Q4_1+Q8_0" for i in range(2)}
    else:  # every 2-D weight stays in blocks: about the file's size, never a float copy
        assert quant_bytes < 1.3 * path.stat().st_size


def test_greedy_and_logits_match_transformers(variant):
    name, path, _, gen, _ = variant
    _, ref_tokens, ref_logits = greedy(_hf_model(path), PROMPT, STEPS)
    assert len(set(ref_tokens)) > 4, f"{name}: the reference is degenerate, the check would be weak"
    seen: list[np.ndarray] = []
    result = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=STEPS), on_logits=seen.append)
    assert result.token_ids == ref_tokens, f"{name}: greedy tokens diverge"
    worst = max(float(np.abs(a - b).max()) for a, b in zip(seen, ref_logits))
    assert worst < TOLERANCE, f"{name}: decode logits differ by {worst}"


def test_prompt_logits_match_transformers(variant):
    """Every prompt position at once: the GEMM (prefill) schedule of each kernel."""
    name, path, _, gen, _ = variant
    ref, _, _ = greedy(_hf_model(path), PROMPT, 1)
    worst = float(np.abs(gen.prompt_logits(PROMPT) - ref).max())
    assert worst < TOLERANCE, f"{name}: prompt logits differ by {worst}"


def test_artifact_refuses_a_file_in_other_formats(tmp_path):
    """Same config, other block formats: refused by tensor name before anything is read."""
    q41 = write_tiny_gguf(tmp_path / "a.gguf", VARIANTS["q4_1"][0], tie=True)
    q80 = write_tiny_gguf(tmp_path / "b.gguf", VARIANTS["q8_0"][0], tie=True)
    artifact = build_artifact(q41, "host", "float32", quantization="gguf")
    with pytest.raises(ManifestError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.* stored as Q8_0.*as Q4_1"):
        CompiledModel(artifact, open_checkpoint(q80))


def test_quantization_none_binds_any_file(tmp_path):
    """--quantization none dequantizes at load: one artifact serves both files."""
    q41 = write_tiny_gguf(tmp_path / "a.gguf", VARIANTS["q4_1"][0], tie=True)
    q80 = write_tiny_gguf(tmp_path / "b.gguf", VARIANTS["q8_0"][0], tie=True)
    artifact = build_artifact(q41, "host", "float32", quantization="none")
    assert json.loads((artifact / "manifest.json").read_text())["quantization"] == "none"
    CompiledModel(artifact, open_checkpoint(q80))


def test_refusals(tmp_path):
    from tiny_models import make_tiny_model

    gguf_file = write_tiny_gguf(tmp_path / "a.gguf", VARIANTS["q4_1"][0], tie=True)
    with pytest.raises(VtoolError, match="unknown quantization 'q3'.*auto, none, gguf"):
        build_artifact(gguf_file, "host", quantization="q3")
    folder = make_tiny_model("llama-gqa", tmp_path / "st")
    with pytest.raises(VtoolError, match="--quantization gguf keeps a GGUF file's quantized blocks.*safetensors"):
        build_artifact(folder, "host", quantization="gguf")
    f32 = write_tiny_gguf(tmp_path / "f32.gguf", lambda name: Q.F32)
    with pytest.raises(VtoolError, match="has no weight stored as Q8_0, Q4_0 or Q4_1"):
        build_artifact(f32, "host", quantization="gguf")


def test_cuda_target_refused_by_name(tmp_path):
    from vtool.targets import buildable

    try:
        buildable("sm_90a")
    except VtoolError as e:
        pytest.skip(f"no CUDA build here: {e}")
    gguf_file = write_tiny_gguf(tmp_path / "a.gguf", VARIANTS["q4_1"][0], tie=True)
    with pytest.raises(VtoolError, match="kernels for x86 CPU targets only, not sm_90a"):
        build_artifact(gguf_file, "sm_90a", "bfloat16", quantization="gguf")


def test_old_manifest_format_refused(tmp_path):
    from vtool.runtime.manifest import read_manifest

    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 1}))
    with pytest.raises(ManifestError, match="manifest format 1; this vtool reads format 2"):
        read_manifest(tmp_path)
