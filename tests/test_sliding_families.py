"""Real sliding windows for Mistral and Phi-3 (every layer), OLMo-3 (its layer_types), and
Phi-3's longrope scaling, from safetensors, against transformers at float32 (eager attention,
which applies the window's mask).

The tiny shapes (tests/support/tiny_models.py) have a window of 8 and the prompt is 40 tokens,
so the window masks keys in the prompt and in every decode step; their head dims (16, 32) take
vtool's own CPU sliding-window kernels (schedules/cpu/attention.py). Longrope: one set of
factors per build (models/phi3.py): the short factors for a model whose context is at most
original_max_position_embeddings (transformers then uses them on every sequence), the long ones
otherwise (transformers uses them on every sequence longer than original_max_position_embeddings,
as here: 11 prompt tokens past an original context of 8)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from eager_parity import compare_greedy, eager_model, reference_rounding
from hf_oracle import greedy
from vtool.models.config import ConfigError, parse_hf_config
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.engine.generate import Generator
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.toolchain.build import build_artifact

PROMPT = [1] + np.random.default_rng(1).integers(3, 500, 39).tolist()  # 40 tokens: 5 windows of 8
SHORT_PROMPT = [1, 5, 17, 42, 99, 7, 3, 250, 11, 300, 64]
STEPS = 24
TOL = 1e-4


def compare(folder: Path, prompt: list[int], max_model_len: int = 256) -> dict[str, float]:
    """vtool's prompt logits, greedy tokens and step logits against transformers' eager run."""
    return compare_greedy(folder, prompt, STEPS, max_model_len)[0]


@pytest.mark.parametrize("shape,family,layers", [("mistral-window", "llama", (0, 1)), ("phi3-window", "phi3", (0, 1)),
                                                 ("olmo3-window", "olmo3", (0, 2))])
def test_windowed_layers_match_transformers(shape, family, layers, tiny_shape_dir):
    folder = tiny_shape_dir(shape)
    c = parse_hf_config(json.loads((folder / "config.json").read_text()))
    assert (c.family, c.sliding_window, c.sliding_layers, c.max_position_embeddings) == (family, 8, layers, 512)
    errors = compare(folder, PROMPT)
    rounding = reference_rounding(folder, PROMPT, STEPS)  # AVX2's sum order: 1.04e-4 on Mistral's
    print(shape, "max |diff|", errors, "transformers' float32 rounding", rounding)
    assert max(errors.values()) < TOL + rounding, errors
    # the window is real: transformers without it gives other logits past the window
    with torch.no_grad():
        windowed = eager_model(folder)(torch.tensor([PROMPT])).logits[0].numpy()
        # (OLMo-3's mask needs a window: its layers all made global instead)
        full = {"layer_types": ["full_attention"] * c.num_hidden_layers} if family == "olmo3" else \
            {"sliding_window": None}
        unwindowed = eager_model(folder, **full)(torch.tensor([PROMPT])).logits[0].numpy()
    assert float(np.abs(unwindowed - windowed)[8:].max()) > 100 * TOL


def _longrope_folder(src: Path, dst: Path, original: int, max_pos: int, **extra) -> Path:
    """The tiny Phi-3 (no window) with longrope factors of its own, short ones near 1, long ones larger."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    half = cfg["hidden_size"] // cfg["num_attention_heads"] // 2
    rng = np.random.default_rng(7)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
            "short_factor": (1 + rng.uniform(0, 0.5, half)).round(4).tolist(),
            "long_factor": (1 + rng.uniform(0, 20, half)).round(4).tolist(), **extra}
    cfg.update(rope_parameters=rope, original_max_position_embeddings=original, max_position_embeddings=max_pos)
    cfg.pop("rope_scaling", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("original,max_pos,extra,long", [
    (64, 64, {"attention_factor": 1.25}, False),  # the built context within the original one: short factors
    (8, 256, {}, True)])  # past it: long factors, attention factor sqrt(1 + ln 32 / ln 8)
def test_phi3_longrope_matches_transformers(original, max_pos, extra, long, tiny_shape_dir, tmp_path):
    folder = _longrope_folder(tiny_shape_dir("phi3-fused"), tmp_path / "longrope", original, max_pos, **extra)
    c = parse_hf_config(json.loads((folder / "config.json").read_text()))
    assert c.model_rope and c.rope_scaling["long"] is long
    assert c.rope_scaling["attention_factor"] == pytest.approx(1.25 if not long else (1 + np.log(32) / np.log(8)) ** 0.5)
    errors = compare(folder, SHORT_PROMPT, max_model_len=max_pos)
    print("longrope", "long" if long else "short", "max |diff|", errors)
    # 2e-4: with the attention factor's sharper softmax, transformers' own cached decode steps
    # and one uncached pass over the same tokens differ by 7.2e-5 on the short-factor model
    # (logits up to 14); vtool's measured 1.1e-4 (short) and 6.4e-5 (long)
    assert max(errors.values()) < 2 * TOL, errors


def test_a_phi3_longrope_gguf_gives_transformers_logits(tiny_shape_dir, tmp_path):
    """llama.cpp's phi3 longrope GGUF (rope_factors_long/short tensors, rope.scaling.original_context_length
    and attn_factor, tests/support/hf_gguf.py as its converter writes them) reads back as the same
    rope_scaling; the long-factor model gives transformers' logits and tokens."""
    import gguf
    from hf_gguf import write_hf_as_gguf

    folder = _longrope_folder(tiny_shape_dir("phi3-fused"), tmp_path / "longrope", 8, 256)
    path = write_hf_as_gguf(folder, tmp_path / "longrope.gguf", gguf.MODEL_ARCH.PHI3)
    ckpt = open_checkpoint(path)
    assert not {"rope_factors_long.weight", "rope_factors_short.weight"} & set(ckpt.tensors())
    ours, hf = parse_hf_config(ckpt.config()), parse_hf_config(json.loads((folder / "config.json").read_text()))
    assert ours.rope_scaling["long"] and ours.rope_scaling["long_factor"] == pytest.approx(hf.rope_scaling["long_factor"])
    assert ours.rope_scaling["attention_factor"] == pytest.approx(hf.rope_scaling["attention_factor"])
    ref_prompt, ref_tokens, _ = greedy(eager_model(folder), SHORT_PROMPT, 8)
    gen = Generator(CompiledModel(build_artifact(path, "host", "float32"), ckpt), max_model_len=256)
    err = float(np.abs(gen.prompt_logits(SHORT_PROMPT) - ref_prompt).max())
    print("longrope gguf prompt max |diff|", err)
    assert err < 2 * TOL
    assert gen.generate(SHORT_PROMPT, SamplingParams(temperature=0, max_tokens=8)).token_ids == ref_tokens


def test_longrope_and_olmo3_refusals_name_the_field(tiny_shape_dir):
    cfg = json.loads((tiny_shape_dir("phi3-fused") / "config.json").read_text())
    rope = {"rope_type": "longrope", "original_max_position_embeddings": 8, "short_factor": [1.0] * 3,
            "long_factor": [1.0] * 16}
    with pytest.raises(ConfigError, match="short_factor"):
        parse_hf_config({**cfg, "rope_parameters": rope})
    with pytest.raises(ConfigError, match="long_mscale"):
        parse_hf_config({**cfg, "rope_parameters": {**rope, "short_factor": [1.0] * 16, "long_mscale": 1.2}})
    # OLMo-3 scales its full-attention layers only (tests/test_rope_scaling.py): not the sliding ones
    olmo3 = json.loads((tiny_shape_dir("olmo3-window") / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e5, "original_max_position_embeddings": 64}
    with pytest.raises(ConfigError, match="sliding_attention.*yarn"):
        parse_hf_config({**olmo3, "rope_parameters": {**olmo3["rope_parameters"], "sliding_attention": yarn}})
    with pytest.raises(ConfigError, match="sliding_window"):  # the layer types would be lost
        parse_hf_config({**olmo3, "sliding_window": None,
                         "rope_parameters": {**olmo3["rope_parameters"], "full_attention": yarn}})
