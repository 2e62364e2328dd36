"""One normalized ModelConfig for every supported decoder family.

Input is a Hugging Face config.json dict (the GGUF reader in vtool.runtime turns GGUF
metadata into the same shape). parse_hf_config picks the family by its architecture
(models/registry.py) and the family normalizes the dict, most of it with parse_decoder here,
so there is one parser and one set of refusals.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

from vtool import VtoolError

# rope_type values vtool applies: default and llama3 in the paged KV cache
# (tvm.relax.frontend.nn.llm.position_embedding), linear and yarn in the model (models/rope.py)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")


# Every config.json key the parser reads. The build records their values in the manifest,
# and the runtime compares them with the checkpoint it is given, key by key.
CONFIG_KEYS = (
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "tie_word_embeddings", "max_position_embeddings",
    "attention_bias", "hidden_act", "sliding_window",
    # encoders (models/bert.py)
    "layer_norm_eps", "type_vocab_size", "position_embedding_type",
)


# The mixture-of-experts keys (models/moe_weights.py), recorded only when the config has them, so a dense
# model's source config (and its build key) is what it was before MoE families existed.
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                   "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size")


# GPT-2's own config.json keys (models/gpt2.py), recorded only when the config has them, like the MoE keys.
GPT2_CONFIG_KEYS = ("n_embd", "n_layer", "n_head", "n_inner", "n_positions", "layer_norm_epsilon",
                    "activation_function", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
                    "add_cross_attention")


# Gemma's keys (models/gemma.py), recorded only for Gemma architectures, so that other families'
# source configs (and build keys) stay what they were (transformers 5 gives Qwen2 layer_types too)
GEMMA_CONFIG_KEYS = ("query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "layer_types",
                     "sliding_window_pattern", "rope_local_base_freq", "hidden_activation",
                     "use_bidirectional_attention")


def source_config(cfg: dict[str, Any]) -> dict[str, Any]:
    gemma = any(str(a).startswith("Gemma") for a in cfg.get("architectures") or [])
    return {key: cfg.get(key) for key in CONFIG_KEYS} | {key: cfg[key] for key in MOE_CONFIG_KEYS if key in cfg} \
        | {key: cfg[key] for key in GPT2_CONFIG_KEYS if key in cfg} \
        | ({key: cfg.get(key) for key in GEMMA_CONFIG_KEYS} if gemma else {}) \
        | ({key: cfg.get(key) for key in ("use_sliding_window", "max_window_layers", "layer_types")}
           if cfg.get("use_sliding_window") else {}) \
        | _family_keys(cfg)  # (Qwen2's real sliding window above: models/qwen2.py)


def _family_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """OLMo-3's layer pattern, the top-level original context (Phi-3's longrope, any yarn) and a
    top-level partial_rotary_factor, recorded for those only, so that other models' source
    configs (and build cache keys) stay what they were."""
    archs = set(cfg.get("architectures") or [])
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    longrope, yarn = kind in ("longrope", "su"), kind == "yarn"  # yarn: the top-level value wins (_yarn)
    return ({"layer_types": cfg.get("layer_types")} if "Olmo3ForCausalLM" in archs else {}) \
        | ({"original_max_position_embeddings": cfg.get("original_max_position_embeddings")}
           if ("Phi3ForCausalLM" in archs and longrope) or yarn else {}) \
        | ({"partial_rotary_factor": cfg["partial_rotary_factor"]} if "partial_rotary_factor" in cfg else {})


class ConfigError(VtoolError):
    """A config that vtool cannot build, naming the offending field."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on each q and k head before RoPE (Qwen3)
    # q and k normalized over all their heads at once, one weight of heads x head_dim (OLMo-2)
    qk_norm_full: bool = False
    # norms after attention and after the MLP, on their outputs before the residual add, and
    # none before them (OLMo-2); False: Llama's norms before each
    post_norms: bool = False
    # mixture of experts (models/moe.py; 0 experts: every layer's MLP is dense). Experts of
    # moe_intermediate_size, num_experts_per_tok chosen per token by a softmax router, their
    # weights renormalized to sum 1 when norm_topk_prob; mlp_only_layers keep a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    # --- Gemma-2/3 hooks (models/gemma.py); left out of to_dict() at their defaults (_GEMMA_FIELDS),
    # so the other families' digests do not change.
    # norms before AND after attention and the MLP (input, post_attention, pre_feedforward,
    # post_feedforward); the after-norms act on each block's output before the residual add
    sandwich_norms: bool = False
    # RMSNorms scale by (1 + w), computed in float32 (models/decoder.py PlusOneRMSNorm)
    norm_plus_one: bool = False
    mlp_act: str = "silu"  # the gate's activation: "silu" or "gelu_tanh"
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the embedding dtype
    attn_scale: float = 0.0  # the softmax scale; 0: head_dim ** -0.5
    final_logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0: none
    # attention scores s = cap * tanh(s / cap), s = q.k * attn_scale, before the mask and softmax, in every
    # attention kernel of the KV cache (models/softcap.py); 0: none (Gemma-2's attn_logit_softcapping)
    attn_logit_softcap: float = 0.0
    sliding_window: int = 0  # the window of the layers in sliding_layers; 0: none
    sliding_layers: tuple[int, ...] = ()  # the layers that attend over the last sliding_window tokens only
    # RoPE applied by the model instead of the KV cache: the cache has one theta, Gemma-3 two
    # (rope_local_theta on the sliding layers; 0: rope_theta), and rope_scaling may be linear
    model_rope: bool = False
    rope_local_theta: float = 0.0
    # the leading head dims that RoPE rotates (partial_rotary_factor, Phi-4-mini's 0.75); 0: all of them
    rotary_dim: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))  # from_dict gives a list
        object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.mlp_only_layers

    @property
    def family(self) -> str:
        """The family's name (models/registry.py)."""
        from vtool.models.registry import model_family  # the registry imports this module

        return model_family(self.architecture).name

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not self.num_experts:  # a dense model's dict (and digest) as before MoE families existed
            for key in _MOE_FIELDS:
                d.pop(key)
        for key, default in _GEMMA_FIELDS.items():
            if d[key] == default:
                del d[key]
        return d

    def digest(self) -> str:
        """A stable hash of everything that changes the compiled program."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return cls(**d)


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers")
# the Gemma hooks -> their defaults, at which to_dict() leaves them out
_GEMMA_FIELDS = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                 if f.name in ("sandwich_norms", "norm_plus_one", "mlp_act", "embed_scale", "attn_scale",
                               "final_logit_softcap", "attn_logit_softcap", "sliding_window", "sliding_layers", "model_rope",
                               "rope_local_theta", "rotary_dim")}


def _require(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"config is missing required field {key!r}")
    return cfg[key]


def _positive_int(cfg: dict[str, Any], key: str, value: Any | None = None) -> int:
    v = _require(cfg, key) if value is None else value
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"config field {key!r} must be a positive integer, got {v!r}")
    return v


def _dict_or_none(cfg: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = cfg.get(key)
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"config field {key!r} must be an object, got {value!r}")
    return value or None


def _positive_float(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"config field {key!r} must be a positive number, got {value!r}")
    return float(value)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and scaling from either transformers-4 keys (rope_theta, rope_scaling)
    or transformers-5 `rope_parameters`: llama3 (applied by the KV cache), linear and yarn
    (applied by the model: models/rope.py), normalized with transformers' defaults."""
    params = _dict_or_none(cfg, "rope_parameters") or {}
    scaling = _dict_or_none(cfg, "rope_scaling")
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = dict(params)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
        rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type == "dynamic":
            raise ConfigError("rope scaling type 'dynamic' (dynamic NTK) is not supported: its frequencies change "
                              "with the sequence's length, so keys cached at one length would not match queries "
                              f"at another; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        scaling.pop("type", None)
        if rope_type == "default":
            scaling = None
        elif rope_type == "llama3":
            scaling["rope_type"] = rope_type
            for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if key not in scaling:
                    raise ConfigError(f"llama3 rope scaling is missing {key!r}")
                scaling[key] = _positive_float(scaling, key, 0.0)
            if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
                raise ConfigError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
        elif rope_type == "linear":
            if "factor" not in scaling:
                raise ConfigError("linear rope scaling is missing 'factor'")
            scaling = {"rope_type": "linear", "factor": _positive_float(scaling, "factor", 0.0)}
        else:
            scaling = _yarn(scaling, cfg)
    return _positive_float({"rope_theta": theta}, "rope_theta", 10000.0), scaling


def _yarn(scaling: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """YaRN's parameters with transformers' defaults (_compute_yarn_parameters): the original
    context from config.json's top level, else the scaling dict, else max_position_embeddings;
    a missing factor is max_position_embeddings / original (DeepSeek-V3's configs); beta_fast 32,
    beta_slow 1; truncate True. The attention factor is resolved here (models/rope.py applies it)."""
    unknown = set(scaling) - {"rope_type", "factor", "original_max_position_embeddings", "attention_factor",
                              "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}
    if unknown:
        raise ConfigError(f"yarn rope scaling has fields vtool does not apply: {', '.join(sorted(unknown))}")
    max_pos = cfg.get("max_position_embeddings", 2048)
    # config.json's top-level original context first, as transformers' standardize_rope_params
    original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings") \
        or max_pos
    original = _positive_float({"original_max_position_embeddings": original}, "original_max_position_embeddings", 0)
    factor = scaling.get("factor")
    factor = _positive_float(scaling, "factor", 0.0) if factor is not None else \
        _positive_float({"max_position_embeddings": max_pos}, "max_position_embeddings", 0) / original
    out: dict[str, Any] = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        out[key] = _positive_float(scaling, key, default) if scaling.get(key) else default  # 0/None: the default
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"yarn rope scaling field 'truncate' must be true or false, got {truncate!r}")
    out["truncate"] = truncate

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("attention_factor") is not None:
        out["attention_factor"] = _positive_float(scaling, "attention_factor", 1.0)
    elif scaling.get("mscale") and scaling.get("mscale_all_dim"):
        out["attention_factor"] = mscale(factor, _positive_float(scaling, "mscale", 1.0)) \
            / mscale(factor, _positive_float(scaling, "mscale_all_dim", 1.0))
    else:
        out["attention_factor"] = mscale(factor)
    return out


def parse_hf_config(cfg: dict[str, Any]) -> ModelConfig:
    """Normalize a transformers config.json dict by its family; refuse what vtool cannot build, by name."""
    from vtool.models.registry import ARCHITECTURES, model_family  # the registry imports this module

    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"config field 'architectures' must be a list of names, got {archs!r}")
    if not archs:
        raise ConfigError("config has no 'architectures' entry; supported: " + ", ".join(ARCHITECTURES))
    arch = archs[0]
    return model_family(arch).normalize(cfg, arch)


def parse_decoder(cfg: dict[str, Any], arch: str, attention_bias: bool | None = None,
                  qk_norm: bool = False) -> ModelConfig:
    """The Llama-style decoder's config (the families' shared normalisation). attention_bias:
    the family's q/k/v always carry a bias (True), or as config.json says (None)."""
    hidden = _positive_int(cfg, "hidden_size")
    heads = _positive_int(cfg, "num_attention_heads")
    kv_heads = _positive_int(cfg, "num_key_value_heads", cfg.get("num_key_value_heads", heads))
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = cfg.get("head_dim") or hidden // heads
    head_dim = _positive_int(cfg, "head_dim", head_dim)
    if head_dim % 2:
        raise ConfigError(f"head_dim={head_dim} must be even for rotary embeddings")
    act = cfg.get("hidden_act") or "silu"
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported; supported: silu")
    theta, scaling = _rope(cfg)
    rotary_dim = _rotary_dim(cfg, head_dim)
    max_pos = _positive_int(cfg, "max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return ModelConfig(
        architecture=arch,
        vocab_size=_positive_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size"),
        num_hidden_layers=_positive_int(cfg, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_positive_float(cfg, "rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=max_pos,
        attention_bias=bool(cfg.get("attention_bias", False)) if attention_bias is None else attention_bias,
        qk_norm=qk_norm,
        # TVM's cache knows llama3 scaling only (and its yarn differs from transformers'), and
        # rotates whole heads
        model_rope=(bool(scaling) and scaling["rope_type"] in ("linear", "yarn")) or rotary_dim < head_dim,
        rotary_dim=rotary_dim if rotary_dim < head_dim else 0,
    )


def _rotary_dim(cfg: dict[str, Any], head_dim: int) -> int:
    """The head dims RoPE rotates: head_dim times partial_rotary_factor (top-level, or in
    transformers-5 rope_parameters), as transformers computes it (int(head_dim * factor))."""
    params = _dict_or_none(cfg, "rope_parameters") or {}
    factor = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor"))
    if factor is None:
        return head_dim
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"config field 'partial_rotary_factor' must be in (0, 1], got {factor!r}")
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2:
        raise ConfigError(f"partial_rotary_factor {factor} rotates {rotary} of head_dim {head_dim} dims; "
                          "RoPE needs an even number of at least 2")
    return rotary
