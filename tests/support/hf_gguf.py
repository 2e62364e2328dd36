"""A tiny HF checkpoint written as a GGUF file the way llama.cpp's converter lays one out for
architectures whose tensors it stores as HF does (no Q/K row permutation: phi3, olmo2): names
from gguf-py's tensor map, the hyperparameters llama.cpp writes. Written independently of
vtool's reader, which the tests then hold to transformers."""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np


def write_hf_as_gguf(folder: Path, path: Path, arch: "gguf.MODEL_ARCH",
                     matrices: "gguf.GGMLQuantizationType" = gguf.GGMLQuantizationType.F32,
                     sliding_window: int | None = None, extra: dict[str, np.ndarray] | None = None,
                     extra_floats: dict[str, float] | None = None) -> Path:
    """`folder`'s config.json + model.safetensors as a GGUF of `arch`; 2-D tensors in
    `matrices` (gguf-py's quantizer), the rest float32; `extra` tensors and `extra_floats`
    float32 keys added as given."""
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if head_dim != cfg["hidden_size"] // cfg["num_attention_heads"]:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope_params = cfg.get("rope_parameters") or {}
    partial = cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(int(head_dim * partial))
    w.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):
        # llama.cpp's phi3 converter: the factors as two tensors, the original context, and the
        # attention factor it computes from the two lengths
        original = cfg.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        extra = {"rope_factors_long.weight": np.asarray(rope["long_factor"], np.float32),
                 "rope_factors_short.weight": np.asarray(rope["short_factor"], np.float32), **(extra or {})}
    elif rope.get("rope_type", rope.get("type")) == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type", rope.get("type")) == "yarn":
        # llama.cpp's converter (conversion/base.py): HF's attention_factor goes to yarn_attn_factor
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    for key, value in (extra_floats or {}).items():
        w.add_float32(key, value)
    w.add_vocab_size(cfg["vocab_size"])
    for hf, arr in load_file(str(folder / "model.safetensors")).items():
        module, leaf = hf.rsplit(".", 1)
        name = names.get_name(module) + "." + leaf
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 2 and matrices != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(arr, matrices), raw_dtype=matrices)
        else:
            w.add_tensor(name, arr)
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gpt2_as_gguf(folder: Path, path: Path,
                       matrices: "gguf.GGMLQuantizationType" = gguf.GGMLQuantizationType.F32) -> Path:
    """A tiny HF GPT-2 (GPT2LMHeadModel) as llama.cpp's converter (GPT2Model in convert_hf_to_gguf.py)
    writes it: "gpt2" metadata (feed_forward_length 4 x n_embd whatever n_inner is), names from gguf-py's
    map, the Conv1D matrices (c_attn, c_proj, c_fc) transposed to [out, in]; 2-D tensors in `matrices`."""
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, cfg["n_layer"])
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT2])
    w.add_block_count(cfg["n_layer"])
    w.add_context_length(cfg["n_positions"])
    w.add_embedding_length(cfg["n_embd"])
    w.add_feed_forward_length(4 * cfg["n_embd"])
    w.add_head_count(cfg["n_head"])
    w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
    for hf, arr in load_file(str(folder / "model.safetensors")).items():
        if hf.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        module, leaf = hf.rsplit(".", 1)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if hf.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            arr = np.ascontiguousarray(arr.T)
        name = names.get_name(module) + "." + leaf
        # rows that are not whole blocks stay float, as llama.cpp's quantizer leaves them
        if arr.ndim == 2 and matrices != gguf.GGMLQuantizationType.F32 \
                and arr.shape[1] % gguf.GGML_QUANT_SIZES[matrices][0] == 0:
            w.add_tensor(name, gguf.quants.quantize(arr, matrices), raw_dtype=matrices)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows for its "llama" architecture."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_as_gguf(folder: Path, path: Path) -> Path:
    """A tiny HF Qwen3-MoE or Mixtral as llama.cpp's converter lays it out: "qwen3moe", or "llama"
    with expert tensors (Mixtral; Q/K rows permuted); each layer's experts stacked into
    ffn_{gate,up,down}_exps [E, rows, cols], the router as ffn_gate_inp; float32 tensors."""
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    mixtral = cfg["architectures"][0] == "MixtralForCausalLM"
    arch = gguf.MODEL_ARCH.LLAMA if mixtral else gguf.MODEL_ARCH.QWEN3MOE
    layers, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    names = gguf.get_tensor_name_map(arch, layers)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if not mixtral:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", False)))
    tensors = load_file(str(folder / "model.safetensors"))
    block, parts = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    for n in range(layers):
        for part, kind in zip(parts, ("gate", "up", "down")):
            stack = np.stack([tensors.pop(f"model.layers.{n}.{block}.experts.{e}.{part}.weight")
                              for e in range(experts)])
            w.add_tensor(f"blk.{n}.ffn_{kind}_exps.weight", np.ascontiguousarray(stack, dtype=np.float32))
    for hf, arr in tensors.items():
        module, leaf = hf.rsplit(".", 1)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if mixtral and module.endswith("self_attn.q_proj"):
            arr = _llama_permute(arr, heads)
        elif mixtral and module.endswith("self_attn.k_proj"):
            arr = _llama_permute(arr, kv_heads)
        w.add_tensor(names.get_name(module) + "." + leaf, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
