"""Half-precision parity against transformers, on any device: vtool's bfloat16 or float16
logits against the float32 truth, bounded by transformers' own error in the same dtype on the
same device, and greedy tokens equal up to a near-tie of the reference.

Used by tests/test_gpu_parity.py and test_gpu_quantized.py (CUDA) and test_cpu_half_parity.py
(the CPU builds); run_engine, every request's tokens from the batching engine."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vtool.runtime.engine.generate import Generator
from vtool.runtime.sampling.params import SamplingParams

STEPS = 32
# `ref_err` is transformers' own half-precision error on the device: max |logit| of its bf16
# (or f16) run against its float32 run, over the prompt and the 32 greedy steps (same tokens).
# vtool's logits must be no further from the float32 truth than VS_TRUTH * ref_err (a real bug
# -- wrong rope, norm, bias, head -- is off by the logit scale, 10-50x ref_err; CPU builds
# measured 0.7-1.4x on the tiny models in bf16 and f16, 0.8-1.5x on SmolLM2 in bf16). By the
# triangle inequality vtool then differs from transformers in that dtype by at most
# (VS_TRUTH + 1) * ref_err. FLOOR keeps the bound meaningful should ref_err be tiny (float16
# keeps 3 more mantissa bits than bfloat16: its ref_err is about 8x smaller).
VS_TRUTH = 2.5
FLOOR = 0.05
# A greedy divergence must be a near-tie in the reference: its logit for its own token at
# most this far above its logit for ours. SmolLM2's bf16 logits (|logit| 16-64) are spaced
# 0.125-0.25, so this is 2-4 bf16 steps (CPU build: divergences at gaps 0.0, 0.125, 0.0).
# The tiny random models put 512 logits within +-13 and their bf16 noise (ref_err 0.25-1.5)
# exceeds such steps, so there the bound is TINY_NEAR_TIE_REF_ERRS * ref_err (CPU build:
# gaps 0.0-1.09 at ref_err 0.25-1.46).
SMOLLM2_NEAR_TIE = 0.5
TINY_NEAR_TIE_REF_ERRS = 2.0


# -- transformers on its device ------------------------------------------------------------

def hf_greedy(model: Any, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int], list[np.ndarray]]:
    """hf_oracle.greedy on the model's device: (prompt logits, greedy tokens, the logits
    each token was chosen from), as float32 numpy."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(torch.tensor([prompt], device=device), use_cache=True)
        prompt_logits = out.logits[0].float().cpu().numpy()
        past, step_logits, tokens = out.past_key_values, [prompt_logits[-1]], []
        while True:
            tokens.append(int(np.argmax(step_logits[-1])))
            if len(tokens) == steps:
                return prompt_logits, tokens, step_logits
            out = model(torch.tensor([[tokens[-1]]], device=device), past_key_values=past, use_cache=True)
            past = out.past_key_values
            step_logits.append(out.logits[0, -1].float().cpu().numpy())


def hf_prompt_logits(model: Any, prompt: list[int]) -> np.ndarray:
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(torch.tensor([prompt], device=device)).logits[0].float().cpu().numpy()


