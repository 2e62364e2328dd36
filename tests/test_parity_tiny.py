"""Tiny random Llama / Qwen2 / Qwen3 checkpoints, made by transformers, compiled by vtool
for this CPU: logits within 1e-4 of transformers at float32 (every prompt position and
every decode step), plus transformers' own float32 rounding on the same run (its distance
from its float64 run, hf_oracle.float32_rounding), and identical greedy tokens for 32 steps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_oracle import float32_rounding, greedy
from tiny_models import TINY_SHAPES
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.runtime.engine.generate import Generator
from vtool.runtime.sampling.params import SamplingParams
from vtool.toolchain.build import build_artifact

TOLERANCE = 1e-4
STEPS = 32
PROMPT = [1, 5, 17, 42, 99, 7, 3, 250, 11, 300, 64]


def hf_greedy(model_dir, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int], list[np.ndarray]]:
    from transformers import AutoModelForCausalLM

    return greedy(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), prompt, steps)


QUICK = {"llama-gqa", "qwen3-qknorm"}  # the other shapes are slow


@pytest.fixture(scope="module", params=[pytest.param(s, marks=() if s in QUICK else pytest.mark.slow)
                                        for s in sorted(TINY_SHAPES)])
def tiny(request, tiny_shape_dir):
    folder = tiny_shape_dir(request.param)
    artifact = build_artifact(folder, "host", "float32")
    model = CompiledModel(artifact, open_checkpoint(folder))
    return request.param, folder, Generator(model, max_model_len=256)


def test_prompt_logits_match_transformers(tiny):
    name, folder, gen = tiny
    run = hf_greedy(folder, PROMPT, 1)
    ref = run[0]
    ours = gen.prompt_logits(PROMPT)
    assert ours.shape == ref.shape
    err = float(np.abs(ours - ref).max())
    bound = TOLERANCE + float32_rounding(folder, PROMPT, run)
    assert err < bound, f"{name}: prompt logits differ by {err} (bound {bound})"


def test_greedy_tokens_and_decode_logits_match_transformers(tiny):
    name, folder, gen = tiny
    run = hf_greedy(folder, PROMPT, STEPS)
    _, ref_tokens, ref_logits = run
    assert len(set(ref_tokens)) > 8, f"{name}: the reference is degenerate, the check would be weak"
    bound = TOLERANCE + float32_rounding(folder, PROMPT, run)
    seen: list[np.ndarray] = []
    result = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=STEPS), on_logits=seen.append)
    assert result.token_ids == ref_tokens, f"{name}: greedy tokens diverge"
    for step, (ours, ref) in enumerate(zip(seen, ref_logits)):
        err = float(np.abs(ours - ref).max())
        assert err < bound, f"{name}: logits at step {step} differ by {err} (bound {bound})"


def test_chunked_prefill_matches_one_shot(tiny, monkeypatch):
    """A prompt fed in several prefill chunks continues exactly like one fed at once."""
    import vtool.runtime.engine.generate as generate

    name, _, gen = tiny
    whole = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))
    monkeypatch.setattr(generate, "PREFILL_CHUNK", 4)
    chunked = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))
    assert chunked.token_ids == whole.token_ids, name
