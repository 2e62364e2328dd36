"""FP8 checkpoints (issue 17 item 2): safetensors whose linear weights are stored as e4m3 with a
`weight_scale` beside each (compressed-tensors' float-quantized format, ModelOpt's and vLLM's fp8
checkpoints), per row ([rows, 1]) or per tensor ([1] / []).

The checkpoints are written here with torch's own float32 -> float8_e4m3fn cast, as
llm-compressor writes them (scale = max|W| / 448 per row or per tensor, q = W / scale), so
nothing of vtool's quantizer is involved: `--quantization auto` (or `fp8`) takes the stored e4m3
weights and scales as they are, and the greedy tokens and logits equal transformers running
q * scale (within float32's 1e-4); the layers the checkpoint left float stay float. Refused by
name: any other --quantization (it would read e4m3 values without their scales), block-wise
scales, an FP8 tensor vtool does not keep in FP8 (lm_head here).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_oracle import assert_matches_in_memory_oracle
from tiny_models import make_tiny_model
from vtool import VtoolError

TOLERANCE = 1e-4
PROMPT = [1, 17, 42, 99, 7, 3, 250, 11, 64, 5, 200, 31]
STEPS = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEEP_FLOAT = "model.layers.1.mlp.down_proj"  # in the config's `ignore` list: stays bf16


def write_fp8_checkpoint(folder: Path, strategy: str, block: bool = False, lm_head: bool = False) -> Path:
    """A tiny llama stored as compressed-tensors FP8: projections e4m3 with a weight_scale per row
    ("channel", [rows, 1] bf16) or per tensor ("tensor", [1] float32), everything else bf16."""
    from safetensors.torch import load_file, save_file

    make_tiny_model("llama-gqa", folder)
    tensors = {}
    for name, w in load_file(folder / "model.safetensors").items():
        parts = name.split(".")
        quantize = (name.endswith(".weight") and parts[-2] in PROJECTIONS and not name.startswith(KEEP_FLOAT)) or \
            (lm_head and name == "lm_head.weight")
        if not quantize:
            tensors[name] = w.to(torch.bfloat16)
            continue
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
        scale = (amax / 448.0).to(torch.bfloat16 if strategy == "channel" else torch.float32)
        if block:  # a DeepSeek-style block-wise scale: not readable
            scale = torch.ones(w.shape[0] // 16, w.shape[1] // 16)
        tensors[name] = (w / scale.float().reshape(-1, 1)[: w.shape[0]] if not block else w).clamp(-448, 448) \
            .to(torch.float8_e4m3fn)
        tensors[name + "_scale"] = scale
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head", KEEP_FLOAT] if not lm_head else [KEEP_FLOAT]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def hf_on_stored_weights(folder: Path):
    """transformers' float32 model of `folder`'s config with every weight as the checkpoint
    defines it: e4m3 values times their scale, the rest widened from bf16."""
    import transformers
    from safetensors.torch import load_file

    stored = load_file(folder / "model.safetensors")
    config = transformers.AutoConfig.from_pretrained(str(folder))
    del config.quantization_config  # the oracle runs the dequantized weights in float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            w = stored[name]
            if w.dtype == torch.float8_e4m3fn:
                w = w.float() * stored[name + "_scale"].float().reshape(-1, 1)
            tensor.copy_(w.float())
    return model


_BUILT: dict[str, tuple] = {}


def built(strategy: str, tmp_path_factory) -> tuple:
    if strategy not in _BUILT:
        from vtool.runtime.artifact.library import CompiledModel
        from vtool.runtime.engine.generate import Generator
        from vtool.runtime.weights.checkpoint import open_checkpoint
        from vtool.toolchain.build import build_artifact

        folder = write_fp8_checkpoint(tmp_path_factory.mktemp(f"fp8ckpt-{strategy}") / "m", strategy)
        ckpt = open_checkpoint(folder)
        artifact = build_artifact(folder, "x86-portable", "float32", checkpoint=ckpt)  # --quantization auto
        _BUILT[strategy] = (folder, artifact, Generator(CompiledModel(artifact, ckpt), max_model_len=128))
    return _BUILT[strategy]


@pytest.mark.parametrize("strategy", ["channel", pytest.param("tensor", marks=pytest.mark.slow)])
def test_stored_fp8_weights_match_transformers(strategy, tmp_path_factory):
    folder, artifact, gen = built(strategy, tmp_path_factory)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"] == "fp8"
    assert manifest["quantized_weights"]["kept"] == {"FP8_E4M3": 7}  # 8 linears, one left float
    params = {p["name"]: p for p in manifest["params"]}
    assert params[KEEP_FLOAT + ".weight"]["dtype"] == "float32" and KEEP_FLOAT + ".weight_scale" not in params
    assert params["model.layers.0.mlp.down_proj.weight"]["dtype"] == "float8_e4m3fn"
    assert_matches_in_memory_oracle(gen, lambda: hf_on_stored_weights(folder), PROMPT, STEPS, TOLERANCE)


def test_the_stored_bytes_are_bound_as_they_are(tmp_path_factory):
    """Not re-quantized: the bound e4m3 rows of a fused q|k|v are the checkpoint's q, k and v
    bytes stacked, and the row scales each tensor's own."""
    from safetensors.torch import load_file

    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.runtime.weights.fp8 import load_fp8

    folder, _, _ = built("channel", tmp_path_factory)
    stored = load_file(folder / "model.safetensors")
    sources = [f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
    q, s = load_fp8(open_checkpoint(folder), sources, "concat_rows")
    want = torch.cat([stored[n] for n in sources]).view(torch.uint8).numpy()
    np.testing.assert_array_equal(q.view(np.uint8), want)
    np.testing.assert_array_equal(s, torch.cat([stored[n + "_scale"].float().reshape(-1) for n in sources]).numpy())


def test_other_quantizations_and_unreadable_layouts_are_refused(tmp_path):
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.toolchain.build import build_artifact

    folder = write_fp8_checkpoint(tmp_path / "ch", "channel")
    for scheme in ("none", "q4_1"):
        with pytest.raises(VtoolError, match=r"is an FP8 checkpoint .* build it with --quantization fp8 \(or auto\); "
                                             rf"--quantization {scheme} would read the e4m3 values without"):
            build_artifact(folder, "x86-portable", "float32", checkpoint=open_checkpoint(folder), quantization=scheme)
    block = write_fp8_checkpoint(tmp_path / "block", "channel", block=True)
    with pytest.raises(VtoolError, match=r"weight_scale' has shape \[\d+, \d+\]: .*block-wise ones .* are not"):
        build_artifact(block, "x86-portable", "float32", checkpoint=open_checkpoint(block))
    head = write_fp8_checkpoint(tmp_path / "head", "channel", lm_head=True)
    with pytest.raises(VtoolError, match=r"'lm_head.weight' is stored as FP8, but vtool keeps FP8 weights only in "
                                         r"decoder linears"):
        build_artifact(head, "x86-portable", "float32", checkpoint=open_checkpoint(head))