def first_divergence(ours: list[int], ref: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


def check_greedy(label: str, ours: list[int], ref: list[int], ref_logits: list[np.ndarray], near_tie: float,
                 decode: Any = None) -> int | None:
    """Same greedy tokens, or a first divergence where the reference itself nearly ties:
    the reference's logit for our token is within `near_tie` of its logit for its own
    (if every logit agrees within tol, argmax can only flip where that gap is <= 2 tol).
    Returns the divergence step (None: identical)."""
    step = first_divergence(ours, ref)
    if step is None:
        print(f"[{label}] {len(ref)}/{len(ref)} greedy tokens identical")
        return None
    logits = ref_logits[step]
    top2 = np.sort(logits)[-2:]
    gap = float(logits[ref[step]] - logits[ours[step]])
    show = decode or (lambda ids: ids)
    print(f"[{label}] first divergence at step {step}: vtool {ours[step]} vs reference {ref[step]}; reference "
          f"logit gap to our token {gap:.4f} (top-2 gap {float(top2[1] - top2[0]):.4f}, near-tie bound {near_tie:.4f})"
          f"\n   vtool:     {show(ours)!r}\n   reference: {show(ref)!r}")
    assert gap <= near_tie, (
        f"{label}: greedy tokens diverge at step {step} (vtool {ours[step]}, reference {ref[step]}) where the "
        f"reference prefers its token by {gap:.4f} > {near_tie:.4f}: not a near-tie")
    return step


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


# -- the reference and the check -----------------------------------------------------------

def half_reference(hf32: Any, hf16: Any, prompt: list[int]) -> dict[str, Any]:
    """transformers' half-precision greedy (tokens, the logits each was chosen from), its logits along
    the whole sequence, the float32 truth along the same sequence, and ref_err."""
    ref_prompt, tokens, step_logits = hf_greedy(hf16, prompt, STEPS)
    sequence = prompt + tokens[:-1]
    hf16_seq = np.concatenate([ref_prompt, np.stack(step_logits[1:])])  # position i: logits after sequence[:i+1]
    truth = hf_prompt_logits(hf32, sequence)
    return {"tokens": tokens, "logits": step_logits, "sequence": sequence, "hf16": hf16_seq, "truth": truth,
            "ref_err": max_abs(hf16_seq, truth)}


def check_half(label: str, gen: Generator, prompt: list[int], ref: dict[str, Any], near_tie: float,
               decode: Any = None) -> None:
    """vtool's half-precision logits against the reference of half_reference:
    1. teacher-forced (batch_prefill over prompt + the reference's tokens): every position
       within max(VS_TRUTH * ref_err, FLOOR) of the float32 truth;
    2. free-running greedy (prefill + decode): the decode-path logits within the same bound
       while the sequences agree, and the tokens equal up to a near-tie (check_greedy)."""
    n, ref_err = len(prompt), ref["ref_err"]
    bound = max(VS_TRUTH * ref_err, FLOOR)
    forced = gen.prompt_logits(ref["sequence"])
    forced_err = max_abs(forced, ref["truth"])
    seen: list[np.ndarray] = []
    result = gen.generate(prompt, SamplingParams(temperature=0, max_tokens=STEPS), on_logits=seen.append)
    step = first_divergence(result.token_ids, ref["tokens"])
    shared = STEPS if step is None else step + 1  # logits up to the divergence come from the same prefix
    decode_errs = [max_abs(seen[k], ref["truth"][n - 1 + k]) for k in range(shared)]
    print(f"[{label}] max|dlogit| vs float32: vtool teacher-forced {forced_err:.3f}, decode path "
          f"{max(decode_errs):.3f}; transformers' own (ref_err) {ref_err:.3f}; bound {bound:.3f}. "
          f"vs transformers in that dtype: {max_abs(forced, ref['hf16']):.3f}")
    assert forced_err <= bound, (f"{label}: teacher-forced logits are {forced_err:.3f} from float32, more than "
                                 f"{VS_TRUTH} x transformers' own error in that dtype {ref_err:.3f}")
    worst = int(np.argmax(decode_errs))
    assert decode_errs[worst] <= bound, (f"{label}: decode-path logits at step {worst} are "
                                         f"{decode_errs[worst]:.3f} from float32 > {bound:.3f}")
    check_greedy(label, result.token_ids, ref["tokens"], ref["logits"], near_tie=near_tie, decode=decode)


# -- the batching engine ----------------------------------------------------------------------

def run_engine(engine: Any, prompts: list[list[int]], params_for: Any) -> dict[str, list[int]]:
    """Request r{i} = prompts[i] with params_for(i); step until all finish; the tokens of each."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params_for(i))
    done: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(10 * STEPS):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            done[out.request_id].extend(out.new_token_ids)
    assert not engine.has_unfinished(), "the engine stopped making progress"
    return done
