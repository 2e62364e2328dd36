"""--speculative-config: vLLM's JSON object, read and checked once at startup.

Two proposers run here: "ngram" (prompt lookup: the continuation of the latest earlier
occurrence of the sequence's last n tokens) and a draft model ("model": a folder or GGUF
sharing the target's vocabulary). Methods that need a trained head on the target's hidden
states (EAGLE, EAGLE-3, MTP, Medusa) are refused by name: nothing here loads such a head.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from vtool import VtoolError

# vLLM's ngram defaults when neither bound is given.
NGRAM_DEFAULT_LOOKUP = 5
# Speculation pays while a step is bound by reading the weights; past this many running
# sequences the batch itself keeps the device busy and rejected drafts are wasted work
# (vLLM's disable_by_batch_size, which vLLM leaves unset; measured in docs/BENCHMARKS.md).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# A draft model on a GPU speculates for a request alone only: with two or more running, each
# draft token is an engine step of the draft and the target verifies over the paged cache,
# which lost to plain decode on an H100 (the Qwen2.5-Coder pair served to 4 and 8 users: 0.77x
# and 0.85x of no speculation), while a request alone ran 1.73x (session 39, docs/BENCHMARKS.md).
GPU_DRAFT_DISABLE_BY_BATCH_SIZE = 2

_HEAD_METHODS = {
    "eagle": "an EAGLE draft head",
    "eagle3": "an EAGLE-3 draft head",
    "mtp": "the checkpoint's multi-token-prediction layers",
    "deepseek_mtp": "the checkpoint's multi-token-prediction layers",
    "medusa": "Medusa heads",
    "mlp_speculator": "an MLP speculator head",
}
# vtool's own keys: "artifact", the draft's prebuilt artifact, for installs without the compiler;
# "own_caches", whether a greedy round may run on the libraries' own caches (uses_own_caches).
_KEYS = {"artifact", "own_caches", "method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size", "quantization", "dtype", "revision", "draft_tensor_parallel_size",
         "max_model_len"}
_DRAFT_DTYPES = ("auto", "float32", "float16", "bfloat16")
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft_model"
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0
    model: str | None = None  # draft_model: a folder, .gguf file or hub id
    revision: str | None = None
    dtype: str = "auto"  # the draft's; auto: the target's
    quantization: str = "auto"
    disable_by_batch_size: int | None = None  # None: batch_size_limit's rule
    max_model_len: int | None = None
    # Filled by whoever builds the draft (the CLI / LLM): the compiled draft's folder and
    # its weights' path, so an engine in another process opens it without compiling.
    draft_artifact: str | None = None
    draft_path: str | None = None
    # Libraries built with --draft-cache-len: None (auto) uses their own caches on a GPU only,
    # True on any device, False never (uses_own_caches).
    own_caches: bool | None = None

    def resolved(self, draft_artifact: str, draft_path: str) -> SpeculativeConfig:
        return dataclasses.replace(self, draft_artifact=draft_artifact, draft_path=draft_path)


def uses_own_caches(config: SpeculativeConfig, model: Any) -> bool:
    """Whether speculation may draft (and, with a target built alike, verify) through a library's
    own cache (engine/draft_chain.py, engine/lone_chain.py). Auto: on a GPU, where one captured
    call a token beats an engine step (1.34x / 1.59x against 1.02x on an H100); not on the CPU,
    where the engine's way measured faster (the Qwen2.5-Coder pair on a 2-core Xeon: 0.98x through
    the engine, 0.68x drafting through the draft's cache, 0.33x with the target's too:
    chain_verify's eight rows and its serial attention cost 4-7 decode steps there;
    docs/BENCHMARKS.md)."""
    return config.own_caches if config.own_caches is not None else bool(getattr(model, "on_gpu", False))


def batch_size_limit(config: SpeculativeConfig, model: Any) -> int:
    """The running batch at which steps go without drafts: what the config says, else 2 for a
    draft model on a GPU (only a request alone pays there) and 8 otherwise (n-gram lookup, and
    a draft model on the CPU, where the draft's step costs a fraction of the target's)."""
    if config.disable_by_batch_size is not None:
        return config.disable_by_batch_size
    if config.method == "draft_model" and getattr(model, "on_gpu", False):
        return GPU_DRAFT_DISABLE_BY_BATCH_SIZE
    return DEFAULT_DISABLE_BY_BATCH_SIZE


# toolchain/plan.py DRAFT_CACHE_AUTO (not imported: the runtime never loads the compiler): the
# target and the draft of a draft-model pair are built with their own caches where those pay
PAIR_DRAFT_CACHE = -1


def pair_cache_len(config: SpeculativeConfig | None) -> int:
    """The draft_cache_len a speculative pair's libraries are built with (by run, serve, bench and
    LLM): PAIR_DRAFT_CACHE (CUDA targets get caches, toolchain/plan.py) for a draft model whose
    "own_caches" is not false; 0 otherwise."""
    if config is None or config.method != "draft_model" or config.own_caches is False:
        return 0
    return PAIR_DRAFT_CACHE


def _int(value: Any, key: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise VtoolError(f"--speculative-config: {key} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise VtoolError(f"--speculative-config: {key} must be {bound}, got {value}")
    return value


def parse_speculative_config(raw: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """The checked config, or None for no speculation. Every refusal names the key."""
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as err:
            raise VtoolError(f"--speculative-config is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise VtoolError(f"--speculative-config must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise VtoolError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(_KEYS))}")
    method = raw.get("method")
    if method is not None and not isinstance(method, str):
        raise VtoolError(f"--speculative-config: method must be a string, got {method!r}")
    if method in ("[ngram]",):
        method = "ngram"
    if method is None:
        if raw.get("model") is None:
            raise VtoolError('--speculative-config needs "method" ("ngram") or a draft "model"')
        method = "draft_model"
    if method in _HEAD_METHODS:
        raise VtoolError(f"--speculative-config: method {method!r} needs {_HEAD_METHODS[method]} run on the "
                         "target's hidden states, which vtool cannot load yet; use \"ngram\" or a draft \"model\"")
    if method not in ("ngram", "draft_model"):
        raise VtoolError(f"--speculative-config: method {method!r} is not one of ngram, draft_model "
                         f"(refused by name: {', '.join(sorted(_HEAD_METHODS))})")
    if "num_speculative_tokens" not in raw:
        raise VtoolError("--speculative-config: num_speculative_tokens is required")
    k = _int(raw["num_speculative_tokens"], "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    tp = raw.get("draft_tensor_parallel_size", 1)
    if tp is not None and _int(tp, "draft_tensor_parallel_size", 1) != 1:
        raise VtoolError("--speculative-config: draft_tensor_parallel_size must be 1 (vtool runs one device)")
    disable = raw.get("disable_by_batch_size")
    disable = None if disable is None else _int(disable, "disable_by_batch_size", 1)
    max_len = raw.get("max_model_len")
    max_len = None if max_len is None else _int(max_len, "max_model_len", 1)
    if method == "ngram":
        for key in ("model", "quantization", "dtype", "revision", "artifact", "own_caches"):
            if raw.get(key) is not None:
                raise VtoolError(f"--speculative-config: {key} belongs to a draft model, not method \"ngram\"")
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = NGRAM_DEFAULT_LOOKUP
        lo = _int(lo if lo is not None else hi, "prompt_lookup_min", 1)
        hi = _int(hi if hi is not None else lo, "prompt_lookup_max", 1)
        if lo > hi:
            raise VtoolError(f"--speculative-config: prompt_lookup_min {lo} is above prompt_lookup_max {hi}")
        return SpeculativeConfig("ngram", k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                                 disable_by_batch_size=disable, max_model_len=max_len)
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if raw.get(key) is not None:
            raise VtoolError(f"--speculative-config: {key} belongs to method \"ngram\", not a draft model")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise VtoolError(f"--speculative-config: a draft model needs \"model\" (a folder, .gguf file or hub id), "
                         f"got {model!r}")
    dtype = raw.get("dtype") or "auto"
    if dtype not in _DRAFT_DTYPES:
        raise VtoolError(f"--speculative-config: dtype {dtype!r} is not one of {', '.join(_DRAFT_DTYPES)}")
    quantization = raw.get("quantization") or "auto"
    if not isinstance(quantization, str):
        raise VtoolError(f"--speculative-config: quantization must be a string, got {quantization!r}")
    revision = raw.get("revision")
    if revision is not None and not isinstance(revision, str):
        raise VtoolError(f"--speculative-config: revision must be a string, got {revision!r}")
    artifact = raw.get("artifact")
    if artifact is not None and not isinstance(artifact, str):
        raise VtoolError(f"--speculative-config: artifact must be a path, got {artifact!r}")
    own = raw.get("own_caches")
    if own == "auto":
        own = None
    if own is not None and not isinstance(own, bool):
        raise VtoolError(f"--speculative-config: own_caches must be true, false or \"auto\", got {own!r}")
    return SpeculativeConfig("draft_model", k, model=model, revision=revision, dtype=dtype,
                             quantization=quantization, disable_by_batch_size=disable, max_model_len=max_len,
                             draft_artifact=artifact, own_caches=own)
