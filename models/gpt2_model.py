"""GPT-2 in tvm.relax.frontend.nn, on TVM's paged KV cache (models/gpt2.py is the family: config,
weights, GGUF). Parameters are named as HF's GPT2LMHeadModel tensors (transformer.wte, ...,
transformer.h.N.attn.c_attn, lm_head when untied).

Entry points and their spec are models/decoder.py's (DecoderForCausalLM's docstring lists them):
embed gives the token embeddings only; every entry point that runs the blocks adds the learned
position embeddings first, wpe[p] for each query row's position p in its sequence, which the KV
cache knows for this step (get_query_positions: filled by begin_forward, so a chunked prefill, a
batch of sequences at different lengths and speculative verification all get theirs). The cache
is made with RopeMode.NONE: attention only, no rotary embedding.
"""
from __future__ import annotations

from tvm import relax as rx
from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.target import Target

from vtool.models.config import ModelConfig
from vtool.models.decoder import DecoderForCausalLM, Linear
from vtool.models.layer_norm import LayerNorm


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, dtype: str):
        self.heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.c_attn = Linear(c.hidden_size, 3 * c.hidden_size, True, dtype)  # q | k | v
        self.c_proj = Linear(c.hidden_size, c.hidden_size, True, dtype)

    def forward(self, x: Tensor, kv: PagedKVCache, layer_id: int) -> Tensor:
        b, s, h = x.shape
        qkv = op.reshape(self.c_attn(x), (b, s, 3 * self.heads, self.head_dim))
        o = kv.attention_with_fused_qkv(layer_id, qkv, self.heads, sm_scale=self.head_dim**-0.5)
        return self.c_proj(op.reshape(o, (b, s, h)))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, dtype: str):
        self.c_fc = Linear(c.hidden_size, c.intermediate_size, True, dtype)
        self.c_proj = Linear(c.intermediate_size, c.hidden_size, True, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(op.gelu(self.c_fc(x), approximate="tanh"))  # "gelu_new"


class Block(nn.Module):
    def __init__(self, c: ModelConfig, dtype: str):
        self.ln_1 = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.attn = Attention(c, dtype)
        self.ln_2 = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(c, dtype)

    def forward(self, h: Tensor, kv: PagedKVCache, layer_id: int) -> Tensor:
        h = h + self.attn(self.ln_1(h), kv, layer_id)
        return h + self.mlp(self.ln_2(h))


class GPT2Model(nn.Module):
    def __init__(self, c: ModelConfig, dtype: str):
        self.wte = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.wpe = nn.Embedding(c.max_position_embeddings, c.hidden_size, dtype=dtype)
        self.h = nn.ModuleList([Block(c, dtype) for _ in range(c.num_hidden_layers)])
        self.ln_f = LayerNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, c: ModelConfig, dtype: str, target: Target):
        self.config, self.dtype, self.target = c, dtype, target
        self.transformer = GPT2Model(c, dtype)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, False, dtype)

    def _logits(self, h: Tensor, prompt: bool = False) -> Tensor:
        """Float32 logits; `prompt` (the decoder's: a quantized head's prompt path) changes nothing here."""
        h = self.transformer.ln_f(h)
        if self.config.tie_word_embeddings:
            return op.matmul(h, op.permute_dims(self.transformer.wte.weight), out_dtype="float32")
        logits = self.lm_head(h)
        return logits if logits.dtype == "float32" else logits.astype("float32")

    def _layers(self, embeds: Tensor, kv: PagedKVCache) -> Tensor:
        b, s, hidden = embeds.shape
        positions = kv.get_query_positions(b * s)  # each row's position in its own sequence
        h = embeds + op.reshape(op.take(self.transformer.wpe.weight, positions, axis=0), (b, s, hidden))
        for i, block in enumerate(self.transformer.h):
            h = block(h, kv, i)
        return h

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.transformer.wte(input_ids)

    # The decoder's entry points over this module's _layers and _logits (no quantized layers, so
    # batch_verify's decode numerics are batch_prefill's).
    prefill = DecoderForCausalLM.prefill
    decode = DecoderForCausalLM.decode
    batch_prefill = DecoderForCausalLM.batch_prefill
    batch_decode = DecoderForCausalLM.batch_decode
    batch_verify = DecoderForCausalLM.batch_verify

    def create_tir_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                                  prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                                  support_sliding_window: tirx.Var) -> PagedKVCache:
        c = self.config
        # vtool.toolchain.flashinfer_attention.use_attention may set another cache class.
        return getattr(self, "kv_cache_class", TIRPagedKVCache)(
            attn_kind="mha", max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size, page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=rx.ShapeExpr([0, c.num_hidden_layers]),
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, qk_head_dim=c.head_dim, v_head_dim=c.head_dim,
            mla_original_qk_head_dim=0, mla_original_v_head_dim=0,
            rope_mode=RopeMode.NONE, rope_scale=1, rope_theta=c.rope_theta,
            rope_scaling={}, rope_ext_factors=rx.prim_value(0),
            rotary_dim=c.head_dim, enable_disaggregation=False, dtype=self.dtype, target=self.target)

    # The decoder's entry points, argument names and symbolic dims: the runtime and the CUDA
    # graph copies (toolchain/pipeline.py) rely on them.
    get_default_spec = DecoderForCausalLM.get_default_spec
