"""Tiny llama GGUF files with really quantized weights, for the quantized-kernel tests.
Written independently of vtool's reader: HF-layout random weights, llama.cpp's Q/K row
permutation, then gguf-py's quantizer and writer. gguf-py cannot quantize the K-quants
(its K-quant and IQ4 quantize raise NotImplementedError), so Q2_K..Q6_K, IQ4_NL and IQ4_XS
blocks come from the small numpy encoders below, written from ggml-quants' block layout; any valid encoding
serves, as every oracle dequantizes the same bytes (tests hold them to gguf-py's
dequantizer within the quantization error)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
SHAPE = dict(hidden=128, inter=256, layers=2, heads=4, kv=2, vocab=256)
K_SHAPE = dict(hidden=256, inter=512, layers=2, heads=4, kv=2, vocab=256)  # columns multiples of 256
QK_K = 256


def _f16_up(x: np.ndarray) -> np.ndarray:
    """float16 >= x (x >= 0): a scale rounded up still covers its range."""
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) -> Q4_K bytes [rows, cols/256 * 144]. Per 32
    weights: w = d*sc * q - dmin*m, q in 0..15, sc and m 6-bit; scales rounded up, so no
    quant is clipped and each weight is within half a step (d*sc/2) of its value."""
    rows, cols = w.shape
    x = w.astype(np.float32).reshape(rows, cols // QK_K, 8, 32)
    neg_min = np.maximum(-x.min(axis=-1), 0)  # [.., 8]; mins stored as positive offsets
    dmin = _f16_up(neg_min.max(axis=-1) / 63)  # [..]
    m = np.clip(np.ceil(_div(neg_min, dmin.astype(np.float32)[..., None])), 0, 63)
    off = dmin.astype(np.float32)[..., None] * m  # >= -min
    scale = (x.max(axis=-1) + off) / 15  # range of x + off is within [0, max + off]
    d = _f16_up(scale.max(axis=-1) / 63)
    sc = np.clip(np.ceil(_div(scale, d.astype(np.float32)[..., None])), 0, 63)
    step = d.astype(np.float32)[..., None] * sc
    q = np.clip(np.rint(_div(x + off[..., None], step[..., None])), 0, 15).astype(np.uint8)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)
    q = q.reshape(rows, cols // QK_K, 4, 2, 32)  # byte l of 32: sub-block 2g low, 2g+1 high
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(rows, cols // QK_K, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(rows, -1, 2), dmin.view(np.uint8).reshape(rows, -1, 2),
                             packed, qs], axis=-1)
    return blocks.reshape(rows, -1)


def _k_scale_min(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K's scales for x [rows, nsb, 8, 32]: (d, dmin float16 [rows, nsb], sc, m 6-bit
    [.., 8], q in 0..levels [.., 8, 32]), scales rounded up so no quant is clipped."""
    neg_min = np.maximum(-x.min(axis=-1), 0)  # [.., 8]; mins stored as positive offsets
    dmin = _f16_up(neg_min.max(axis=-1) / 63)  # [..]
    m = np.clip(np.ceil(_div(neg_min, dmin.astype(np.float32)[..., None])), 0, 63)
    off = dmin.astype(np.float32)[..., None] * m  # >= -min
    scale = (x.max(axis=-1) + off) / levels  # range of x + off is within [0, max + off]
    d = _f16_up(scale.max(axis=-1) / 63)
    sc = np.clip(np.ceil(_div(scale, d.astype(np.float32)[..., None])), 0, 63)
    step = d.astype(np.float32)[..., None] * sc
    q = np.clip(np.rint(_div(x + off[..., None], step[..., None])), 0, levels).astype(np.uint8)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q


def _pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 6-bit scales and mins -> the K-quants' 12 packed bytes (get_scale_min_k4's inverse)."""
    return np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                           (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)


