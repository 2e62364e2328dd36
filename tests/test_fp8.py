"""`--quantization fp8` (issue 17): e4m3 linear weights with a float32 scale per row, quantized
from a float checkpoint when the artifact loads (runtime/weights/fp8.py, models/fp8_linear.py).

- The quantizer against torch's own float32 -> float8_e4m3fn cast (an implementation nobody
  here wrote), with hypothesis over shapes and magnitudes: the same bytes, the scale each row's
  max / 448, every weight within half an e4m3 step of itself; all-zero rows, non-finite values.
- A tiny float32 build on the CPU (every matmul W8A16 there) against transformers running the
  same dequantized weights (q * s): greedy tokens identical, logits within the float32 bound
  of the other parity tests; and the check is not vacuous (the float model differs).
- The manifest and the plan: which weights are FP8 (decoder linears; the embedding and
  lm_head keep the dtype, as vLLM), the refusals (a GGUF file, an MoE family, no fitting weight).
The CUDA side (W8A8 on the FP8 tensor cores through cuBLASLt) is tests/test_gpu_fp8.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from cli_run import cli_run_matches_the_api
from hf_oracle import assert_matches_in_memory_oracle, greedy
from test_quantize_safetensors import tiny_checkpoint
from tiny_models import make_tiny_model
from vtool import VtoolError
from vtool.runtime.weights.fp8 import Fp8Error, dequantize_rows, quantize_rows
from vtool.runtime.weights.fp8_layout import E4M3_MAX, FP8_FORMAT

TOLERANCE = 1e-4  # float32 summation order only: the bound of test_quantize_safetensors.py
PROMPT = [1, 17, 42, 99, 7, 3, 250, 11, 64, 5, 200, 31]
STEPS = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def torch_e4m3(values: np.ndarray) -> np.ndarray:
    """torch's float32 -> float8_e4m3fn cast (round to nearest even), as raw bytes."""
    return torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def _rows(draw_shape=st.tuples(st.integers(1, 9), st.integers(1, 70))):
    return draw_shape.flatmap(lambda shape: st.tuples(
        arrays(np.float32, shape, elements=st.floats(-1.0, 1.0, width=32)),
        arrays(np.float32, (shape[0], 1), elements=st.sampled_from([2.0 ** e for e in range(-30, 30, 7)]))))


@settings(max_examples=60, deadline=None)
@given(_rows())
def test_quantizer_is_torchs_cast_of_the_row_over_its_scale(case):
    unit, magnitude = case
    w = unit * magnitude  # rows of very different magnitudes: each gets its own scale
    q, s = quantize_rows(w)
    amax = np.abs(w).max(axis=1)
    scale = amax / np.float32(E4M3_MAX)
    np.testing.assert_array_equal(s, np.where(scale > 0, scale, 1).astype(np.float32))  # 1: a zero (or < 1e-42) row
    expected = torch_e4m3(np.clip(w / s[:, None], -E4M3_MAX, E4M3_MAX))
    np.testing.assert_array_equal(q.view(np.uint8), expected)
    # e4m3: 3 mantissa bits, so a normal value is within 2^-4 of itself; below 2^-6 (subnormal)
    # the step is 2^-9 of the scale. A row whose largest weight is under ~5e-36 gets a scale that
    # is itself a float32 subnormal, stored to within half of 2^-149, which q (up to 448) multiplies.
    back = dequantize_rows(q, s)
    bound = np.maximum(np.abs(w) * 2.0 ** -4, s[:, None] * 2.0 ** -10) * (1 + 1e-6)
    bound += np.where(s[:, None] < np.finfo(np.float32).tiny, E4M3_MAX * 2.0 ** -149, 0.0)
    assert np.all(np.abs(back - w) <= bound)
    assert np.all(np.abs(q.astype(np.float32)) <= E4M3_MAX)


def test_each_rows_largest_weight_is_exact_and_zero_rows_stay_zero():
    w = np.array([[0.5, -3.0, 1.0], [0.0, 0.0, 0.0], [1e-30, 0.0, -2e-30]], np.float32)
    q, s = quantize_rows(w)
    assert q.astype(np.float32)[0, 1] == -E4M3_MAX and s[0] == np.float32(3.0 / E4M3_MAX)
    assert s[1] == 1.0 and not q.astype(np.float32)[1].any()
    assert dequantize_rows(q, s)[2, 2] == pytest.approx(-2e-30, rel=1e-6)


def test_rows_are_quantized_in_chunks_like_whole():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2500, 32)).astype(np.float32) * rng.uniform(0.01, 10, (2500, 1)).astype(np.float32)
    q, s = quantize_rows(w)
    np.testing.assert_array_equal(q.view(np.uint8), torch_e4m3(np.clip(w / s[:, None], -448, 448)))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_weight_is_refused_by_row(bad):
    w = np.ones((4, 16), np.float32)
    w[2, 5] = bad
    with pytest.raises(Fp8Error, match=r"layers\.0\.mlp\.down_proj\.weight: row 2 holds a non-finite value"):
        quantize_rows(w, "layers.0.mlp.down_proj.weight")


# -- a tiny model, built for the CPU ---------------------------------------------------------

_BUILT: dict[str, tuple] = {}


def built(shape: str, tmp_path_factory) -> tuple:
    """(folder, artifact, Generator) of a bf16-stored tiny checkpoint built with fp8 at float32."""
    if shape not in _BUILT:
        from vtool.runtime.artifact.library import CompiledModel
        from vtool.runtime.engine.generate import Generator
        from vtool.runtime.weights.checkpoint import open_checkpoint
        from vtool.toolchain.build import build_artifact

        folder = tiny_checkpoint(shape, "bfloat16", tmp_path_factory.mktemp(f"fp8-{shape}") / "m")
        ckpt = open_checkpoint(folder)
        artifact = build_artifact(folder, "x86-portable", "float32", checkpoint=ckpt, quantization="fp8")
        _BUILT[shape] = (folder, artifact, Generator(CompiledModel(artifact, ckpt), max_model_len=128))
    return _BUILT[shape]


