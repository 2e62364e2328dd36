"""vtool's float32 host build of a checkpoint folder against transformers' eager run: prompt
logits, greedy tokens and the logits of each decode step (the tiny-model parity tests of the
families whose attention transformers masks only in eager mode: sliding windows, rope scaling)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from hf_oracle import float32_rounding, greedy
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.engine.generate import Generator
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.toolchain.build import build_artifact


def eager_model(folder: Path, **overrides: Any) -> Any:
    """transformers' float32 model of `folder` with eager attention, config fields overridden."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, **overrides)
    return AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def compare_greedy(folder: Path, prompt: list[int], steps: int,
                   max_model_len: int = 256) -> tuple[dict[str, float], np.ndarray]:
    """({"prompt", "steps": max |vtool - transformers| logit}, transformers' prompt logits); the
    greedy tokens must be equal and the reference not degenerate (more than 6 distinct tokens)."""
    ref_prompt, ref_tokens, ref_logits = greedy(eager_model(folder), prompt, steps)
    assert len(set(ref_tokens)) > 6, "a degenerate reference"
    gen = Generator(CompiledModel(build_artifact(folder, "host", "float32"), open_checkpoint(folder)),
                    max_model_len=max_model_len)
    errors = {"prompt": float(np.abs(gen.prompt_logits(prompt) - ref_prompt).max())}
    seen: list[np.ndarray] = []
    result = gen.generate(prompt, SamplingParams(temperature=0, max_tokens=steps), on_logits=seen.append)
    assert result.token_ids == ref_tokens
    errors["steps"] = max(float(np.abs(a - b).max()) for a, b in zip(seen, ref_logits))
    return errors, ref_prompt


def reference_rounding(folder: Path, prompt: list[int], steps: int) -> float:
    """transformers' own float32 rounding on its greedy eager run of `prompt` (its distance from
    the float64 model over the same tokens, hf_oracle.float32_rounding): what a parity bound adds
    to its 1e-4, since vtool's float32 sums are ordered differently on every instruction set."""
    run = greedy(eager_model(folder), prompt, steps)
    return float32_rounding(folder, prompt, run, attn_implementation="eager")
