"""A tiny HF checkpoint written as a GGUF file the way llama.cpp's converter lays one out for
architectures whose tensors it stores as HF does (no Q/K row permutation: phi3, olmo2): names
from gguf-py's tensor map, the hyperparameters llama.cpp writes. Written independently of
vtool's reader, which the tests then hold to transformers."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np


def write_hf_as_gguf(folder: Path, path: Path, arch: "gguf.MODEL_ARCH",
                     matrices: "gguf.GGMLQuantizationType" = gguf.GGMLQuantizationType.F32,
                     sliding_window: int | None = None, extra: dict[str, np.ndarray] | None = None) -> Path:
    """`folder`'s config.json + model.safetensors as a GGUF of `arch`; 2-D tensors in
    `matrices` (gguf-py's quantizer), the rest float32; `extra` tensors added as given."""
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
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
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
