"""Tiny random-weight checkpoints made by transformers itself, for parity tests.

Each shape exercises something: GQA, head_dim != hidden/heads, tied and untied heads,
Qwen2's q/k/v bias, Qwen3's q/k norm, Llama-3 rope scaling, Phi-3's fused q|k|v and gate|up, OLMo-2's post-norms.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

COMMON = dict(vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

TINY_SHAPES: dict[str, dict[str, Any]] = {
    # GQA 4/2, head_dim 16 = hidden/heads, untied
    "llama-gqa": dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0),
    # head_dim 32 != hidden/heads = 12, tied, Llama-3 rope scaling
    "llama3-rope": dict(arch="llama", hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                        rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # q/k/v bias, MHA (no GQA), untied; head_dim 32 != 64/4 (CUDA's decode kernel needs
    # head_dim x group >= 32)
    "qwen2-bias": dict(arch="qwen2", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False,
                       rope_theta=1e6),
    # q/k norm, GQA 8/2, head_dim 16 != 96/8 = 12, tied
    "qwen3-qknorm": dict(arch="qwen3", hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         rope_theta=1e6),
    # Mistral: Llama's graph under its own architecture name (no sliding window)
    "mistral-gqa": dict(arch="mistral", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6,
                        sliding_window=None),
    # Phi-3: q|k|v and gate|up stored fused (qkv_proj, gate_up_proj), GQA 4/2, head_dim 32
    "phi3-fused": dict(arch="phi3", hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0,
                       sliding_window=None),
    # OLMo-2: norms after attention and the MLP, q/k RMSNorm over all heads, GQA 4/2
    "olmo2-postnorm": dict(arch="olmo2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0),
    # Qwen3 with untied head and MHA, head_dim 32 != 64/4
    "qwen3-untied": dict(arch="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False,
                         rope_theta=10000.0),
}


def spread_init(model) -> None:
    """transformers' init (std 0.02) makes a model that repeats one token forever, which
    would make "same greedy tokens" a weak check; scale each matrix by its fan-in so
    greedy outputs wander over the vocabulary and argmax ties are unlikely."""
    import torch

    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.7, 1.3)
            elif pname.endswith("bias") or "embed" in pname:
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 3.0 / p.shape[1] ** 0.5)


def make_tiny_model(name: str, folder: Path, seed: int = 0) -> Path:
    """Write config.json + model.safetensors for TINY_SHAPES[name] into folder (float32)."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Olmo2Config,
                              Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
               "phi3": (Phi3Config, Phi3ForCausalLM), "olmo2": (Olmo2Config, Olmo2ForCausalLM)}
    spec = dict(TINY_SHAPES[name])
    config_cls, model_cls = classes[spec.pop("arch")]
    torch.manual_seed(seed)
    config = config_cls(**COMMON, **spec)
    model = model_cls(config).to(torch.float32).eval()
    spread_init(model)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder


def make_tiny_chat_model(folder: Path, gguf_path: Path, seed: int = 0) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer and chat template (exported by
    transformers from the GGUF), so engine and server tests run real text through a
    model that costs milliseconds per step."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         rope_theta=10000.0)
    model = LlamaForCausalLM(config).eval()
    spread_init(model)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
