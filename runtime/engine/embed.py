"""Embedding over a compiled embedding model (manifest task "embed"): token ids in, vectors out.

The library's `encode(input_ids[b, n], attention_mask[b, n]) -> hidden[b, n, H]` runs a padded
batch of whole sequences in one call (an encoder has no KV cache, so there is nothing to
schedule step by step); runtime/engine/pooling.py turns the hidden states into vectors. Inputs are
sorted by length and cut into batches of at most `max_batch_tokens` padded tokens, so one
long input does not pad a thousand short ones; results come back in the caller's order.

The LLM class (LLM.embed) and the server's /v1/embeddings (serving/embeddings.py) both use
an Embedder; any embedding family whose library has this `encode` plugs in unchanged.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence

import numpy as np

from vtool import VtoolError
from vtool.runtime.engine.pooling import Pooler, load_pooler
from vtool.runtime.artifact.manifest import artifact_config

if TYPE_CHECKING:
    from vtool.runtime.session import Session

ENTRY = "encode"
DEFAULT_MAX_BATCH_TOKENS = 8192  # padded tokens per encode call (memory: b x n x H floats, and b x heads x n x n)
MAX_BATCH_ROWS = 256


class EmbedInputError(VtoolError):
    """An input the model cannot embed (empty, too long, a token id outside the vocabulary)."""

    def __init__(self, message: str, field: str = "input"):
        super().__init__(message)
        self.field = field


class Embedder:
    """Batched embedding with a session's model, tokenizer and the checkpoint's pooling."""

    def __init__(self, session: Session, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS):
        m = session.model
        if session.task != "embed" or not m.has_function(ENTRY):
            raise VtoolError(f"{session.checkpoint.path} is a {session.task!r} model ({m.manifest.get('arch')}): "
                             "embedding needs an embedding model (one whose manifest says task \"embed\")")
        self.model, self.tokenizer = m, session.tokenizer
        self.max_model_len = session.max_model_len
        config = artifact_config(session.checkpoint.config(), m.manifest)
        folder = session.checkpoint.path if session.checkpoint.format == "safetensors" else None
        self.pooler: Pooler = load_pooler(folder, m.hidden_size, m.manifest.get("default_pooling"), config)
        pad = config.get("pad_token_id")
        self.pad_id = pad if isinstance(pad, int) and 0 <= pad < m.vocab_size else 0
        self.max_batch_tokens = max(max_batch_tokens, self.max_model_len)
        self._lock = threading.Lock()  # one encode at a time: the VM is not re-entrant

    @property
    def dim(self) -> int:
        return self.pooler.dim

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check(self, ids: Sequence[int], field: str = "input") -> None:
        """Refuse, with vLLM's words where it has some, an input this model cannot embed."""
        if len(ids) == 0:
            raise EmbedInputError(f"{field}: an input must have at least one token (got an empty one)", field)
        if len(ids) > self.max_model_len:
            raise EmbedInputError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids)} tokens in the input for embedding generation. Please reduce the length of the input.",
                field)
        vocab = self.model.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)  # Python ints: no overflow on huge ones
        if bad is not None:
            raise EmbedInputError(f"{field}: token id {bad} is outside the vocabulary (0..{vocab - 1})", field)

    def embed(self, inputs: Sequence[Sequence[int]], dimensions: int | None = None) -> np.ndarray:
        """[len(inputs), dim (or dimensions)] float32, in order; every input checked first
        (`dimensions`: checked by the caller, Pooler.check_dimensions)."""
        for i, ids in enumerate(inputs):
            self.check(ids, f"input[{i}]" if len(inputs) > 1 else "input")
        return self.pooler.finish(self.pooled(inputs), dimensions)

    def pooled(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """The pooled hidden states [len(inputs), H] of checked inputs, before Dense layers,
        truncation and normalization (Pooler.finish): the server batches several requests'
        inputs through one call and finishes each request apart."""
        pooled = np.empty((len(inputs), self.model.hidden_size), np.float32)
        for group in self._groups([len(ids) for ids in inputs]):
            pooled[group] = self._encode([inputs[i] for i in group])
        return pooled

    def _groups(self, lengths: list[int]) -> list[list[int]]:
        """Indices by length, longest first, in batches of at most max_batch_tokens padded tokens;
        an input shorter than half its batch's width starts a new batch (attention costs the
        width squared per row, so a short text padded to a long one costs as much as the long one)."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        groups: list[list[int]] = []
        for i in order:
            # longest first: a group's width is its first member's length
            if groups and len(groups[-1]) < MAX_BATCH_ROWS and 2 * lengths[i] >= lengths[groups[-1][0]] and \
                    lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= self.max_batch_tokens:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def _encode(self, batch: list[Sequence[int]]) -> np.ndarray:
        """One encode call over a right-padded batch -> pooled [b, H]."""
        width = max(len(ids) for ids in batch)
        ids = np.full((len(batch), width), self.pad_id, np.int32)
        mask = np.zeros((len(batch), width), np.int32)
        for row, seq in enumerate(batch):
            ids[row, :len(seq)] = seq
            mask[row, :len(seq)] = 1
        m = self.model
        with self._lock:
            hidden = m.function(ENTRY)(m.upload(ids), m.upload(mask), m.params)
            pooled = self.pooler.pool(m.to_numpy(hidden), [len(seq) for seq in batch])
        return pooled