def encode_q5_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) -> Q5_K bytes [rows, cols/256 * 176]: Q4_K's
    scheme with q in 0..31, the fifth bits in 32 bytes (bit s of byte l: element l of sub-block s)."""
    rows, cols = w.shape
    d, dmin, sc, m, q = _k_scale_min(w.astype(np.float32).reshape(rows, cols // QK_K, 8, 32), 31)
    qh = np.zeros((rows, cols // QK_K, 32), np.uint8)
    for sub in range(8):
        qh |= ((q[..., sub, :] >> 4) & 1) << sub
    q = (q & 15).reshape(rows, cols // QK_K, 4, 2, 32)
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(rows, cols // QK_K, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(rows, -1, 2), dmin.view(np.uint8).reshape(rows, -1, 2),
                             _pack_scale_min(sc, m), qh, qs], axis=-1)
    return blocks.reshape(rows, -1)


def _pack_two_bits(q: np.ndarray) -> np.ndarray:
    """2-bit quants [rows, nsb, 256] -> the K-quants' 64 bytes per 256: byte 32h + l holds
    element 128h + 32k + l at bits 2k..2k+1."""
    rows, nsb, _ = q.shape
    q = q.reshape(rows, nsb, 2, 4, 32)
    return (q[..., 0, :] | (q[..., 1, :] << 2) | (q[..., 2, :] << 4) | (q[..., 3, :] << 6)).reshape(rows, nsb, 64)


def encode_q3_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) -> Q3_K bytes [rows, cols/256 * 110]. Per 16
    weights: w = d*sc * q, q in -4..3, sc 6-bit signed (stored + 32); scales rounded up as in
    encode_q4_k. The third bit of q + 4 goes to hmask (bit s of byte l: element 32s + l)."""
    rows, cols = w.shape
    nsb = cols // QK_K
    x = w.astype(np.float32).reshape(rows, nsb, 16, 16)
    scale = np.abs(x).max(axis=-1) / 3.5  # q in -4..3: |x| <= 3.5 steps keeps rint within range
    d = _f16_up(scale.max(axis=-1) / 31)
    sc = np.clip(np.ceil(_div(scale, d.astype(np.float32)[..., None])), 0, 31)
    step = d.astype(np.float32)[..., None] * sc
    q = (np.clip(np.rint(_div(x, step[..., None])), -4, 3) + 4).astype(np.uint8).reshape(rows, nsb, QK_K)
    hmask = np.zeros((rows, nsb, 32), np.uint8)
    for sub in range(8):
        hmask |= (q[..., 32 * sub:32 * sub + 32] >> 2) << sub
    s6 = (sc + 32).astype(np.uint8)  # [rows, nsb, 16]
    low = s6[..., :8] & 15 | ((s6[..., 8:] & 15) << 4)
    high = np.zeros((rows, nsb, 4), np.uint8)
    for i in range(16):
        high[..., i % 4] |= (s6[..., i] >> 4) << (2 * (i // 4))
    blocks = np.concatenate([hmask, _pack_two_bits(q & 3), low, high, d.view(np.uint8).reshape(rows, -1, 2)],
                            axis=-1)
    return blocks.reshape(rows, -1)


def encode_q2_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) -> Q2_K bytes [rows, cols/256 * 84]. Per 16
    weights: w = d*sc * q - dmin*m, q in 0..3, sc and m 4-bit (one byte: sc | m << 4);
    scales rounded up as in encode_q4_k."""
    rows, cols = w.shape
    nsb = cols // QK_K
    x = w.astype(np.float32).reshape(rows, nsb, 16, 16)
    neg_min = np.maximum(-x.min(axis=-1), 0)
    dmin = _f16_up(neg_min.max(axis=-1) / 15)
    m = np.clip(np.ceil(_div(neg_min, dmin.astype(np.float32)[..., None])), 0, 15)
    off = dmin.astype(np.float32)[..., None] * m
    scale = (x.max(axis=-1) + off) / 3
    d = _f16_up(scale.max(axis=-1) / 15)
    sc = np.clip(np.ceil(_div(scale, d.astype(np.float32)[..., None])), 0, 15)
    step = d.astype(np.float32)[..., None] * sc
    q = np.clip(np.rint(_div(x + off[..., None], step[..., None])), 0, 3).astype(np.uint8).reshape(rows, nsb, QK_K)
    blocks = np.concatenate([sc.astype(np.uint8) | (m.astype(np.uint8) << 4), _pack_two_bits(q),
                             d.view(np.uint8).reshape(rows, -1, 2), dmin.view(np.uint8).reshape(rows, -1, 2)], axis=-1)
    return blocks.reshape(rows, -1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) -> Q6_K bytes [rows, cols/256 * 210]. Per 16
    weights: w = d*sc * (q - 32), q in 1..63, sc int8; scales rounded up as in encode_q4_k."""
    rows, cols = w.shape
    x = w.astype(np.float32).reshape(rows, cols // QK_K, 16, 16)
    scale = np.abs(x).max(axis=-1) / 31
    d = _f16_up(scale.max(axis=-1) / 127)
    sc = np.clip(np.ceil(_div(scale, d.astype(np.float32)[..., None])), 0, 127)
    step = d.astype(np.float32)[..., None] * sc
    q = (np.clip(np.rint(_div(x, step[..., None])), -31, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, cols // QK_K, 2, 128)  # two halves of 128 weights
    ql = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)  # byte l: weight l low, 64 + l high
    hi = (q >> 4).reshape(rows, cols // QK_K, 2, 4, 32)  # weight 32k + l -> bits 2k of byte l
    qh = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
    blocks = np.concatenate([ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64),
                             sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(rows, -1, 2)], axis=-1)
    return blocks.reshape(rows, -1)


_IQ4 = np.asarray(gguf.quants.IQ4_NL.kvalues, np.float32)  # the 16 non-linear levels


def _iq4_codes(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """x [..., 32] -> the 4-bit codes of the levels nearest x / step, packed 16 bytes per 32 (Q4_0's order)."""
    q = np.abs(_div(x, step[..., None])[..., None] - _IQ4).argmin(axis=-1).astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def encode_iq4_nl(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 32 == 0) -> IQ4_NL bytes [rows, cols/32 * 18]: per 32 weights
    w = d * level[q] (levels -127..113), d = max|w| / 127 rounded up, each code the nearest level."""
    rows, cols = w.shape
    x = w.astype(np.float32).reshape(rows, cols // 32, 32)
    d = _f16_up(np.abs(x).max(axis=-1) / 127)
    return np.concatenate([d.view(np.uint8).reshape(rows, -1, 2), _iq4_codes(x, d.astype(np.float32))],
                          axis=-1).reshape(rows, -1)


def encode_iq4_xs(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) -> IQ4_XS bytes [rows, cols/256 * 136]: per 32 weights
    w = d * (ls - 32) * level[q], ls 6-bit (split into 4 low bits in scales_l, 2 high in scales_h)."""
    rows, cols = w.shape
    nsb = cols // QK_K
    x = w.astype(np.float32).reshape(rows, nsb, 8, 32)
    scale = np.abs(x).max(axis=-1) / 127
    d = _f16_up(scale.max(axis=-1) / 31)
    sc = np.clip(np.ceil(_div(scale, d.astype(np.float32)[..., None])), 0, 31)
    codes = _iq4_codes(x, d.astype(np.float32)[..., None] * sc)  # [rows, nsb, 8, 16]
    ls = (sc + 32).astype(np.uint16)
    high = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=-1).astype("<u2")  # [rows, nsb]
    low = (ls & 15).astype(np.uint8)
    low = low[..., 0::2] | (low[..., 1::2] << 4)  # [rows, nsb, 4]
    blocks = np.concatenate([d.view(np.uint8).reshape(rows, nsb, 2), high.view(np.uint8).reshape(rows, nsb, 2),
                             low, codes.reshape(rows, nsb, 128)], axis=-1)
    return blocks.reshape(rows, -1)


def quantize(w: np.ndarray, qtype: "Q") -> np.ndarray:
    """gguf-py's quantizer, or the numpy encoders above for the K-quants."""
    if qtype == Q.Q4_K:
        return encode_q4_k(w)
    if qtype == Q.Q6_K:
        return encode_q6_k(w)
    if qtype == Q.Q5_K:
        return encode_q5_k(w)
    if qtype == Q.Q3_K:
        return encode_q3_k(w)
    if qtype == Q.Q2_K:
        return encode_q2_k(w)
    if qtype == Q.IQ4_NL:
        return encode_iq4_nl(w)
    if qtype == Q.IQ4_XS:
        return encode_iq4_xs(w)
    return gguf.quants.quantize(w, qtype)

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


def hf_weights(rng: np.random.Generator, tie: bool, shape: dict[str, int] = SHAPE) -> dict[str, np.ndarray]:
    s = shape
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


def write_tiny_gguf(path: Path, qtype_of: Callable[[str], "Q"], tie: bool = True, seed: int = 0,
                    shape: dict[str, int] = SHAPE) -> Path:
    """A tiny llama GGUF; `qtype_of(gguf_name)` picks each 2-D tensor's type (norms stay F32).
    K-quants need `shape=K_SHAPE` (every weight's columns a multiple of 256)."""
    s = shape
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
    for hf, arr in hf_weights(np.random.default_rng(seed), tie, s).items():
        name = gguf_name(hf)
        if ".attn_q." in name or ".attn_k." in name:
            arr = _permute(arr, s["heads"] if ".attn_q." in name else s["kv"])
        qtype = Q.F32 if arr.ndim == 1 else qtype_of(name)
        if qtype == Q.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Tiny files in every kept format and in real files' mixes (tests/test_quant_gguf.py on the CPU,
# tests/test_gpu_quantized.py on CUDA).
# name -> (type of each 2-D tensor by GGUF name, tied embedding, what the manifest must keep, shape)
VARIANTS = {
    "q8_0": (lambda name: Q.Q8_0, True, {"Q8_0": 9}, SHAPE),
    "q4_0": (lambda name: Q.Q8_0 if name == "token_embd.weight" else Q.Q4_0, False, {"Q4_0": 9, "Q8_0": 1}, SHAPE),
    # SmolLM2's mix: Q4_1 layers, Q8_0 tied embedding
    "q4_1": (lambda name: Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1, True, {"Q4_1": 8, "Q8_0": 1}, SHAPE),
    # v and up in another format than q/k and gate: the fused q|k|v and gate|up keep each part in
    # its own blocks (Q4_1 matmuls for q|k and gate, Q8_0 ones for v and up: SplitQuantizedLinear)
    "mixed": (lambda name: Q.Q8_0 if ".attn_v." in name or ".ffn_up." in name
              else Q.Q4_1 if name != "output.weight" else Q.Q4_0,
              False, {"Q4_1": 9, "Q8_0": 4, "Q4_0": 1}, SHAPE),
    # several formats, as real Q4_K_M files mix them: a Q5_0 tied embedding (Qwen2.5-Coder's;
    # its gather and the lm_head's integer GEMV), Q5_1 feed-forward, Q4_1 attention
    "q5_mix": (lambda name: Q.Q5_0 if name == "token_embd.weight" else Q.Q5_1 if ".ffn_" in name else Q.Q4_1,
               True, {"Q4_1": 4, "Q5_1": 4, "Q5_0": 1}, SHAPE),
    # Q5_1 everywhere, the tied embedding included
    "q5_1": (lambda name: Q.Q5_1, True, {"Q5_1": 9}, SHAPE),
    # Q4_K layers, Q6_K tied embedding (its gather and the lm_head GEMV)
    "q4_k": (lambda name: Q.Q6_K if name == "token_embd.weight" else Q.Q4_K, True, {"Q4_K": 8, "Q6_K": 1}, K_SHAPE),
    # Q5_K everywhere, the tied embedding included (and Q3_K, Q2_K)
    "q5_k": (lambda name: Q.Q5_K, True, {"Q5_K": 9}, K_SHAPE),
    "q3_k": (lambda name: Q.Q3_K, True, {"Q3_K": 9}, K_SHAPE),
    "q2_k": (lambda name: Q.Q2_K, True, {"Q2_K": 9}, K_SHAPE),
    # the non-linear 4-bit types: IQ4_NL (Q8_0 activations), IQ4_XS (Q8_K), the output matrix Q8_0 / Q6_K
    "iq4_nl": (lambda name: Q.Q8_0 if name == "output.weight" else Q.IQ4_NL, False, {"IQ4_NL": 9, "Q8_0": 1}, SHAPE),
    "iq4_xs": (lambda name: Q.Q6_K if name == "output.weight" else Q.IQ4_XS, False, {"IQ4_XS": 9, "Q6_K": 1},
               K_SHAPE),
    # llama.cpp's Q4_K_M mix: v, down and the output in Q6_K, the rest Q4_K (q|k and v: two matmuls)
    "q4_k_m": (lambda name: Q.Q6_K if ".attn_v." in name or ".ffn_down." in name or name == "output.weight"
               else Q.Q4_K,
               False, {"Q4_K": 7, "Q6_K": 5}, K_SHAPE),
}
