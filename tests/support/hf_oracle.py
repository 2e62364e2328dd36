"""Hugging Face transformers as the numerical oracle: model loading and greedy decoding
done entirely by transformers, independent of vtool's own readers."""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import transformers


@functools.lru_cache(maxsize=2)
def load_gguf_model(path: Path) -> Any:
    """transformers' own GGUF loader, dequantized to float32 (20-45 s on 2 cores: cached per session)."""
    kwargs: dict[str, Any] = {"gguf_file": path.name, "dtype": torch.float32}
    if hasattr(transformers, "GgufConfig"):  # transformers 5 keeps blocks packed unless asked
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), **kwargs).eval()


@functools.lru_cache(maxsize=2)
def load_gguf_tokenizer(path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def greedy(model: Any, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int], list[np.ndarray]]:
    """(prompt logits, greedy tokens, the logits each token was chosen from), by a plain
    cached argmax loop, so no generation-config rule (eos, min length) can interfere."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        prompt_logits = out.logits[0].float().numpy()
        past, step_logits, tokens = out.past_key_values, [prompt_logits[-1]], []
        while True:
            tokens.append(int(np.argmax(step_logits[-1])))
            if len(tokens) == steps:
                return prompt_logits, tokens, step_logits
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            step_logits.append(out.logits[0, -1].float().numpy())


def float32_rounding(model_dir: Path, prompt: list[int], ref: tuple[np.ndarray, list[int], list[np.ndarray]],
                     **load_kw: Any) -> float:
    """transformers' own float32 rounding on a greedy run `ref` (greedy()'s result on the float32
    model in model_dir): the largest |float32 - float64| over its prompt logits and step logits,
    the float64 model reading the same tokens (teacher-forced, one call, so a near-tie cannot
    send it down another path).

    Why: the parity tests hold vtool to 1e-4 of transformers at float32, and both sides carry
    float32 rounding that grows over the decode steps. On an AMD EPYC (Zen 4) a tiny Mixtral's
    step 12 came out 1.07e-4 from transformers while transformers itself was 5.6e-5 from its own
    float64 run (vtool 1.08e-4 from it); on the Xeons before, under 1e-4. A bound of 1e-4 plus
    this figure tolerates the reference's own rounding and nothing else: a wrong kernel is
    off by 1e-2 and more."""
    config = (Path(model_dir) / "config.json").read_text()
    if '"num_local_experts"' in config or '"num_experts"' in config:
        load_kw.setdefault("experts_implementation", "eager")  # grouped_mm has no float64 kernel
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, **load_kw).eval()
    return float64_distance(model, prompt, ref)


def assert_matches_in_memory_oracle(gen: Any, make_oracle: Callable[[], Any], prompt: list[int], steps: int,
                                    tolerance: float) -> None:
    """vtool's Generator `gen` against transformers models built in memory by `make_oracle()`
    (float32; its weights are not a checkpoint's, so float32_rounding cannot load it): the same
    greedy tokens, and step and prompt logits within `tolerance` plus the oracle's own float32
    rounding on this run (float32_rounding says why)."""
    from vtool.runtime.sampling.params import SamplingParams

    ref = greedy(make_oracle(), prompt, steps)
    ref_prompt, ref_tokens, ref_logits = ref
    assert len(set(ref_tokens)) > 4, "the reference is degenerate, the check would be weak"
    bound = tolerance + float64_distance(make_oracle().double(), prompt, ref)
    seen: list[np.ndarray] = []
    result = gen.generate(prompt, SamplingParams(temperature=0, max_tokens=steps), on_logits=seen.append)
    assert result.token_ids == ref_tokens
    assert max(float(np.abs(a - b).max()) for a, b in zip(seen, ref_logits)) < bound
    assert float(np.abs(gen.prompt_logits(prompt) - ref_prompt).max()) < bound


def float64_distance(model: Any, prompt: list[int], ref: tuple[np.ndarray, list[int], list[np.ndarray]]) -> float:
    """float32_rounding with the float64 model given (one whose weights are not a checkpoint's)."""
    prompt_logits, tokens, step_logits = ref
    ids = list(prompt) + list(tokens[:-1])
    with torch.no_grad():
        exact = model(torch.tensor([ids])).logits[0].numpy()
    steps = np.stack(step_logits)
    return max(float(np.abs(prompt_logits - exact[:len(prompt)]).max()),
               float(np.abs(steps - exact[len(prompt) - 1:len(prompt) - 1 + len(steps)]).max()))


@contextlib.contextmanager
def _rounded_linear_inputs(model: Any, only: Callable[[str], bool], rows: str,
                           roundtrip: Callable[[np.ndarray], np.ndarray]):
    """Within the block, the nn.Linear modules of `model` whose names pass `only` take their input
    rows through `roundtrip` (float32 [rows, k] -> the same, quantized and back): in every call
    (rows="all") or only in single-position calls, the decode steps (rows="decode")."""

    def quantize(module: torch.nn.Module, args: tuple) -> tuple | None:
        (x,) = args
        if rows == "decode" and x.shape[-2] != 1:
            return None
        deq = roundtrip(x.detach().float().numpy().reshape(-1, x.shape[-1])).reshape(x.shape)
        return (torch.from_numpy(np.ascontiguousarray(deq)).to(x.dtype),)

    hooks = [m.register_forward_pre_hook(quantize) for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and only(name)]
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()


def q8_0_activations(model: Any, only: Callable[[str], bool] = lambda name: True, rows: str = "all"):
    """Within the block, the nn.Linear modules of `model` whose names pass `only` see their
    input rows as GGML Q8_0 blocks (gguf-py's reference quantizer, then its dequantizer), as
    vtool's Q8_0-activation matmuls (schedules/cpu/int8_gemv.py) and llama.cpp take them: in every
    call (rows="all", `--activations q8_0`) or only in single-position calls, the decode
    steps (rows="decode", `--activations decode`; the prompt must be longer than one token)."""
    import gguf

    q8_0 = gguf.GGMLQuantizationType.Q8_0
    return _rounded_linear_inputs(model, only, rows,
                                  lambda flat: gguf.quants.dequantize(gguf.quants.quantize(flat, q8_0), q8_0))


def q8_k_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_K_ref in numpy (gguf-py has no Q8_K quantizer), over rows
    x [..., k] (k % 256 == 0): (d float32 [..., k/256], q int8 [..., k]). Per 256 values the
    first of largest magnitude, `max`, gives iscale = -127 / max; q = nearest_int(iscale * x)
    (ties to even) capped at 127; d = 1 / iscale; an all-zero block has d = 0."""
    blocks = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, 256)
    first = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    nonzero = first != 0
    iscale = np.where(nonzero, np.float32(-127) / np.where(nonzero, first, 1), 0).astype(np.float32)
    q = np.minimum(np.rint(iscale[..., None] * blocks), 127).astype(np.int8)
    d = np.where(nonzero, np.float32(1) / np.where(nonzero, iscale, 1), 0).astype(np.float32)
    return d, q.reshape(x.shape)


def q8_k_activations(model: Any, only: Callable[[str], bool] = lambda name: True, rows: str = "all"):
    """As q8_0_activations, with the Q8_K blocks of llama.cpp's K-quant dot products (q8_k_blocks):
    what vtool's Q4_K/Q6_K integer-dot matmuls (schedules/cpu/kquant_gemv.py) take."""

    def roundtrip(flat: np.ndarray) -> np.ndarray:
        d, q = q8_k_blocks(flat)
        return d[..., None] * q.reshape(*d.shape, 256).astype(np.float32)

    return _rounded_linear_inputs(model, only, rows, roundtrip)
