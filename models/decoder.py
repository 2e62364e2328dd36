"""The Llama-style decoder in tvm.relax.frontend.nn, on TVM's paged KV cache.

The module of every family today (models/llama.py: Llama, Mistral, SmolLM2; models/qwen2.py;
models/qwen3.py); the differences are config flags the family's normalisation sets
(ModelConfig.attention_bias for Qwen2's q/k/v bias, ModelConfig.qk_norm for Qwen3's per-head
RMSNorm on q and k; Gemma's in models/gemma.py: sandwich_norms, mlp_act, embed_scale,
attn_scale, final_logit_softcap, attn_logit_softcap (the cache's kernels capped: models/softcap.py),
sliding_window/sliding_layers (per-layer "mha_sliding" KV-cache layers) and model_rope (q/k
rotated here, models/rope.py, the cache built with RopeMode.NONE)).
q/k/v and gate/up are fused into one projection
each, so attention and the MLP cost one GEMV launch apiece instead of three and two (a GGUF
that keeps the parts in different block formats runs one GEMV per run of same-format parts:
quantized_linear.SplitQuantizedLinear).

Entry points (the runtime calls these by name; the manifest lists them):
  embed(input_ids[n]) -> [n, H]
  prefill(embeds[1, n, H], kv) -> logits[1, 1, V] of the last position
  decode(embeds[1, 1, H], kv) -> logits[1, 1, V]
  batch_prefill(embeds[1, n, H], logit_positions[b], kv) -> logits[1, b, V]
  batch_decode(embeds[b, 1, H], kv) -> logits[b, 1, V]
  batch_verify(embeds[1, n, H], logit_positions[b], kv) -> logits[1, b, V]
    (batch_prefill with decode's numerics: speculative verification scores a few positions per
    sequence, and its logits must be the ones decoding them one by one would give)
    (CUDA builds add batch_decode_captured, a copy run from CUDA graphs per batch size:
    toolchain/pipeline.py; its symbolic batch is the spec's "batch_size")
  create_tir_paged_kv_cache(max_batch, max_total_len, prefill_chunk, page_size, sliding)
  create_tir_sliding_kv_cache(max_batch, max_total_len, prefill_chunk, page_size): only where every
    layer is windowed (CPU builds): the cache that frees what the window passed (models/window_cache.py)
"""
from __future__ import annotations

from typing import Mapping

from tvm import relax as rx
from tvm import te
from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.target import Target

from vtool.models.config import ModelConfig
from vtool.models import draft_chain
from vtool.models.fp8_linear import Fp8Linear
from vtool.models.quantized_linear import (Int8Kernels, QuantizedEmbedding, QuantizedLinear, SplitQuantizedLinear,
                                          decode_numerics, use_int8_gemv)
from vtool.models.weights import SPLIT
from vtool.models.rope import apply_rope, inverse_frequencies, longrope_inverse_frequencies, yarn_inverse_frequencies
from vtool.models.softcap import softcap_kv_cache
from vtool.runtime.weights.fp8_layout import FP8_FORMAT
from vtool.models.window_cache import ENTRY as SLIDING_CACHE_ENTRY, frees_window, sliding_kv_cache

# compiled module path ("model.layers.0.mlp.down_proj") -> GGML block format kept in memory, or FP8_FORMAT
Formats = Mapping[str, str]

