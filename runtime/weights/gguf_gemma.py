"""llama.cpp's "gemma2" and "gemma3" GGUF files as Hugging Face Gemma configs and weights.

What llama.cpp's convert_hf_to_gguf writes, and what its loader assumes without writing it:
  * every RMSNorm weight is stored as 1 + w (Gemma's norm scales by 1 + w); the reader gives
    back w, so the checkpoint reads as the HF one (models/gemma.py adds the 1 again at bind);
  * {arch}.attention.sliding_window, {arch}.final_logit_softcapping and (gemma2)
    {arch}.attn_logit_softcapping are written; query_pre_attn_scalar is not: llama.cpp scales
    attention by 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 27B models (gemma2 with 46
    blocks, gemma3 with 62), which is what their configs' query_pre_attn_scalar say;
  * the sliding-window layers are not written either: gemma2 alternates (even layers slide),
    gemma3 has one global layer in 6 ({arch}.attention.sliding_window_pattern when present);
  * gemma3's local rope base is not written: llama.cpp uses 10000 (rope_local_base_freq);
    rope.freq_base and linear rope scaling are the global layers'.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

GEMMA_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_BLOCKS_27B = {"gemma2": 46, "gemma3": 62}
_GEMMA3_PATTERN = 6  # one global layer in 6
_GEMMA3_LOCAL_THETA = 10000.0


def gemma_config(arch: str, scalar: Callable[[str, Any], Any], get: Callable[[str, Any], Any],
                 cfg: dict[str, Any]) -> dict[str, Any]:
    """The Gemma keys of a gemma2/gemma3 file's HF config (cfg: the keys every family has)."""
    k = lambda suffix: f"{arch}.{suffix}"  # noqa: E731
    layers, heads, hidden = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"]
    scalar_27b = hidden // heads if layers == _BLOCKS_27B[arch] else cfg["head_dim"]
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar_27b,
        "sliding_window": int(scalar(k("attention.sliding_window"), 0) or 0) or None,
        "final_logit_softcapping": scalar(k("final_logit_softcapping"), None),
        "attn_logit_softcapping": scalar(k("attn_logit_softcapping"), None),
    }
    pattern = get(k("attention.sliding_window_pattern"), None)
    if isinstance(pattern, list):  # per layer, True: sliding
        sliding = [bool(p) for p in pattern]
    elif arch == "gemma2":
        sliding = [i % 2 == 0 for i in range(layers)]
    else:
        period = int(pattern or _GEMMA3_PATTERN)
        sliding = [(i + 1) % period != 0 for i in range(layers)]
    out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    if arch == "gemma3":
        out["rope_local_base_freq"] = _GEMMA3_LOCAL_THETA
    return out


def is_gemma_norm(arch: str, hf_name: str) -> bool:
    """A weight llama.cpp's converter stored as 1 + w."""
    return arch in GEMMA_ARCHITECTURES and hf_name.endswith("norm.weight")


def norm_from_gguf(arr: np.ndarray) -> np.ndarray:
    """w from the stored 1 + w (exact in float32 for the norms' range)."""
    return (arr.astype(np.float32) - np.float32(1.0)).astype(arr.dtype)
