"""BERT encoders (BertModel: all-MiniLM-L6-v2, bge-small, e5-small ...): an embedding model.

An encoder, not a decoder: no KV cache, bidirectional attention over the whole input with a
padding mask, so one call takes a padded batch of whole sequences. What the hidden states
become (mean / CLS / last-token pooling, Dense layers, normalization) is the checkpoint's
sentence-transformers configuration, applied on the host (runtime/engine/pooling.py): the compiled
library stops at the last layer's hidden states, so any pooling fits it.

config   normalize below: the ModelConfig fields a BERT has (q/k/v/o and the MLP carry biases;
         `rms_norm_eps` holds the LayerNorm epsilon, config.json's layer_norm_eps; no RoPE:
         learned absolute positions). Refused by name: position_embedding_type other than
         "absolute", hidden_act other than "gelu" (erf), a `bert.` prefixed (BertFor*) layout.
module   BertEncoder below, post-LN layers:
           h = LN(word[ids] + position[0..n) + token_type[0])
           h = LN(h + O(attention(QKV h, mask)));  h = LN(h + W2 gelu(W1 h))
         q|k|v fused into one projection (concat_rows of the checkpoint's three).
weights  BERT_WEIGHTS: the checkpoint's own names; token_type_embeddings binds its row 0 only
         (transform first_row: one segment, as sentence embedding models are run).
GGUF     none (llama.cpp's "bert" files are not read).

Entry point (the runtime calls it by name; the manifest lists it and says task "embed"):
  encode(input_ids[b, n] int32, attention_mask[b, n] int32) -> hidden[b, n, H] float32
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from vtool.models.config import ConfigError, ModelConfig, _positive_float, _positive_int
from vtool.models.dense_attention import UsesDenseAttention, attend, flatten_rows
from vtool.models.encoder_spec import encode_spec
from vtool.models.family import ModelFamily
from vtool.models.weights import WeightPlan, plan_parameters

ARCHITECTURES = ("BertModel",)
# q|k|v fused: compiled module (suffix) -> the checkpoint's projections, stacked by rows.
BERT_FUSED = {"attention.self.qkv": ("attention.self.query", "attention.self.key", "attention.self.value")}
TOKEN_TYPE = "embeddings.token_type_embeddings.weight"


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    hidden = _positive_int(cfg, "hidden_size")
    heads = _positive_int(cfg, "num_attention_heads")
    if hidden % heads:
        raise ConfigError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    act = cfg.get("hidden_act") or "gelu"
    if act != "gelu":
        raise ConfigError(f"hidden_act {act!r} is not supported for {arch}; supported: gelu (erf)")
    pos = cfg.get("position_embedding_type") or "absolute"
    if pos != "absolute":
        raise ConfigError(f"position_embedding_type {pos!r} is not supported for {arch}; supported: absolute")
    _positive_int(cfg, "type_vocab_size", cfg.get("type_vocab_size", 2))
    return ModelConfig(
        architecture=arch,
        vocab_size=_positive_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size"),
        num_hidden_layers=_positive_int(cfg, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        rms_norm_eps=_positive_float(cfg, "layer_norm_eps", 1e-12),  # LayerNorm's epsilon (module docstring)
        rope_theta=10000.0,  # unused: learned absolute positions
        rope_scaling=None,
        tie_word_embeddings=False,
        max_position_embeddings=_positive_int(cfg, "max_position_embeddings", cfg.get("max_position_embeddings", 512)),
        attention_bias=True,
        qk_norm=False,
    )


# --- weights -------------------------------------------------------------------------------------

def _parameters(named_params: Iterable[tuple[str, Any]], formats: Mapping[str, str] | None = None
                ) -> list[dict[str, Any]]:
    plan = plan_parameters(named_params, formats, fused_sources=BERT_FUSED)
    for entry in plan:
        if entry["name"] == TOKEN_TYPE:
            entry["transform"] = "first_row"
    return plan


def _source_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (c.vocab_size, h),
        "embeddings.position_embeddings.weight": (c.max_position_embeddings, h),
        "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,),
    }
    for n in range(c.num_hidden_layers):
        p = f"encoder.layer.{n}."
        for name in ("query", "key", "value"):
            shapes[f"{p}attention.self.{name}.weight"] = (h, h)
            shapes[f"{p}attention.self.{name}.bias"] = (h,)
        shapes[p + "attention.output.dense.weight"] = (h, h)
        shapes[p + "intermediate.dense.weight"] = (i, h)
        shapes[p + "output.dense.weight"] = (h, i)
        for name, rows in (("attention.output.dense", h), ("intermediate.dense", i), ("output.dense", h)):
            shapes[f"{p}{name}.bias"] = (rows,)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[f"{p}{norm}.weight"] = (h,)
            shapes[f"{p}{norm}.bias"] = (h,)
    return shapes


def _modules(_c: ModelConfig) -> dict[str, tuple[str, ...]]:
    return {}  # no weight is kept in quantized blocks (no quantized encoder kernels)


BERT_WEIGHTS = WeightPlan(parameters=_parameters, source_shapes=_source_shapes, modules=_modules)


# --- the module ----------------------------------------------------------------------------------

def module(c: ModelConfig, dtype: str, target: Any, formats: Mapping[str, str] | None = None, **_int8: Any) -> Any:
    """The encoder; quantized formats are refused (there are no quantized encoder kernels)."""
    if formats:
        raise ConfigError(f"{c.architecture}: weights kept in quantized blocks are not supported for encoders; "
                          "use --quantization none")
    return _encoder_class()(c, dtype)


def _encoder_class() -> type:
    """BertEncoder, defined on first use: TVM is imported only when a build exports the module."""
    from tvm import te, tirx
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import Tensor, op

    from vtool.models.decoder import Linear  # float32 accumulation whatever the weight dtype
    from vtool.models.layer_norm import LayerNorm  # bfloat16 normalized in float32

    def layer_norm(c: ModelConfig, dtype: str) -> Any:
        return LayerNorm(c.hidden_size, eps=c.rms_norm_eps, elementwise_affine=True, dtype=dtype)

    class Embeddings(nn.Module):
        def __init__(self, c: ModelConfig, dtype: str):
            self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
            self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size, dtype=dtype)
            self.token_type_embeddings = nn.Embedding(1, c.hidden_size, dtype=dtype)  # segment 0 only
            self.LayerNorm = layer_norm(c, dtype)

        def forward(self, input_ids: Tensor) -> Tensor:
            words = self.word_embeddings(input_ids)  # [b, n, H]

            def add_positions(w: te.Tensor, pos: te.Tensor, seg: te.Tensor) -> te.Tensor:
                return te.compute(w.shape, lambda i, s, k: w[i, s, k] + pos[s, k] + seg[0, k], name="bert_positions")

            h = op.tensor_expr_op(add_positions, "bert_positions",
                                  [words, self.position_embeddings.weight, self.token_type_embeddings.weight])
            return self.LayerNorm(h)

    class SelfAttention(nn.Module):
        def __init__(self, c: ModelConfig, dtype: str):
            self.qkv = Linear(c.hidden_size, 3 * c.hidden_size, True, dtype)

    class AttentionOutput(nn.Module):
        def __init__(self, c: ModelConfig, dtype: str):
            self.dense = Linear(c.hidden_size, c.hidden_size, True, dtype)
            self.LayerNorm = layer_norm(c, dtype)

    class Attention(nn.Module, UsesDenseAttention):
        def __init__(self, c: ModelConfig, dtype: str):
            self.self = SelfAttention(c, dtype)
            self.output = AttentionOutput(c, dtype)
            self.heads, self.head_dim = c.num_attention_heads, c.head_dim

        def forward(self, h: Tensor, mask: Tensor, bias: Callable[[], Tensor]) -> Tensor:
            b, n, hidden = h.shape  # [1, rows, H] where the encoder flattened its rows for the kernel
            projected = self.self.qkv(h)  # [b, n, 3 * hidden]: q heads, k heads, v heads
            fused = attend(self.dense_attention_kernels, op.reshape(projected, (b, n, 3 * self.heads, self.head_dim)),
                           mask, self.heads, self.heads, self.head_dim ** -0.5)
            if fused is not None:  # one CPU kernel (schedules/cpu/encoder_attention.py)
                return self.output.LayerNorm(h + self.output.dense(op.reshape(fused, (b, n, hidden))))
            qkv = op.reshape(projected, (b, n, 3, self.heads, self.head_dim))
            q, k, v = (op.squeeze(t, axis=2) for t in op.split(qkv, 3, axis=2))  # [b, n, heads, d]
            q = op.permute_dims(q, [0, 2, 1, 3])  # [b, heads, n, d]
            kt = op.permute_dims(k, [0, 2, 3, 1])  # [b, heads, d, n]
            v = op.permute_dims(v, [0, 2, 1, 3])
            scores = op.matmul(q, kt, out_dtype="float32") * (self.head_dim ** -0.5) + bias()  # [b, heads, n, n]
            probs = op.softmax(scores, axis=-1)
            if probs.dtype != v.dtype:
                probs = probs.astype(v.dtype)
            ctx = op.matmul(probs, v, out_dtype="float32")  # [b, heads, n, d]
            if ctx.dtype != h.dtype:
                ctx = ctx.astype(h.dtype)
            ctx = op.reshape(op.permute_dims(ctx, [0, 2, 1, 3]), (b, n, hidden))
            return self.output.LayerNorm(h + self.output.dense(ctx))

    class Intermediate(nn.Module):
        def __init__(self, c: ModelConfig, dtype: str):
            self.dense = Linear(c.hidden_size, c.intermediate_size, True, dtype)

    class Output(nn.Module):
        def __init__(self, c: ModelConfig, dtype: str):
            self.dense = Linear(c.intermediate_size, c.hidden_size, True, dtype)
            self.LayerNorm = layer_norm(c, dtype)

    class Layer(nn.Module):
        def __init__(self, c: ModelConfig, dtype: str):
            self.attention = Attention(c, dtype)
            self.intermediate = Intermediate(c, dtype)
            self.output = Output(c, dtype)

        def forward(self, h: Tensor, mask: Tensor, bias: Callable[[], Tensor]) -> Tensor:
            h = self.attention(h, mask, bias)
            return self.output.LayerNorm(h + self.output.dense(op.gelu(self.intermediate.dense(h))))

    class Encoder(nn.Module):
        def __init__(self, c: ModelConfig, dtype: str):
            self.layer = nn.ModuleList([Layer(c, dtype) for _ in range(c.num_hidden_layers)])

    class BertEncoder(nn.Module, UsesDenseAttention):
        def __init__(self, c: ModelConfig, dtype: str):
            self.config, self.dtype = c, dtype
            self.embeddings = Embeddings(c, dtype)
            self.encoder = Encoder(c, dtype)

        def encode(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
            def mask_bias(m: te.Tensor) -> te.Tensor:
                # [b, 1, 1, n]: 0 where a key is a token, float32's lowest where it is padding (as transformers)
                low = tirx.const(-3.4028234663852886e38, "float32")
                return te.compute((m.shape[0], 1, 1, m.shape[1]),
                                  lambda i, _h, _q, j: tirx.Select(m[i, j] != 0, tirx.const(0.0, "float32"), low),
                                  name="bert_mask_bias")

            made: list[Tensor] = []

            def bias() -> Tensor:  # made on first use: a build whose layers all take the kernel has none
                if not made:
                    made.append(op.tensor_expr_op(mask_bias, "bert_mask_bias", [attention_mask]))
                return made[0]

            c = self.config
            h, unflatten = flatten_rows(self.dense_attention_kernels, self.embeddings(input_ids),
                                        c.num_attention_heads, c.num_attention_heads, c.head_dim)
            for layer in self.encoder.layer:
                h = layer(h, attention_mask, bias)
            h = unflatten(h)
            return h if h.dtype == "float32" else h.astype("float32")

        def get_default_spec(self) -> dict:
            return encode_spec()

    return BertEncoder


FAMILY = ModelFamily(name="bert", architectures=ARCHITECTURES, normalize=normalize, module=module,
                     weights=BERT_WEIGHTS, gguf_architecture=None, task="embed", default_pooling="cls")
