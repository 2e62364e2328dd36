"""A llama GGUF file of a config's shape with random quantized blocks, for speed measurements
of weights kept in blocks (the values do not change the speed; every block is valid: small
float16 scales, random quants).

    python tests/bench/shape_gguf.py tests/bench/llama8b_config.json OUT.gguf --type Q4_K_M [--seed 0]

--type: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, or Q4_K_M (llama.cpp's mix: Q6_K for attn_v, ffn_down
and the output matrix, Q4_K elsewhere). Norms are F32. The same arguments write the same
file, so a library built from it on one machine binds the file written on another.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
# bytes offsets of the float16 scales inside each block, and the value they get
SCALES = {Q.Q4_0: [(0, 2 ** -7)], Q.Q4_1: [(0, 2 ** -8), (2, -2 ** -5)], Q.Q8_0: [(0, 2 ** -10)],
          Q.Q4_K: [(0, 2 ** -10), (2, 2 ** -12)], Q.Q6_K: [(208, 2 ** -12)]}


def blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
    """[rows, bytes per row] uint8: random quants, every scale set (no NaN/inf)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset, value in SCALES[qtype]:
        data[:, :, offset:offset + 2] = np.array([value], np.float16).view(np.uint8)
    if qtype == Q.Q4_K:  # 6-bit sub-scales and mins (bytes 4..15): keep them moderate
        data[:, :, 4:16] &= 0x1F
    if qtype == Q.Q6_K:  # int8 sub-scales (bytes 192..207)
        data[:, :, 192:208] = rng.integers(1, 32, (rows, cols // block, 16), dtype=np.uint8)
    return data.reshape(rows, -1)


def type_of(name: str, scheme: str) -> Q:
    if scheme == "Q4_K_M":
        return Q.Q6_K if (".attn_v." in name or ".ffn_down." in name or name == "output.weight") else Q.Q4_K
    return Q[scheme]


def write(config: dict, out: Path, scheme: str, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    h, inter, L = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    vocab = config["vocab_size"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(L)
    w.add_context_length(config.get("max_position_embeddings", 8192))
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    w.add_vocab_size(vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,), "output.weight": (vocab, h)}
    for i in range(L):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,),
                       p + "attn_q.weight": (heads * d, h), p + "attn_k.weight": (kv * d, h),
                       p + "attn_v.weight": (kv * d, h), p + "attn_output.weight": (h, heads * d),
                       p + "ffn_gate.weight": (inter, h), p + "ffn_up.weight": (inter, h),
                       p + "ffn_down.weight": (h, inter)})
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, np.ones(shape, np.float32))
            continue
        qtype = type_of(name, scheme)
        w.add_tensor(name, blocks(rng, *shape, qtype), raw_dtype=qtype)  # the byte shape gives the shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", default="Q4_K_M", choices=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q4_K_M"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(write(json.loads(a.config.read_text()), a.out, a.type, a.seed))


if __name__ == "__main__":
    main()
