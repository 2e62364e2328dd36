"""EmbeddingGemma (Gemma3TextModel with use_bidirectional_attention): Gemma-3's layers as an embedding model.

The Gemma-3 decoder layers of models/decoder.py run as an encoder, like models/bert.py: no KV
cache, one call over a right-padded batch of whole sequences, every query attending to every
(non-padding) key, and the last layer's normalized hidden states pooled on the host as the
checkpoint's sentence-transformers configuration says (runtime/engine/pooling.py: EmbeddingGemma
pools the mean, then Dense 768->3072->768, then normalizes).

config   models/gemma.py normalize (sandwich norms, (1 + w) RMSNorm, q/k norms, scaled embeddings,
         GELU-tanh, query_pre_attn_scalar, per-layer rope bases in the model, sliding layers).
         use_bidirectional_attention must be true (a causal Gemma3TextModel is refused by name).
         Its sliding window is read as transformers' Gemma3TextConfig reads it: window // 2 + 1
         (config.json's 512 -> 257), and a sliding layer's query i sees key j when |i - j| < that
         (transformers' _bidirectional_window_overlay), a symmetric window of 256 either way.
module   GemmaEncoder below: embed_tokens * sqrt(H), models/decoder.py DecoderLayer per layer, the
         final norm. DecoderLayer's Attention talks to a KV cache through two calls,
         get_query_positions and attention_with_fused_qkv; DenseAttention stands in for the cache
         and answers them with positions 0..n-1 per row and dense masked attention (float32 scores,
         GQA by broadcasting, an additive bias of float32's lowest where masked, as transformers).
weights  the checkpoint's own names (embed_tokens.*, layers.N.*, norm.*: Gemma3TextModel has no
         "model." prefix); q|k|v and gate|up fused (concat_rows), every RMSNorm weight bound as
         1 + w (models/gemma.py GEMMA_WEIGHTS' plan). No lm_head.
GGUF     none (llama.cpp's "gemma-embedding" files are not read).

Entry point (as models/bert.py; the manifest says task "embed"):
  encode(input_ids[b, n] int32, attention_mask[b, n] int32) -> hidden[b, n, H] float32
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vtool.models import gemma
from vtool.models.config import ConfigError, ModelConfig
from vtool.models.dense_attention import DenseAttentionKernels, UsesDenseAttention, attend, flatten_rows
from vtool.models.encoder_spec import encode_spec
from vtool.models.family import ModelFamily
from vtool.models.weights import WeightPlan, decoder_source_shapes

ARCHITECTURES = gemma.BIDIRECTIONAL  # ("Gemma3TextModel",)


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    if not cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"{arch} without use_bidirectional_attention (a causal Gemma-3 as an embedding model) is "
                          "not supported; supported: EmbeddingGemma's use_bidirectional_attention true")
    c = gemma.normalize(cfg, arch)
    if c.attn_logit_softcap:  # DenseAttention below applies none (EmbeddingGemma sets null)
        raise ConfigError(f"attn_logit_softcapping={c.attn_logit_softcap} is not supported for {arch} (the "
                          "embedding model's dense attention applies no soft-cap); EmbeddingGemma sets null")
    return c


def _source_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The decoder's tensors under Gemma3TextModel's names: no "model." prefix, no lm_head."""
    return {name[len("model."):]: shape for name, shape in decoder_source_shapes(c).items()
            if name.startswith("model.")}


def _modules(_c: ModelConfig) -> dict[str, tuple[str, ...]]:
    return {}  # no weight is kept in quantized blocks (no quantized encoder kernels)


WEIGHTS = WeightPlan(parameters=gemma.GEMMA_WEIGHTS.parameters, source_shapes=_source_shapes, modules=_modules)


def module(c: ModelConfig, dtype: str, target: Any, formats: Mapping[str, str] | None = None, **_int8: Any) -> Any:
    """The encoder; quantized formats are refused (there are no quantized encoder kernels)."""
    if formats:
        raise ConfigError(f"{c.architecture}: weights kept in quantized blocks are not supported for encoders; "
                          "use --quantization none")
    return _encoder_class()(c, dtype)


LOWEST = -3.4028234663852886e38  # float32's lowest: transformers' additive mask value