class Linear(nn.Module):
    """y = x W^T (+ b), accumulated in float32 whatever the weight dtype.

    nn.Linear in bf16/fp16 accumulates in the output dtype, which loses real precision
    over K in the thousands; here the matmul writes float32 and is cast once.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str):
        self.out_features = out_features
        self.weight = nn.Parameter((out_features, in_features), dtype)
        self.bias = nn.Parameter((out_features,), dtype) if bias else None
        self.compute_dtype = dtype

    def forward(self, x: Tensor) -> Tensor:
        y = op.matmul(x, op.permute_dims(self.weight), out_dtype="float32")
        if self.compute_dtype != "float32":
            y = y.astype(self.compute_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y


def make_linear(path: str, in_features: int, out_features: int, bias: bool, dtype: str,
                formats: Formats, parts: tuple[int, ...] | None = None
                ) -> Linear | QuantizedLinear | SplitQuantizedLinear | Fp8Linear:
    """A QuantizedLinear where the build keeps `path`'s weight in blocks, an Fp8Linear where it
    keeps it in FP8 (models/fp8_linear.py), else a Linear.
    `parts`: a fused layer's rows per source (q, k, v), for a weight kept in several formats
    (a SplitQuantizedLinear)."""
    fmt = formats.get(path)
    if fmt is None:
        return Linear(in_features, out_features, bias, dtype)
    if fmt == FP8_FORMAT:
        return Fp8Linear(in_features, out_features, bias, dtype)
    if SPLIT in fmt:
        if parts is None or sum(parts) != out_features:
            raise ValueError(f"{path}: kept as {fmt!r} but the layer does not say its parts' rows")
        return SplitQuantizedLinear(in_features, parts, bias, dtype, fmt)
    return QuantizedLinear(in_features, out_features, bias, dtype, fmt)


def rms_norm(c: ModelConfig, dim: int, dtype: str) -> nn.Module:
    """The family's RMSNorm over `dim`: Llama's in the model's dtype, or Gemma's (1 + w) one."""
    return PlusOneRMSNorm(dim, c.rms_norm_eps, dtype) if c.norm_plus_one else \
        nn.RMSNorm(dim, -1, c.rms_norm_eps, bias=False, dtype=dtype)


class PlusOneRMSNorm(nn.Module):
    """Gemma's RMSNorm, x / rms(x) * (1 + w), computed in float32 as transformers' Gemma norms are,
    the weight bound as 1 + w in float32 (the plus_one transform, models/gemma.py) and the result
    cast to the model's dtype. Why float32: 1 + w rounded to bfloat16 drops w's low bits in every
    norm, which moved a tiny Gemma-2's bfloat16 logits 2.1 from float32 at one position where
    transformers' own bfloat16 run is 0.3 off (tests/test_cpu_half_parity.py)."""

    def __init__(self, dim: int, eps: float, dtype: str):
        self.weight = nn.Parameter((dim,), dtype="float32")
        self.eps, self.dtype = eps, dtype

    def forward(self, x: Tensor) -> Tensor:
        wide = x if x.dtype == "float32" else op.astype(x, "float32")
        out = op.rms_norm(wide, weight=self.weight, axes=-1, epsilon=self.eps)
        return out if self.dtype == "float32" else op.astype(out, self.dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, dtype: str, formats: Formats, prefix: str, layer_id: int = 0):
        self.head_dim, self.hq, self.hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        self.sm_scale = c.attn_scale or self.head_dim**-0.5  # Gemma: query_pre_attn_scalar ** -0.5
        self.inv_freq = None  # model_rope: this layer's rotary frequencies (models/rope.py)
        self.rope_attn_factor = 1.0  # and the factor on its cos and sin (longrope)
        if c.model_rope:
            sliding = layer_id in c.sliding_layers
            theta = (c.rope_local_theta or c.rope_theta) if sliding else c.rope_theta
            scaling = c.rope_scaling or {}
            if sliding and c.rope_local_theta:  # Gemma-3 scales its global layers only
                scaling = {}
            rotary = c.rotary_dim or self.head_dim  # partial_rotary_factor: the leading dims only
            if scaling.get("rope_type") == "longrope":  # Phi-3's per-frequency factors (models/phi3.py)
                self.inv_freq, self.rope_attn_factor = longrope_inverse_frequencies(rotary, theta, scaling)
            elif scaling.get("rope_type") == "yarn":
                self.inv_freq, self.rope_attn_factor = yarn_inverse_frequencies(rotary, theta, scaling)
            else:
                self.inv_freq = inverse_frequencies(rotary, theta, float(scaling.get("factor", 1.0)))
        self.qkv_proj = make_linear(prefix + "qkv_proj", c.hidden_size, (self.hq + 2 * self.hkv) * self.head_dim,
                                    c.attention_bias, dtype, formats,
                                    (self.hq * self.head_dim, self.hkv * self.head_dim, self.hkv * self.head_dim))
        self.o_proj = make_linear(prefix + "o_proj", self.hq * self.head_dim, c.hidden_size, False, dtype, formats)
        self.qk_norm, self.qk_norm_full = c.qk_norm, c.qk_norm_full
        if c.qk_norm:
            # per head (Qwen3), or over all heads at once (OLMo-2)
            q_dim, k_dim = (self.hq * self.head_dim, self.hkv * self.head_dim) if c.qk_norm_full \
                else (self.head_dim, self.head_dim)
            self.q_norm, self.k_norm = rms_norm(c, q_dim, dtype), rms_norm(c, k_dim, dtype)

    def forward(self, x: Tensor, kv: PagedKVCache, layer_id: int) -> Tensor:
        b, s, _ = x.shape
        qkv = self.qkv_proj(x)
        if self.qk_norm_full:
            q_end, k_end = self.hq * self.head_dim, (self.hq + self.hkv) * self.head_dim
            q, k, v = op.split(qkv, [q_end, k_end], axis=-1)
            qkv = op.concat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        qkv = op.reshape(qkv, (b, s, self.hq + 2 * self.hkv, self.head_dim))
        if self.qk_norm and not self.qk_norm_full:
            q, k, v = op.split(qkv, [self.hq, self.hq + self.hkv], axis=2)
            qkv = op.concat([self.q_norm(q), self.k_norm(k), v], dim=2)
        if self.inv_freq is not None:  # rotated here; the cache is built with RopeMode.NONE
            flat = op.reshape(qkv, (b * s, self.hq + 2 * self.hkv, self.head_dim))
            q, k, v = op.split(flat, [self.hq, self.hq + self.hkv], axis=1)
            positions = kv.get_query_positions(b * s)
            q = apply_rope(q, positions, self.inv_freq, self.rope_attn_factor)
            k = apply_rope(k, positions, self.inv_freq, self.rope_attn_factor)
            qkv = op.reshape(op.concat([q, k, v], dim=1), (b, s, self.hq + 2 * self.hkv, self.head_dim))
        # RoPE (unless model_rope) and paged attention both happen inside the KV-cache builtin.
        o = kv.attention_with_fused_qkv(layer_id, qkv, self.hq, sm_scale=self.sm_scale)
        return self.o_proj(op.reshape(o, (b, s, self.hq * self.head_dim)))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, dtype: str, formats: Formats, prefix: str):
        self.gate_up_proj = make_linear(prefix + "gate_up_proj", c.hidden_size, 2 * c.intermediate_size, False,
                                        dtype, formats, (c.intermediate_size, c.intermediate_size))
        self.down_proj = make_linear(prefix + "down_proj", c.intermediate_size, c.hidden_size, False, dtype, formats)
        self.act = c.mlp_act

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        gate = op.gelu(gate, approximate="tanh") if self.act == "gelu_tanh" else op.silu(gate)
        return self.down_proj(gate * up)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, dtype: str, formats: Formats, prefix: str, layer_id: int = 0):
        self.self_attn = Attention(c, dtype, formats, prefix + "self_attn.", layer_id)
        if c.is_moe_layer(layer_id):  # mixture of experts (Qwen3-MoE, Mixtral): models/moe.py
            from vtool.models.moe import MoEMLP

            self.mlp = MoEMLP(c, dtype)
        else:
            self.mlp = MLP(c, dtype, formats, prefix + "mlp.")
        self.post_norms, self.sandwich_norms = c.post_norms, c.sandwich_norms
        if not c.post_norms:
            self.input_layernorm = rms_norm(c, c.hidden_size, dtype)
        self.post_attention_layernorm = rms_norm(c, c.hidden_size, dtype)
        if c.sandwich_norms:
            self.pre_feedforward_layernorm = rms_norm(c, c.hidden_size, dtype)
        if c.post_norms or c.sandwich_norms:
            self.post_feedforward_layernorm = rms_norm(c, c.hidden_size, dtype)

    def forward(self, h: Tensor, kv: PagedKVCache, layer_id: int) -> Tensor:
        if self.sandwich_norms:  # Gemma: a norm before and after each block
            h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), kv, layer_id))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if self.post_norms:  # OLMo-2: each block's output normalized, then added
            h = h + self.post_attention_layernorm(self.self_attn(h, kv, layer_id))
            return h + self.post_feedforward_layernorm(self.mlp(h))
        h = h + self.self_attn(self.input_layernorm(h), kv, layer_id)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, c: ModelConfig, dtype: str, formats: Formats):
        embed_fmt = formats.get("model.embed_tokens")
        self.embed_tokens = (nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype) if embed_fmt is None
                             else QuantizedEmbedding(c.vocab_size, c.hidden_size, dtype, embed_fmt))
        self.layers = nn.ModuleList([DecoderLayer(c, dtype, formats, f"model.layers.{i}.", i)
                                     for i in range(c.num_hidden_layers)])
        self.norm = rms_norm(c, c.hidden_size, dtype)


