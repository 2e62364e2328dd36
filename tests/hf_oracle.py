"""Hugging Face transformers as the numerical oracle: model loading and greedy decoding
done entirely by transformers, independent of vtool's own readers."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

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
