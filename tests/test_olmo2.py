"""OLMo-2 (Olmo2ForCausalLM): norms after attention and the MLP, q/k RMSNorm over all heads.
From safetensors, the tiny shape is in test_parity_tiny.py (logits within 1e-4 of transformers,
32 greedy steps). Here: the same checkpoint as llama.cpp's "olmo2" GGUF (float, and with Q8_0
blocks kept) gives transformers' logits and tokens; the config's norm layout, and a checkpoint
with the wrong q/k norm size refused by name."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from hf_gguf import write_hf_as_gguf
from hf_oracle import greedy
from vtool.models.config import parse_hf_config
from vtool.models.weights import WeightPlanError, check_checkpoint_shapes
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.engine.generate import Generator
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.toolchain.build import build_artifact

PROMPT = [1, 5, 17, 42, 99, 7, 3, 250, 11, 300, 64]
STEPS = 24


@pytest.fixture(scope="module")
def olmo2(tiny_shape_dir):
    from transformers import AutoModelForCausalLM

    folder = tiny_shape_dir("olmo2-postnorm")
    return folder, greedy(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), PROMPT, STEPS)


def test_the_config_says_norms_after_and_qk_norms_over_all_heads(olmo2):
    folder, _ = olmo2
    c = parse_hf_config(json.loads((folder / "config.json").read_text()))
    assert c.post_norms and c.qk_norm and c.qk_norm_full and c.family == "olmo2"
    ckpt = open_checkpoint(folder)
    shapes = {name: info.shape for name, info in ckpt.tensors().items()}
    check_checkpoint_shapes(c, shapes, "tiny")
    shapes["model.layers.0.self_attn.k_norm.weight"] = (c.head_dim,)  # Qwen3's per-head size
    with pytest.raises(WeightPlanError, match="k_norm"):
        check_checkpoint_shapes(c, shapes, "tiny")


@pytest.mark.parametrize("matrices", ["F32", "Q8_0"])
def test_an_olmo2_gguf_gives_transformers_logits_and_tokens(olmo2, tmp_path, matrices):
    folder, (ref_prompt, ref_tokens, ref_logits) = olmo2
    path = write_hf_as_gguf(folder, tmp_path / "olmo2.gguf", gguf.MODEL_ARCH.OLMO2,
                            gguf.GGMLQuantizationType[matrices])
    ckpt = open_checkpoint(path)
    assert ckpt.config()["architectures"] == ["Olmo2ForCausalLM"]
    artifact = build_artifact(path, "host", "float32")
    gen = Generator(CompiledModel(artifact, ckpt), max_model_len=256)
    err = float(np.abs(gen.prompt_logits(PROMPT) - ref_prompt).max())
    if matrices == "F32":
        assert err < 1e-4
        seen: list[np.ndarray] = []
        result = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=STEPS), on_logits=seen.append)
        assert result.token_ids == ref_tokens
        assert max(float(np.abs(a - b).max()) for a, b in zip(seen, ref_logits)) < 1e-4
    else:  # Q8_0 weights kept in blocks (and Q8_0 activations): near, not equal
        kept = json.loads((artifact / "manifest.json").read_text())["quantized_weights"]["kept"]
        assert kept.get("Q8_0", 0) >= 4 * 2
        assert err < 0.1 * float(np.abs(ref_prompt).max()), err
        assert gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4)).token_ids[:2] == ref_tokens[:2]
