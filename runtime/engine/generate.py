"""One-sequence generation over a compiled model: chunked prefill, then decode steps.

This is what `vtool run` drives; the batching engine builds on the same entry points
(batch_prefill / batch_decode) and the same KV-state protocol.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable

import numpy as np

from vtool import VtoolError
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.sampling.host import SequenceSampler, sample_batch
from vtool.runtime.artifact.tvm_runtime import global_func
from vtool.runtime.engine.kv_blocks import blocks_for_window
from vtool.runtime.engine.kv_cache import (SLIDING_CACHE, frees_window, frees_window_by_default, sliding_window,
                                          window_kept)
from vtool.runtime.engine.validation import RequestLimits
from vtool.runtime.sampling.params import SamplingParams, check_token_ids

PAGE_SIZE = 16
PREFILL_CHUNK = 512
# On a GPU a prompt goes in larger chunks: each forward has a fixed cost there (a model whose
# weights stay in GGUF blocks dequantizes all of them once per prompt forward), and 2048
# positions of activations are small beside the weights.
GPU_PREFILL_CHUNK = 2048


@dataclasses.dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prefill_seconds: float
    decode_seconds: float

    @property
    def decode_tokens_per_second(self) -> float:
        steps = len(self.token_ids) - 1  # the first token comes from prefill
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0


class Generator:
    """Owns one KV cache with a single sequence slot; reused across calls."""

    SEQ_ID = 0

    def __init__(self, model: CompiledModel, max_model_len: int, free_window: bool | None = None):
        """free_window: on a model whose every layer is windowed, the cache that frees the
        pages outside the window (kv_cache.py sliding_window); None: where its kernels are
        vtool's parallel ones (frees_window_by_default), as EngineConfig.kv_window_freeing."""
        self.model = model
        self.max_model_len = max_model_len
        self._kv = None
        self._kv_capacity = 0
        self._begin = global_func("vm.builtin.kv_state_begin_forward")
        self._end = global_func("vm.builtin.kv_state_end_forward")
        self._add = global_func("vm.builtin.kv_state_add_sequence")
        self._remove = global_func("vm.builtin.kv_state_remove_sequence")
        self.window = sliding_window(model)  # a sliding-window model takes at most this per step (kv_cache.py)
        # every layer windowed: the cache that frees what the window passed (nothing here pops or forks)
        frees = frees_window_by_default(model) if free_window is None else free_window and frees_window(model)
        self.kept = window_kept(model) if frees else 0
        self._enable_window = global_func("vm.builtin.attention_kv_cache_enable_sliding_window_for_seq")

    @property
    def chunk(self) -> int:
        """Tokens fed per prefill call: PREFILL_CHUNK (GPU_PREFILL_CHUNK on a GPU), or the
        sliding window when smaller."""
        chunk = GPU_PREFILL_CHUNK if self.model.on_gpu else PREFILL_CHUNK
        return min(chunk, self.window or chunk)

    def _fresh_sequence(self, tokens_needed: int) -> None:
        """A KV cache with room for `tokens_needed`, holding one empty sequence."""
        capacity = -(-tokens_needed // PAGE_SIZE) * PAGE_SIZE
        if self.kept:  # the sequence never holds more (TVM adds 2 pages per sequence too)
            capacity = min(capacity, blocks_for_window(self.kept, PAGE_SIZE) * PAGE_SIZE)
        if self._kv is None or capacity > self._kv_capacity:
            shape = self.model.ffi.Shape
            sizes = [shape([1]), shape([capacity]), shape([max(self.chunk, PREFILL_CHUNK)]), shape([PAGE_SIZE])]
            self._kv = self.model.function(SLIDING_CACHE)(*sizes) if self.kept else \
                self.model.function("create_tir_paged_kv_cache")(*sizes, shape([0]))
            self._kv_capacity = capacity
        else:
            self._remove(self._kv, self.SEQ_ID)
        self._add(self._kv, self.SEQ_ID)
        if self.kept:
            self._enable_window(self._kv, self.SEQ_ID, self.kept, 0)

    def _embed(self, ids: list[int]) -> object:
        """Token embeddings as a [1, n, hidden] tensor on the model's device (a view: no copy
        through the host)."""
        m = self.model
        array = np.asarray(ids, dtype=np.int64)
        check_token_ids(array, m.vocab_size)
        flat = m.function("embed")(m.upload(array.astype(np.int32), slot="ids"), m.params)
        return global_func("runtime.TVMTensorCreateView")(flat, m.ffi.Shape([1, len(ids), m.hidden_size]), m.dtype, 0)

    def _forward(self, entry: str, ids: list[int]) -> np.ndarray:
        m = self.model
        embeds = self._embed(ids)
        self._begin(self._kv, m.ffi.Shape([self.SEQ_ID]), m.ffi.Shape([len(ids)]))
        logits, _ = m.function(entry)(embeds, self._kv, m.params)
        self._end(self._kv)
        return m.to_numpy(logits).reshape(-1, m.vocab_size)[-1].copy()

    def prompt_logits(self, prompt_ids: list[int]) -> np.ndarray:
        """Logits at every prompt position ([n, vocab]), for prompt logprobs and parity checks.
        Starts a fresh sequence; the prompt must fit in one prefill chunk (a sliding-window
        model's prompt is fed in chunks of its window)."""
        if not 0 < len(prompt_ids) <= PREFILL_CHUNK:
            raise VtoolError(f"prompt_logits takes 1..{PREFILL_CHUNK} tokens, got {len(prompt_ids)}")
        m = self.model
        self._fresh_sequence(len(prompt_ids))
        out = []
        for start in range(0, len(prompt_ids), self.chunk):
            chunk = prompt_ids[start:start + self.chunk]
            embeds = self._embed(chunk)
            positions = m.upload(np.arange(len(chunk), dtype=np.int32), slot="positions")
            self._begin(self._kv, m.ffi.Shape([self.SEQ_ID]), m.ffi.Shape([len(chunk)]))
            logits, _ = m.function("batch_prefill")(embeds, positions, self._kv, m.params)
            self._end(self._kv)
            out.append(m.to_numpy(logits).reshape(len(chunk), m.vocab_size).copy())
        return np.concatenate(out)

    def prefill_logits(self, prompt_ids: list[int]) -> np.ndarray:
        """Logits after the last prompt token, the prompt fed in chunks the KV cache accepts."""
        logits = None
        for start in range(0, len(prompt_ids), self.chunk):
            logits = self._forward("prefill", prompt_ids[start:start + self.chunk])
        assert logits is not None
        return logits

    def generate(self, prompt_ids: list[int], params: SamplingParams, stop_ids: Iterable[int] = (),
                 on_token: Callable[[int], None] | None = None,
                 on_logits: Callable[[np.ndarray], None] | None = None) -> GenerationResult:
        """Run one sequence to a stop id or params.max_tokens (None or <= 0: to the context)."""
        # `vtool run` semantics: a max_tokens past the context is cut to it, not refused.
        max_tokens = RequestLimits(self.model.vocab_size, self.max_model_len).check_request(
            prompt_ids, params, strict=False)
        sampler = SequenceSampler(params, prompt_ids, tuple(stop_ids), self.model.vocab_size)
        self._fresh_sequence(len(prompt_ids) + max_tokens)

        t0 = time.perf_counter()
        logits = self.prefill_logits(prompt_ids)
        prefill_seconds = time.perf_counter() - t0
        tokens: list[int] = []
        finish = "length"
        t1 = time.perf_counter()
        while True:
            if on_logits:
                on_logits(logits)
            token = sample_batch(logits[None, :], [sampler])[0].token_id
            tokens.append(token)
            if on_token:
                on_token(token)
            if sampler.is_stop_token(token):
                finish = "stop"
                break
            if len(tokens) >= max_tokens:
                break
            logits = self._forward("decode", [token])
        decode_seconds = time.perf_counter() - t1
        return GenerationResult(list(prompt_ids), tokens, finish, prefill_seconds, decode_seconds)