def _encoder_class() -> type:
    """GemmaEncoder, defined on first use: TVM is imported only when a build exports the module."""
    from tvm import te, tirx
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import Tensor, op
    from vtool.models.decoder import DecoderLayer, rms_norm

    class DenseAttention:
        """What DecoderLayer's Attention asks of a KV cache, answered for whole padded sequences:
        one kernel call where the build handed one in (models/dense_attention.py), else Relax ops
        over an additive mask bias, made on first use."""

        def __init__(self, positions: Tensor, mask: Tensor, sliding: tuple[int, ...], window: int,
                     kernels: DenseAttentionKernels | None):
            self.positions, self.mask, self.sliding, self.window, self.kernels = positions, mask, sliding, window, kernels
            self.biases: dict[bool, Tensor] = {}

        def get_query_positions(self, _total: Any) -> Tensor:
            return self.positions  # [b * n]: row-major, each row 0..n-1 (right padding)

        def bias(self, windowed: bool) -> Tensor:
            """[b, 1, 1, n, n]: 0 where query q may see key k, float32's lowest where not."""
            if windowed not in self.biases:
                window = self.window

                def mask_bias(m: te.Tensor) -> te.Tensor:
                    def at(i, _h, _g, q, k):
                        seen = m[i, k] != 0
                        if windowed:
                            seen = tirx.all(seen, q - k < window, k - q < window)
                        return tirx.Select(seen, tirx.const(0.0, "float32"), tirx.const(LOWEST, "float32"))

                    name = "sliding_mask_bias" if windowed else "mask_bias"
                    return te.compute((m.shape[0], 1, 1, m.shape[1], m.shape[1]), at, name=name)

                self.biases[windowed] = op.tensor_expr_op(mask_bias, "sliding_mask_bias" if windowed else "mask_bias",
                                                          [self.mask])
            return self.biases[windowed]

        def attention_with_fused_qkv(self, layer_id: int, qkv: Tensor, hq: int, sm_scale: float) -> Tensor:
            b, n, heads, d = qkv.shape
            hkv = (heads - hq) // 2
            group = hq // hkv  # query head j*group + r reads kv head j (transformers' repeat_kv)
            windowed = layer_id in self.sliding
            fused = attend(self.kernels, qkv, self.mask, hq, hkv, sm_scale, self.window if windowed else 0)
            if fused is not None:  # one CPU kernel (schedules/cpu/encoder_attention.py)
                return fused
            q, k, v = op.split(qkv, [hq, hq + hkv], axis=2)
            q = op.permute_dims(op.reshape(q, (b, n, hkv, group, d)), [0, 2, 3, 1, 4])  # [b, hkv, g, n, d]
            kt = op.permute_dims(op.reshape(k, (b, n, hkv, 1, d)), [0, 2, 3, 4, 1])  # [b, hkv, 1, d, n]
            v = op.permute_dims(op.reshape(v, (b, n, hkv, 1, d)), [0, 2, 3, 1, 4])  # [b, hkv, 1, n, d]
            scores = op.matmul(q, kt, out_dtype="float32") * sm_scale + self.bias(windowed)  # [b, hkv, g, n, n]
            probs = op.softmax(scores, axis=-1)
            if probs.dtype != v.dtype:
                probs = probs.astype(v.dtype)
            ctx = op.matmul(probs, v, out_dtype="float32")  # [b, hkv, g, n, d]
            if ctx.dtype != qkv.dtype:
                ctx = ctx.astype(qkv.dtype)
            return op.reshape(op.permute_dims(ctx, [0, 3, 1, 2, 4]), (b, n, hq, d))

    class GemmaEncoder(nn.Module, UsesDenseAttention):
        def __init__(self, c: ModelConfig, dtype: str):
            self.config, self.dtype = c, dtype
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList([DecoderLayer(c, dtype, {}, f"layers.{i}.", i)
                                         for i in range(c.num_hidden_layers)])
            self.norm = rms_norm(c, c.hidden_size, dtype)

        def encode(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
            c = self.config
            window = c.sliding_window

            def positions(ids: te.Tensor) -> te.Tensor:
                b, n = ids.shape
                return te.compute((b * n,), lambda i: tirx.floormod(i, n).astype("int32"), name="encoder_positions")

            pos = op.tensor_expr_op(positions, "encoder_positions", [input_ids])
            attention = DenseAttention(pos, attention_mask, c.sliding_layers if window else (), window,
                                       self.dense_attention_kernels)
            h = self.embed_tokens(input_ids)
            h = h * Tensor.from_scalar(c.hidden_size**0.5, h.dtype)  # Gemma: scaled in the embedding dtype
            h, unflatten = flatten_rows(self.dense_attention_kernels, h, c.num_attention_heads,
                                        c.num_key_value_heads, c.head_dim)
            for i, layer in enumerate(self.layers):
                h = layer(h, attention, i)
            h = self.norm(unflatten(h))
            return h if h.dtype == "float32" else h.astype("float32")

        def get_default_spec(self) -> dict:
            return encode_spec()

    return GemmaEncoder


FAMILY = ModelFamily(name="gemma3_embed", architectures=ARCHITECTURES, normalize=normalize, module=module,
                     weights=WEIGHTS, gguf_architecture=None, task="embed", default_pooling="mean")
