"""A loaded model ready to generate: compiled library, bound weights, tokenizer, chat
template and stop ids. The CLI, the Python API and the server all start from here."""
from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Any, Callable

from vtool import VtoolError
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.artifact.heap import release_free_heap
from vtool.runtime.weights.checkpoint import Checkpoint, open_checkpoint
from vtool.runtime.engine.generate import Generator
from vtool.runtime.engine.spec_config import SpeculativeConfig
from vtool.runtime.text.stop_ids import stop_token_ids
from vtool.runtime.text.tokenizer import Tokenizer
from vtool.runtime.artifact.manifest import artifact_config

DEFAULT_MAX_MODEL_LEN = 4096  # cap on the context when the model allows more; --max-model-len raises it


@dataclasses.dataclass
class Session:
    checkpoint: Checkpoint
    model: CompiledModel
    tokenizer: Tokenizer
    stop_ids: list[int]
    max_model_len: int
    generator: Generator

    @property
    def task(self) -> str:
        """"generate" (a decoder) or "embed" (an embedding model: runtime/engine/embed.py)."""
        return self.model.manifest.get("task", "generate")

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def open_draft(self, config: SpeculativeConfig, max_model_len: int) -> Session:
        """The draft model of --speculative-config (built already: with_draft_built), opened on the
        same device for an engine that speculates with it."""
        if not config.draft_artifact or not config.draft_path:
            raise VtoolError("--speculative-config: the draft model was not built (with_draft_built resolves "
                             "\"model\" to a compiled artifact before the engine starts)")
        checkpoint = open_checkpoint(Path(config.draft_path))
        return open_session(Path(config.draft_artifact), checkpoint, max_model_len=max_model_len)

    def encode_prompt(self, text: str, chat: bool = False) -> list[int]:
        if chat:
            # The template already writes BOS and the role markers; don't add them twice.
            return self.tokenizer.encode(self.render_chat([{"role": "user", "content": text}]),
                                         add_special_tokens=False)
        return self.tokenizer.encode(text, add_special_tokens=True)


def load_tokenizer(checkpoint: Checkpoint, tokenizer_config: str | Path | None) -> Tokenizer:
    if checkpoint.format == "gguf":
        return Tokenizer.from_gguf(checkpoint.path)
    return Tokenizer.from_dir(checkpoint.path, tokenizer_config)


def open_session(artifact: Path, checkpoint: Checkpoint, tokenizer_config: str | Path | None = None,
                 max_model_len: int | None = None,
                 progress: Callable[[int, int], None] | None = None) -> Session:
    # The tokenizer first: building it takes transient memory that is given back before the
    # weights (the bulk of what stays resident) are bound, so the two peaks do not add up.
    tokenizer = load_tokenizer(checkpoint, tokenizer_config)
    release_free_heap()  # what building it freed stays in glibc's heap otherwise, under the weights
    model = CompiledModel(artifact, checkpoint, progress)
    limit = model.manifest["config"]["max_position_embeddings"]
    why = "the model's max_position_embeddings"
    if model.manifest.get("task") == "embed":  # as vLLM: sentence_bert_config.json's max_seq_length caps it
        from vtool.runtime.engine.pooling import sentence_max_seq_length

        seq = sentence_max_seq_length(checkpoint.path)
        if seq is not None and seq < limit:
            limit, why = seq, "max_seq_length in the model's sentence_bert_config.json"
    if max_model_len is None:
        max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN)
    elif not 0 < max_model_len <= limit:
        raise VtoolError(f"--max-model-len {max_model_len} is outside 1..{limit} ({why})")
    stops = stop_token_ids(artifact_config(checkpoint.config(), model.manifest), checkpoint.generation_config())
    session = Session(checkpoint, model, tokenizer, stops, max_model_len, Generator(model, max_model_len))
    # What is loaded now lives as long as the process: keep the cyclic collector from walking it
    # again on every full collection (2.6-5% of a CPU decode step's profile samples).
    gc.collect()
    gc.freeze()
    release_free_heap()
    return session


DraftBuilder = Callable[[Path, str, str], Path]  # (weights, dtype, quantization) -> artifact folder


def with_draft_built(config: SpeculativeConfig | None, target_dtype: str,
                     build: DraftBuilder | None) -> SpeculativeConfig | None:
    """The config with its draft model resolved to weights and a compiled artifact (built for
    the target's device; dtype "auto" takes the target's), so an engine can open it."""
    if config is None or config.method != "draft_model" or config.draft_path:
        return config
    from vtool.runtime.weights.hub import resolve_model_path

    path = resolve_model_path(config.model, config.revision)
    if config.draft_artifact:
        from vtool.runtime.artifact.archive import open_artifact

        return config.resolved(str(open_artifact(Path(config.draft_artifact))), str(path))
    if build is None:
        raise VtoolError("--speculative-config: this vtool is the runtime only (no compiler): give the draft's "
                         "prebuilt artifact as \"artifact\"")
    dtype = target_dtype if config.dtype == "auto" else config.dtype
    return config.resolved(str(build(path, dtype, config.quantization)), str(path))
