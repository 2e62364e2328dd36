"""GPT-2 (GPT2LMHeadModel): learned absolute position embeddings, pre-LN blocks with LayerNorm
(weight and bias), q|k|v fused in one projection (c_attn), GELU with the tanh approximation
("gelu_new"), a bias on every linear layer, the lm_head tied to the token embedding.

config   normalize() below: GPT-2's own keys (n_embd, n_layer, n_head, n_inner, n_positions,
         layer_norm_epsilon, activation_function), or the generic names GPT2Config aliases them to
         (hidden_size, ...); ModelConfig.rms_norm_eps carries LayerNorm's epsilon and
         max_position_embeddings n_positions (the runtime caps --max-model-len to it, so a
         longer prompt is refused, never wrapped); rope_theta is unused (there is no RoPE)
module   models/gpt2_model.py GPT2LMHeadModel: its own nn.Module with models/decoder.py's entry points and
         spec; the paged KV cache with RopeMode.NONE, wpe[positions] added to the input embeds
         with the positions the KV cache holds for the sequences of this step
weights  GPT2_WEIGHTS: parameters named as the HF tensors; HF's Conv1D stores its matrices as
         [in, out], bound through the "transpose" transform into Linear's [out, in]. No weight
         stays in GGUF blocks (the quantized builds refuse the family by name)
GGUF     llama.cpp's "gpt2" (token_embd, position_embd, attn_norm/ffn_norm with bias, attn_qkv,
         attn_output, ffn_up, ffn_down, output_norm); its converter stores the Conv1D matrices
         transposed, and runtime/weights/gguf_reader.py turns them back into HF's layout
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from vtool.models.config import ConfigError, ModelConfig, _positive_float, _positive_int
from vtool.models.family import ModelFamily
from vtool.models.weights import WeightPlan

# GELU's tanh approximation under the names transformers gives it; the exact GELU is refused
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
# Conv1D modules ([in, out] weights in HF), as suffixes of their module paths
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# GPT-2 key -> the generic name GPT2Config aliases it to (its attribute_map)
_ALIASES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
            "n_positions": "max_position_embeddings", "n_inner": "intermediate_size"}


def _get(cfg: dict[str, Any], key: str) -> Any:
    value = cfg.get(key)
    return cfg.get(_ALIASES[key]) if value is None and key in _ALIASES else value


def normalize(cfg: dict[str, Any], arch: str) -> ModelConfig:
    vals = {key: _get(cfg, key) for key in ("n_embd", "n_layer", "n_head", "n_positions")}
    hidden, layers, heads, positions = (_positive_int(vals, key) for key in vals)
    if hidden % heads:
        raise ConfigError(f"n_embd={hidden} is not a multiple of n_head={heads}")
    kv_heads = cfg.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise ConfigError(f"num_key_value_heads={kv_heads}: GPT-2 attention has as many key/value heads as "
                          f"query heads ({heads})")
    head_dim = cfg.get("head_dim") or hidden // heads
    if head_dim != hidden // heads:
        raise ConfigError(f"head_dim={head_dim}: GPT-2's heads are n_embd / n_head = {hidden // heads} wide")
    inner = _get(cfg, "n_inner")
    inner = 4 * hidden if inner is None else _positive_int({"n_inner": inner}, "n_inner")
    act = cfg.get("activation_function", cfg.get("hidden_act")) or "gelu_new"
    if act not in ACTIVATIONS:
        raise ConfigError(f"activation_function {act!r} is not supported; supported: {', '.join(ACTIVATIONS)} "
                          "(GELU's tanh approximation)")
    refused = {"scale_attn_by_inverse_layer_idx": True, "add_cross_attention": True, "scale_attn_weights": False}
    for key, bad in refused.items():
        if cfg.get(key) is bad:
            raise ConfigError(f"config field {key}={bad} is not supported by the GPT-2 family")
    eps = cfg.get("layer_norm_epsilon", cfg.get("rms_norm_eps", 1e-5))
    return ModelConfig(
        architecture=arch,
        vocab_size=_positive_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=inner,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        rms_norm_eps=_positive_float({"layer_norm_epsilon": eps}, "layer_norm_epsilon", 1e-5),  # LayerNorm's
        rope_theta=10000.0,  # unused: no RoPE
        rope_scaling=None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        max_position_embeddings=positions,
        attention_bias=True,
        qk_norm=False,
    )


# --- weights -------------------------------------------------------------------------------------

def _parameters(named_params: Iterable[tuple[str, Any]], formats: Mapping[str, str] | None = None
                ) -> list[dict[str, Any]]:
    if formats:
        raise ConfigError(f"the GPT-2 family keeps no weight in quantized blocks (asked for {sorted(formats)})")
    plan = []
    for name, param in named_params:
        module, leaf = name.rsplit(".", 1)
        conv1d = leaf == "weight" and module.endswith(CONV1D)
        plan.append({"name": name, "shape": [int(x) for x in param.shape], "dtype": str(param.dtype),
                     "transform": "transpose" if conv1d else "identity", "sources": [name]})
    return plan


def _source_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (c.vocab_size, h), "transformer.wpe.weight": (c.max_position_embeddings, h),
        "transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for n in range(c.num_hidden_layers):
        p = f"transformer.h.{n}."
        for norm in ("ln_1", "ln_2"):
            shapes[f"{p}{norm}.weight"] = shapes[f"{p}{norm}.bias"] = (h,)
        for module, (rows, cols) in (("attn.c_attn", (h, 3 * h)), ("attn.c_proj", (h, h)), ("mlp.c_fc", (h, i)),
                                     ("mlp.c_proj", (i, h))):
            shapes[f"{p}{module}.weight"] = (rows, cols)  # Conv1D: [in, out]
            shapes[f"{p}{module}.bias"] = (cols,)
    return shapes


def _modules(_c: ModelConfig) -> dict[str, tuple[str, ...]]:
    return {}  # no weight may stay in blocks


GPT2_WEIGHTS = WeightPlan(parameters=_parameters, source_shapes=_source_shapes, modules=_modules)


def module(c: ModelConfig, dtype: str, target: Any, formats: Mapping[str, str] | None = None, **_int8: Any) -> Any:
    """The GPT-2 module; `int8` (activations, kernels) has nothing to act on: no weight is kept in blocks."""
    if formats:
        raise ConfigError(f"the GPT-2 family keeps no weight in quantized blocks (asked for {sorted(formats)})")
    from vtool.models.gpt2_model import GPT2LMHeadModel  # TVM: only when a build exports the module

    return GPT2LMHeadModel(c, dtype, target)


FAMILY = ModelFamily(name="gpt2", architectures=("GPT2LMHeadModel",), normalize=normalize, module=module,
                     weights=GPT2_WEIGHTS, gguf_architecture="gpt2")
