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

# rope_type values the paged KV cache can apply (tvm.relax.frontend.nn.llm.position_embedding)
SUPPORTED_ROPE_TYPES = ("default", "llama3")


# Every config.json key the parser reads. The build records their values in the manifest,
# and the runtime compares them with the checkpoint it is given, key by key.
CONFIG_KEYS = (
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "tie_word_embeddings", "max_position_embeddings",
    "attention_bias", "hidden_act", "sliding_window",
)


def source_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return {key: cfg.get(key) for key in CONFIG_KEYS}


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

    @property
    def family(self) -> str:
        """The family's name (models/registry.py)."""
        from vtool.models.registry import model_family  # the registry imports this module

        return model_family(self.architecture).name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """A stable hash of everything that changes the compiled program."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return cls(**d)


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
    or transformers-5 `rope_parameters`."""
    params = _dict_or_none(cfg, "rope_parameters") or {}
    scaling = _dict_or_none(cfg, "rope_scaling")
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = dict(params)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "default":
            scaling = None
        else:
            scaling["rope_type"] = rope_type
            scaling.pop("type", None)
            for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if key not in scaling:
                    raise ConfigError(f"llama3 rope scaling is missing {key!r}")
                scaling[key] = _positive_float(scaling, key, 0.0)
            if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
                raise ConfigError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
    return _positive_float({"rope_theta": theta}, "rope_theta", 10000.0), scaling


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
    )
