"""`from vtool import LLM, SamplingParams`: vLLM's offline API, building the model on first use."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.runtime.weights.default_model import default_model_path
from vtool.runtime.weights.hub import resolve_model_path
from vtool.runtime.engine.engine import EngineConfig
from vtool.runtime.engine.offline import OfflineLLM
from vtool.runtime.engine.spec_config import pair_cache_len, parse_speculative_config
from vtool.runtime.session import open_session, with_draft_built
from vtool.toolchain.build import build_artifact


class LLM(OfflineLLM):
    """LLM(model=None) uses the embedded default model (SmolLM2-135M-Instruct). `model` is a local
    folder or .gguf file, or a Hugging Face hub id (org/name, at `revision`; see hub.py)."""

    def __init__(self, model: str | Path | None = None, target: str = "host", dtype: str = "float32",
                 max_model_len: int | None = None, tokenizer_config: str | Path | None = None,
                 revision: str | None = None, speculative_config: dict[str, Any] | str | None = None,
                 **engine_kwargs: Any):
        path = resolve_model_path(str(model), revision) if model else default_model_path()
        checkpoint = open_checkpoint(path)
        spec = parse_speculative_config(speculative_config)  # refused before anything is built
        # a draft model's pair gets its own caches where they pay (plan.py DRAFT_CACHE_AUTO)
        pair = pair_cache_len(spec)
        if spec is not None:
            # vLLM's LLM(speculative_config={...}); a draft model is built for the same target
            engine_kwargs["speculative"] = with_draft_built(
                spec, dtype, lambda draft, draft_dtype, quantization: build_artifact(
                    draft, target, draft_dtype, quantization=quantization, draft_cache_len=pair))
        artifact = build_artifact(path, target, dtype, checkpoint=checkpoint, draft_cache_len=pair)
        session = open_session(artifact, checkpoint, tokenizer_config, max_model_len)
        super().__init__(session, EngineConfig(**engine_kwargs))
