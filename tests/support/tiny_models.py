"""Tiny random-weight checkpoints made by transformers itself, for parity tests.

Each shape exercises something: GQA, head_dim != hidden/heads, tied and untied heads,
Qwen2's q/k/v bias, Qwen3's q/k norm, Llama-3 rope scaling, Phi-3's fused q|k|v and gate|up, OLMo-2's post-norms,
sliding windows (Gemma, Qwen2, Mistral, Phi-3, OLMo-3).
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
    # rows of 256 (Q4_K's super-block) except down's 288 (--quantization q4_k's Q5_0 fallback), untied
    "llama-k256": dict(arch="llama", hidden_size=256, intermediate_size=288, num_hidden_layers=2,
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
    # GPT-2: learned positions (n_positions 160 < COMMON's 512), LayerNorm with bias, gelu_new, Conv1D
    # weights; 3 heads of 32, n_inner 200 != 4 x 96, odd vocabulary, tied lm_head
    "gpt2-learned-pos": dict(arch="gpt2", vocab_size=509, max_position_embeddings=160, n_embd=96, n_layer=2,
                             n_head=3, n_inner=200, tie_word_embeddings=True),
    # Gemma-3: sliding-window layers (window 8, shorter than the tests' prompts) around a global
    # one, local/global rope bases with linear scaling on the global layer, q/k norm, GQA 4/2,
    # head_dim 32 != 64/4, query_pre_attn_scalar 24 != head_dim, untied (a tied tiny Gemma
    # repeats one token)
    "gemma3-window": dict(arch="gemma3", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                          sliding_window=8, query_pre_attn_scalar=24,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                          rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                           "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                              "rope_theta": 1e6}}),
    # Gemma-2: alternating sliding (window 8) and global layers, final logit soft-capping, attention
    # logit soft-capping at 2.0 (small enough to bite: this model's scores reach far past it), MQA 4/1,
    # head_dim 256 (Gemma2Config's default, != 48/4), untied (a tied tiny Gemma repeats one token;
    # test_gemma.py ties a copy for llama.cpp's gemma2 GGUF, which has no output tensor)
    "gemma2-softcap": dict(arch="gemma2", hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                           sliding_window=8, query_pre_attn_scalar=20, final_logit_softcapping=10.0,
                           attn_logit_softcapping=2.0),
    # Qwen2 with use_sliding_window: layer 0 global, layer 1 over a window of 8; MQA 4/1, head_dim 12
    "qwen2-window": dict(arch="qwen2", hidden_size=48, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                         rope_theta=1e4,
                         use_sliding_window=True, sliding_window=8, max_window_layers=1),
    # Mistral with a real sliding window (8, shorter than the tests' prompts) on every layer; GQA 4/2, head_dim 16
    # (a multiple of 16: vtool's own CPU sliding-window kernels, schedules/cpu/attention.py)
    "mistral-window": dict(arch="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e4,
                           sliding_window=8),
    # Phi-3 with a real sliding window of 8 on every layer (Phi-3-mini-4k's 2047, scaled down); head_dim 32
    "phi3-window": dict(arch="phi3", hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0,
                        sliding_window=8),
    # OLMo-3: OLMo-2's layout with sliding-window layers (window 8) around a global one; GQA 4/2, head_dim 16
    "olmo3-window": dict(arch="olmo3", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0,
                         sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # YaRN x4 over an original context of 64 (Qwen2.5's long-context recipe) on qwen2-bias's shape
    "qwen2-yarn": dict(arch="qwen2", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                        "rope_theta": 1e6}),
    # OLMo-3's long-context recipe on olmo3-window's shape: yarn x8 on the full-attention layer only,
    # the sliding layers on a theta of their own
    "olmo3-yarn": dict(arch="olmo3", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0,
                       sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                       rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 8.0,
                                                           "original_max_position_embeddings": 16,
                                                           "rope_theta": 5e5, "attention_factor": 1.2},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "qwen3-untied": dict(arch="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False,
                         rope_theta=10000.0),
    # Qwen3-MoE: 8 experts of 36, top-2 without renormalization, q/k norm, GQA 4/2, head_dim 16 != 48/4
    "qwen3moe-experts": dict(arch="qwen3moe", hidden_size=48, intermediate_size=80, moe_intermediate_size=36,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                             rope_theta=1e6),
    # Qwen3-MoE with a dense layer (mlp_only_layers: layer 1's MLP of intermediate_size 80) and the chosen
    # experts' weights renormalized (norm_topk_prob, as the released Qwen3-MoE models)
    "qwen3moe-dense-layer": dict(arch="qwen3moe", hidden_size=48, intermediate_size=80, moe_intermediate_size=36,
                                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 tie_word_embeddings=False, rope_theta=1e6),
    # Mixtral: 8 experts of 40, top-2 (always renormalized), GQA 4/2, head_dim 20 != 48/4 (transformers'
    # own cached and uncached logits of this model agree within 6e-5; at hidden 64 they did not within 1e-4)
    "mixtral-experts": dict(arch="mixtral", hidden_size=48, intermediate_size=40, num_local_experts=8,
                            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=20, tie_word_embeddings=False, rope_theta=1e6, sliding_window=None),
}

# Shapes built for the GPU parity run only (tests/test_gpu_parity.py, tests/support/gpu_prebuild.py): they
# take apart a CUDA failure of a TINY_SHAPES model. Gemma-2's tiny model failed on CUDA with its attention
# soft-cap at head_dim 256: the same model without the cap, and with the cap at head_dim 32, say which it is.
GPU_DIAGNOSTIC_SHAPES: dict[str, dict[str, Any]] = {
    "gemma2-nocap": {**{k: v for k, v in TINY_SHAPES["gemma2-softcap"].items() if k != "attn_logit_softcapping"},
                     "attn_logit_softcapping": None},
    "gemma2-softcap-d32": {**TINY_SHAPES["gemma2-softcap"], "head_dim": 32},
}


def shape_spec(name: str) -> dict[str, Any]:
    """The spec of a TINY_SHAPES or GPU_DIAGNOSTIC_SHAPES name."""
    if name in TINY_SHAPES:
        return TINY_SHAPES[name]
    if name in GPU_DIAGNOSTIC_SHAPES:
        return GPU_DIAGNOSTIC_SHAPES[name]
    raise KeyError(f"{name!r} is in neither TINY_SHAPES nor GPU_DIAGNOSTIC_SHAPES")


def spread_init(model) -> None:
    """transformers' init (std 0.02) makes a model that repeats one token forever, which
    would make "same greedy tokens" a weak check; scale each matrix by its fan-in so
    greedy outputs wander over the vocabulary and argmax ties are unlikely."""
    import torch

    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or (".ln_" in pname and pname.endswith("weight")):  # GPT-2's ln_1, ln_2, ln_f
                p.uniform_(0.7, 1.3)
            elif pname.endswith("bias") or "embed" in pname:
                p.normal_(0.0, 0.3)
            else:  # GPT-2's Conv1D matrices are [in, out]
                p.normal_(0.0, 3.0 / p.shape[0 if ".c_" in pname else -1] ** 0.5)  # MoE experts: [E, out, in]


def make_tiny_model(name: str, folder: Path, seed: int = 0) -> Path:
    """Write config.json + model.safetensors for shape_spec(name) into folder (float32)."""
    import torch
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config,
                              GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Olmo2Config,
                              Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
               "phi3": (Phi3Config, Phi3ForCausalLM), "olmo2": (Olmo2Config, Olmo2ForCausalLM),
               "gpt2": (GPT2Config, GPT2LMHeadModel), "gemma2": (Gemma2Config, Gemma2ForCausalLM),
               "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM)}
    import transformers

    classes |= {"qwen3moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
                "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
                "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM)}
    spec = dict(shape_spec(name))
    config_cls, model_cls = classes[spec.pop("arch")]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **spec})  # a shape may override COMMON (gpt2-learned-pos)
    model = model_cls(config).to(torch.float32).eval()
    spread_init(model)
    if name.startswith("gemma"):  # Gemma's RMSNorm scales by 1 + w: the same effective scales as the others'
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.sub_(1.0)
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