class DecoderForCausalLM(nn.Module):
    """`formats` names the weights kept in GGUF blocks (QuantizedLinear / QuantizedEmbedding);
    every other weight is a dense parameter of `dtype`. `int8_kernels` (handed in by the
    toolchain; None: none) take the kept weights' matmuls over Q8_0 activation rows, in decode
    (`int8_activations` "decode") or everywhere ("q8_0"); "none" keeps them all float."""

    # positions of the draft cache of draft_extend / draft_step (models/draft_chain.py); 0: no such entries
    draft_cache_len = 0

    def __init__(self, c: ModelConfig, dtype: str, target: Target, formats: Formats | None = None,
                 int8_activations: str = "decode", int8_kernels: Int8Kernels | None = None):
        formats = formats or {}
        self.config, self.dtype, self.target = c, dtype, target
        self.model = Backbone(c, dtype, formats)
        if not c.tie_word_embeddings:
            self.lm_head = make_linear("lm_head", c.hidden_size, c.vocab_size, False, dtype, formats)
        if formats and int8_kernels is not None and int8_activations != "none":
            use_int8_gemv(self, int8_kernels, "all" if int8_activations == "q8_0" else "decode")

    def _logits(self, h: Tensor, prompt: bool = False) -> Tensor:
        """`prompt`: the logits of a prompt's last position (a quantized lm_head then keeps
        float activations unless the build quantizes every row)."""
        h = self.model.norm(h)
        if self.config.tie_word_embeddings:
            if isinstance(self.model.embed_tokens, QuantizedEmbedding):
                return self._softcap(self.model.embed_tokens.lm_head(h, prompt))
            w = self.model.embed_tokens.weight
            return self._softcap(op.matmul(h, op.permute_dims(w), out_dtype="float32"))
        logits = self.lm_head(h, prompt) if isinstance(self.lm_head, QuantizedLinear) else self.lm_head(h)
        return self._softcap(logits if logits.dtype == "float32" else logits.astype("float32"))

    def _softcap(self, logits: Tensor) -> Tensor:
        """Gemma-2's final soft-capping, cap * tanh(logits / cap), in float32."""
        cap = self.config.final_logit_softcap
        if not cap:
            return logits
        return op.tanh(logits / Tensor.from_scalar(cap, "float32")) * Tensor.from_scalar(cap, "float32")

    def _layers(self, h: Tensor, kv: PagedKVCache) -> Tensor:
        for i, layer in enumerate(self.model.layers):
            h = layer(h, kv, i)
        return h

    def embed(self, input_ids: Tensor) -> Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale:  # Gemma: times sqrt(hidden), the factor rounded to the embedding dtype
            x = x * Tensor.from_scalar(self.config.hidden_size**0.5, x.dtype)
        return x

    def prefill(self, input_embed: Tensor, kv: PagedKVCache):
        h = self._layers(input_embed, kv)

        def last_position(x: te.Tensor) -> te.Tensor:
            b, n, d = x.shape
            return te.compute((b, 1, d), lambda i, _, k: x[i, n - 1, k], name="last_position")

        last = op.tensor_expr_op(last_position, name_hint="last_position", args=[h])
        return self._logits(last, prompt=True), kv

    def decode(self, input_embed: Tensor, kv: PagedKVCache):
        return self._logits(self._layers(input_embed, kv)), kv

    # decode in two calls (CUDA builds, the runtime's chained one-sequence steps): the layers, then
    # the final norm and lm_head. Between the two the runtime records the KV cache's fence
    # (runtime/engine/kv_cache.py fence_steps), so the next step may be queued while this one's
    # lm_head still runs instead of after it.
    def decode_hidden(self, input_embed: Tensor, kv: PagedKVCache):
        return self._layers(input_embed, kv), kv

    def decode_logits(self, hidden: Tensor):
        return self._logits(hidden)

    def batch_prefill(self, input_embeds: Tensor, logit_positions: Tensor, kv: PagedKVCache):
        h = self._layers(input_embeds, kv)
        return self._logits(op.take(h, logit_positions, axis=1)), kv

    def batch_decode(self, input_embeds: Tensor, kv: PagedKVCache):
        return self._logits(self._layers(input_embeds, kv)), kv

    def batch_verify(self, input_embeds: Tensor, logit_positions: Tensor, kv: PagedKVCache):
        with decode_numerics(self):
            h = self._layers(input_embeds, kv)
            return self._logits(op.take(h, logit_positions, axis=1)), kv

    def draft_extend(self, input_ids: Tensor, position: Tensor, k_cache: Tensor, v_cache: Tensor):
        n = input_ids.shape[0]
        h = op.reshape(self.embed(input_ids), (1, n, self.config.hidden_size))
        kv = draft_chain.ContiguousKV(self.config, self.dtype, k_cache, v_cache, position, n)
        self._layers(h, kv)
        return kv.k_cache  # the writes are what counts (the last layer's attention onwards is dead code)

    def draft_step(self, state: Tensor, k_cache: Tensor, v_cache: Tensor):
        token, position = draft_chain.select(state)
        h = op.reshape(self.embed(token), (1, 1, self.config.hidden_size))
        kv = draft_chain.ContiguousKV(self.config, self.dtype, k_cache, v_cache, position, 1)
        state = draft_chain.record_argmax(state, self._logits(self._layers(h, kv)))
        return draft_chain.last_token(state)

    def chain_verify(self, state: Tensor, k_cache: Tensor, v_cache: Tensor):
        """A target's round over its own cache: MAX_VERIFY rows (the last accepted token, the drafts,
        padding) from state[V_POSITION] on, each row's greedy token into the state (and returned)."""
        tokens, position = draft_chain.verify_inputs(state)
        rows = draft_chain.MAX_VERIFY
        h = op.reshape(self.embed(tokens), (1, rows, self.config.hidden_size))
        kv = draft_chain.ContiguousKV(self.config, self.dtype, k_cache, v_cache, position, rows)
        with decode_numerics(self):  # as batch_verify: the rows' logits are decode's
            logits = self._logits(self._layers(h, kv))
        return draft_chain.verify_out(draft_chain.verify_argmax(state, logits))

    def create_tir_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                                  prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                                  support_sliding_window: tirx.Var) -> PagedKVCache:
        c = self.config
        # sliding-window layers: TVM's per-layer "mha_sliding" kind attends over the last
        # layer_sliding_window_size tokens (the cache keeps every page: the global layers need them)
        attn_kind = ([("mha_sliding" if i in c.sliding_layers else "mha") for i in range(c.num_hidden_layers)]
                     if c.sliding_window else "mha")
        if isinstance(attn_kind, list) and "mha" not in attn_kind:
            # every layer windowed (Mistral, Phi-3): TVM 0.27's cache allocates its q/k/v staging
            # buffers only when some layer is "mha" (else the first forward fails on a null
            # tensor), so it gets one more, which no forward pass reaches (its pages are counted:
            # runtime/engine/kv_cache.py cache_layers)
            attn_kind.append("mha")
        layers = len(attn_kind) if isinstance(attn_kind, list) else c.num_hidden_layers
        window = {"layer_sliding_window_size": c.sliding_window} if c.sliding_window else {}
        # vtool.toolchain.flashinfer_attention.use_attention may set another cache class.
        cache = getattr(self, "kv_cache_class", TIRPagedKVCache)(
            attn_kind=attn_kind, max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size, page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=rx.ShapeExpr([0, layers]),
            num_hidden_layers=layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, qk_head_dim=c.head_dim, v_head_dim=c.head_dim,
            mla_original_qk_head_dim=0, mla_original_v_head_dim=0,
            rope_mode=RopeMode.NONE if c.model_rope else RopeMode.NORMAL, rope_scale=1, rope_theta=c.rope_theta,
            rope_scaling={} if c.model_rope else dict(c.rope_scaling or {}), rope_ext_factors=rx.prim_value(0),
            rotary_dim=c.head_dim, enable_disaggregation=False, dtype=self.dtype, target=self.target, **window)
        if c.attn_logit_softcap:  # Gemma-2: every attention kernel of the cache caps its scores (models/softcap.py)
            softcap_kv_cache(cache, c.attn_logit_softcap)
        return cache

    def create_tir_sliding_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                                    prefill_chunk_size: tirx.Var, page_size: tirx.Var) -> PagedKVCache:
        """Every layer windowed: TVM's cache-wide sliding window, which frees the pages the
        window has passed (models/window_cache.py; the runtime picks it where nothing pops)."""
        return sliding_kv_cache(self.config, self.dtype, self.target, max_batch_size, max_total_seq_len,
                                prefill_chunk_size, page_size)

    def get_default_spec(self) -> dict:
        hidden, dt = self.config.hidden_size, self.dtype
        packed = {"param_mode": "packed", "effect_mode": "none"}
        kv = nn.spec.Object(object_type=PagedKVCache)
        spec = {
            "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "$": packed},
            "prefill": {"input_embed": nn.spec.Tensor([1, "seq_len", hidden], dt), "kv": kv, "$": packed},
            "decode": {"input_embed": nn.spec.Tensor([1, 1, hidden], dt), "kv": kv, "$": packed},
            "batch_prefill": {
                "input_embeds": nn.spec.Tensor([1, "seq_len", hidden], dt),
                "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
                "kv": kv, "$": packed,
            },
            "batch_decode": {"input_embeds": nn.spec.Tensor(["batch_size", 1, hidden], dt), "kv": kv, "$": packed},
            "batch_verify": {
                "input_embeds": nn.spec.Tensor([1, "seq_len", hidden], dt),
                "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
                "kv": kv, "$": packed,
            },
            "create_tir_paged_kv_cache": {
                "max_batch_size": int, "max_total_seq_len": int, "prefill_chunk_size": int,
                "page_size": int, "support_sliding_window": int,
                "$": {"param_mode": "none", "effect_mode": "none"},
            },
        }
        if getattr(self, "split_decode", False):  # decode_hidden / decode_logits (above)
            spec["decode_hidden"] = {"input_embed": nn.spec.Tensor([1, 1, hidden], dt), "kv": kv, "$": packed}
            spec["decode_logits"] = {"hidden": nn.spec.Tensor([1, 1, hidden], dt), "$": packed}
        draft_cache_len = getattr(self, "draft_cache_len", 0)  # (GPT-2 borrows this method and has none)
        if draft_cache_len:
            spec.update(draft_chain.entry_specs(self.config, dt, draft_cache_len))
        if frees_window(self.config, getattr(self, "target", None)):
            spec[SLIDING_CACHE_ENTRY] = {
                "max_batch_size": int, "max_total_seq_len": int, "prefill_chunk_size": int, "page_size": int,
                "$": {"param_mode": "none", "effect_mode": "none"},
            }
        return spec
