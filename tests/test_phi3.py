"""Phi-3 (Phi3ForCausalLM): q|k|v and gate|up stored fused. From safetensors, the tiny shape is
in test_parity_tiny.py (logits within 1e-4 of transformers, 32 greedy steps). Here: the same
checkpoint written as llama.cpp's "phi3" GGUF (names from gguf-py's tensor map, metadata as
llama.cpp's converter writes it) gives transformers' logits and tokens too, float and with its
matrices in Q8_0 blocks kept by the integer-dot kernels; the sliding window caps the context;
longrope factor tensors and a partial rotary factor are refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hf_oracle import greedy
from vtool.models.config import ConfigError, parse_hf_config
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.engine.generate import Generator
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.weights.checkpoint import CheckpointError, open_checkpoint
from vtool.toolchain.build import build_artifact

PROMPT = [1, 5, 17, 42, 99, 7, 3, 250, 11, 300, 64]
STEPS = 24


def write_phi3_gguf(folder: Path, path: Path, matrices: "gguf.GGMLQuantizationType" = gguf.GGMLQuantizationType.F32,
                    sliding_window: int = 0, extra: dict[str, np.ndarray] | None = None) -> Path:
    """The tiny HF Phi-3 in `folder` as a phi3 GGUF."""
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_sliding_window(sliding_window)
    w.add_vocab_size(cfg["vocab_size"])
    for hf, arr in tensors.items():
        module, leaf = hf.rsplit(".", 1)
        name = names.get_name(module) + "." + leaf
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 2 and matrices != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(arr, matrices), raw_dtype=matrices)
        else:
            w.add_tensor(name, arr)
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def phi3(tiny_shape_dir):
    folder = tiny_shape_dir("phi3-fused")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, greedy(hf, PROMPT, STEPS), hf


def test_a_phi3_gguf_gives_transformers_logits_and_tokens(phi3, tmp_path):
    folder, (ref_prompt, ref_tokens, ref_logits), _hf = phi3
    path = write_phi3_gguf(folder, tmp_path / "phi3.gguf")
    ckpt = open_checkpoint(path)
    assert ckpt.config()["architectures"] == ["Phi3ForCausalLM"]
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= set(ckpt.tensors())
    gen = Generator(CompiledModel(build_artifact(path, "host", "float32"), ckpt), max_model_len=256)
    assert float(np.abs(gen.prompt_logits(PROMPT) - ref_prompt).max()) < 1e-4
    seen: list[np.ndarray] = []
    result = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=STEPS), on_logits=seen.append)
    assert result.token_ids == ref_tokens
    assert max(float(np.abs(a - b).max()) for a, b in zip(seen, ref_logits)) < 1e-4


def test_q8_0_blocks_of_the_fused_tensors_stay_in_blocks(phi3, tmp_path):
    """Each fused matrix is one Q8_0 block matrix, kept as such; its logits stay near the float
    model's (Q8_0 weights and activations: the bound is loose, the tokens mostly agree)."""
    folder, (ref_prompt, ref_tokens, _), _hf = phi3
    path = write_phi3_gguf(folder, tmp_path / "phi3-q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    artifact = build_artifact(path, "host", "float32", quantization="gguf")
    kept = json.loads((artifact / "manifest.json").read_text())["quantized_weights"]["kept"]
    assert kept.get("Q8_0", 0) >= 4 * 2  # qkv, o, gate|up, down in both layers (and the embeddings)
    gen = Generator(CompiledModel(artifact, open_checkpoint(path)), max_model_len=256)
    err = float(np.abs(gen.prompt_logits(PROMPT) - ref_prompt).max())
    assert err < 0.1 * float(np.abs(ref_prompt).max()), err
    tokens = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8)).token_ids
    assert tokens[:2] == ref_tokens[:2]


def test_the_sliding_window_caps_the_context(phi3, tmp_path):
    folder, _, _ = phi3
    ckpt = open_checkpoint(write_phi3_gguf(folder, tmp_path / "w.gguf", sliding_window=100))
    assert ckpt.config()["sliding_window"] == 100
    assert parse_hf_config(ckpt.config()).max_position_embeddings == 100
    raw = {**json.loads((folder / "config.json").read_text()), "sliding_window": 64}
    assert parse_hf_config(raw).max_position_embeddings == 64


def test_longrope_and_partial_rotary_are_refused_by_name(phi3, tmp_path):
    folder, _, _ = phi3
    half = json.loads((folder / "config.json").read_text())["hidden_size"] // 8
    path = write_phi3_gguf(folder, tmp_path / "l.gguf",
                           extra={"rope_factors_long.weight": np.ones(half, np.float32),
                                  "rope_factors_short.weight": np.ones(half, np.float32)})
    with pytest.raises(CheckpointError, match="longrope"):
        open_checkpoint(path).config()
    raw = {**json.loads((folder / "config.json").read_text()), "partial_rotary_factor": 0.75}
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        parse_hf_config(raw)
    longrope = {**json.loads((folder / "config.json").read_text()),
                "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}
    with pytest.raises(ConfigError, match="longrope"):
        parse_hf_config(longrope)
