"""Tiny llama GGUF files with really quantized weights (gguf.quants.quantize), for the
quantized-kernel tests. Written independently of vtool's reader: HF-layout random
weights, llama.cpp's Q/K row permutation, then gguf-py's quantizer and writer."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
SHAPE = dict(hidden=128, inter=256, layers=2, heads=4, kv=2, vocab=256)

_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in _TOP:
        return _TOP[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{suffix}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(rng: np.random.Generator, tie: bool) -> dict[str, np.ndarray]:
    s = SHAPE
    h, hd = s["hidden"], s["hidden"] // s["heads"]
    r = lambda *shape: (rng.standard_normal(shape) * 0.08).astype(np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": r(s["vocab"], h), "model.norm.weight": 1 + r(h)}
    if not tie:
        w["lm_head.weight"] = r(s["vocab"], h)
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + r(h), p + "post_attention_layernorm.weight": 1 + r(h),
              p + "self_attn.q_proj.weight": r(s["heads"] * hd, h), p + "self_attn.k_proj.weight": r(s["kv"] * hd, h),
              p + "self_attn.v_proj.weight": r(s["kv"] * hd, h), p + "self_attn.o_proj.weight": r(h, s["heads"] * hd),
              p + "mlp.gate_proj.weight": r(s["inter"], h), p + "mlp.up_proj.weight": r(s["inter"], h),
              p + "mlp.down_proj.weight": r(h, s["inter"])}
    return w


def write_tiny_gguf(path: Path, qtype_of: Callable[[str], "Q"], tie: bool = True, seed: int = 0) -> Path:
    """A tiny llama GGUF; `qtype_of(gguf_name)` picks each 2-D tensor's type (norms stay F32)."""
    s = SHAPE
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(s["layers"])
    w.add_context_length(512)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["inter"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_rope_dimension_count(s["hidden"] // s["heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s["vocab"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for hf, arr in hf_weights(np.random.default_rng(seed), tie).items():
        name = gguf_name(hf)
        if ".attn_q." in name or ".attn_k." in name:
            arr = _permute(arr, s["heads"] if ".attn_q." in name else s["kv"])
        qtype = Q.F32 if arr.ndim == 1 else qtype_of(name)
        if qtype == Q.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