def hf_on_fp8_weights(folder: Path):
    """transformers' float32 model of `folder`, every decoder projection replaced by q * s of
    its own rows (per row, so it does not matter that vtool fuses q|k|v and gate|up)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
                tensor.copy_(torch.from_numpy(dequantize_rows(*quantize_rows(tensor.numpy()))))
    return model


@pytest.mark.parametrize("shape", ["llama-gqa", pytest.param("qwen2-bias", marks=pytest.mark.slow)])
def test_greedy_and_logits_match_transformers_on_the_same_weights(shape, tmp_path_factory):
    folder, _, gen = built(shape, tmp_path_factory)
    assert_matches_in_memory_oracle(gen, lambda: hf_on_fp8_weights(folder), PROMPT, STEPS, TOLERANCE)


def test_fp8_differs_from_the_float_model(tmp_path_factory):
    """The parity above is not vacuous: the bf16 checkpoint's own logits are measurably different."""
    import transformers

    folder, _, gen = built("llama-gqa", tmp_path_factory)
    ref, _, _ = greedy(transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval(),
                       PROMPT, 1)
    assert float(np.abs(gen.prompt_logits(PROMPT) - ref).max()) > 100 * TOLERANCE


def test_manifest_keeps_decoder_linears_in_fp8_and_the_rest_float(tmp_path_factory):
    _, artifact, _ = built("llama-gqa", tmp_path_factory)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"] == "fp8"
    assert manifest["quantized_weights"]["kept"] == {FP8_FORMAT: 8}  # 2 layers x qkv, o, gate_up, down
    assert manifest["quantized_weights"]["fp8_matmuls"] == {"decode": "W8A16", "prompts_and_batches": "W8A16"}
    assert "weights_file" not in manifest  # quantized at load: the artifact holds no copy of the weights
    params = {p["name"]: p for p in manifest["params"]}
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv["dtype"] == "float8_e4m3fn" and qkv["fp8"] == {"part": "weight"}
    assert qkv["sources"] == [f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
    scale = params["model.layers.0.self_attn.qkv_proj.weight_scale"]
    assert scale["dtype"] == "float32" and scale["shape"] == [qkv["shape"][0]] and scale["sources"] == qkv["sources"]
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert params[name]["dtype"] == "float32" and "fp8" not in params[name]


def test_refusals(tmp_path):
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.toolchain.build import build_artifact

    moe = make_tiny_model("qwen3moe-experts", tmp_path / "moe")
    with pytest.raises(VtoolError, match=r"--quantization fp8: the qwen3_moe family .* has no FP8 layers"):
        build_artifact(moe, "x86-portable", "float32", checkpoint=open_checkpoint(moe), quantization="fp8")


def test_a_gguf_file_is_refused(tmp_path):
    from quant_gguf import VARIANTS, write_tiny_gguf
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.toolchain.build import build_artifact

    path = write_tiny_gguf(tmp_path / "m.gguf", VARIANTS["q8_0"][0])
    with pytest.raises(VtoolError, match=r"--quantization fp8 quantizes a float \(safetensors\) checkpoint.*GGUF"):
        build_artifact(path, "x86-portable", "float32", checkpoint=open_checkpoint(path), quantization="fp8")


def test_loading_refuses_a_non_finite_weight_by_name(tmp_path_factory, tmp_path):
    """The artifact quantizes at load: a checkpoint of the same config with an inf in a projection
    is refused naming the tensor, not bound as nan."""
    from safetensors.torch import load_file, save_file

    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint

    folder, artifact, _ = built("llama-gqa", tmp_path_factory)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 0] = float("inf")
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(VtoolError, match=r"mlp\.gate_proj\.weight\+model\.layers\.1\.mlp\.up_proj\.weight: row 131"):
        CompiledModel(artifact, open_checkpoint(bad))


def test_an_e5m2_checkpoint_is_refused_by_name(tmp_path):
    """FP8 checkpoints in e4m3 are read (tests/test_fp8_checkpoint.py); e5m2 weights are not:
    refused naming the tensor, rather than as an unknown dtype."""
    from safetensors.torch import save_file

    from vtool.runtime.weights.checkpoint import CheckpointError, open_checkpoint

    make_tiny_model("llama-gqa", tmp_path / "m")
    save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 128).to(torch.float8_e5m2),
               "model.layers.0.mlp.down_proj.weight_scale": torch.ones(1)}, tmp_path / "m" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"down_proj\.weight' has dtype F8_E5M2: e5m2 weights are not read"):
        open_checkpoint(tmp_path / "m").tensors()


@pytest.mark.slow
def test_cli_run_quantizes_at_load_and_matches_the_api(tiny_model_dir):
    """`vtool run --model DIR --quantization fp8` as a user types it, on the host: it builds the
    artifact the API finds in the cache, its text is the API's greedy text on that artifact, and
    the prompt logits equal transformers' on the same e4m3 weights."""
    _artifact, session, ids = cli_run_matches_the_api(tiny_model_dir, "fp8", "The capital of France is", 8)
    ref, _, _ = greedy(hf_on_fp8_weights(tiny_model_dir), ids, 1)
    assert float(np.abs(session.generator.prompt_logits(ids) - ref).max()) < TOLERANCE
