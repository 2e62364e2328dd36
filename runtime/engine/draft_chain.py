"""Greedy drafts from a draft library's own cache: `draft_extend` and `draft_step` (a library built
with `vtool build --draft-cache-len N`; the compiled side is models/draft_chain.py).

One sequence at a time holds the cache. A round feeds the tokens the cache lacks: the prompt (or
any gap longer than the state's forced slots) through `draft_extend`, then the last one or two
through `draft_step`, which goes on drawing its own argmax; every step reads and writes a state
tensor on the device, so the k steps are queued without waiting, and on CUDA each is one graph
launch. The host reads the drafts once, at the end. The cache keeps every position it was given:
what it holds past the request's tokens (rejected drafts) is simply written over, and a request
that differs earlier (another request) starts over from its common prefix.
"""
from __future__ import annotations

import ctypes
import numpy as np

from vtool.runtime.artifact.draft_state import FORCED, NUM_FORCED, OUT, POSITION, STEP
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.artifact.tvm_runtime import global_func

EXTEND_ENTRY = "draft_extend"
STEP_ENTRY = "draft_step"


def has_draft_chain(model: CompiledModel) -> bool:
    return "draft_chain" in model.manifest and model.has_function(STEP_ENTRY) and model.has_function(EXTEND_ENTRY)


class DraftChain:
    """The draft cache of one library, and the request whose tokens it holds."""

    def __init__(self, model: CompiledModel):
        info = model.manifest["draft_chain"]
        self.model = model
        self.cache_len: int = info["cache_len"]
        self.max_steps: int = info["max_steps"]
        self.max_forced: int = info["max_forced"]
        self._state_len: int = info["state_len"]
        shape = tuple(info["cache_shape"])
        zeros = np.zeros(shape, dtype=np.float32 if model.dtype == "float32" else np.uint16)  # the bytes of 0.0
        self._k, self._v = model.upload(zeros, dtype=model.dtype), model.upload(zeros, dtype=model.dtype)
        # one tensor for the whole run: a CUDA build's graph of draft_step holds its address
        self._state = model.upload(np.zeros(self._state_len, dtype=np.int32))
        self._step, self._extend = model.function(STEP_ENTRY), model.function(EXTEND_ENTRY)
        self.owner: str | None = None
        self.tokens: list[int] = []  # the tokens whose keys and values the cache holds, in order

    def fits(self, num_tokens: int, k: int) -> bool:
        """Whether a sequence of num_tokens tokens can draw k drafts here."""
        return 0 < k <= self.max_steps - self.max_forced + 1 and num_tokens >= 1 and \
            num_tokens + k <= self.cache_len

    def release(self, request_id: str) -> None:
        if self.owner == request_id:
            self.owner, self.tokens = None, []

    def propose(self, request_id: str, ids: list[int], k: int) -> list[int]:
        """k greedy drafts following `ids` (the request's prompt and output so far)."""
        if not self.fits(len(ids), k):
            raise ValueError(f"the draft cache ({self.cache_len} positions) cannot take {len(ids)} tokens "
                             f"and {k} drafts")
        if self.owner != request_id:
            self.owner, self.tokens = request_id, []
        m = len(ids)
        common, limit = 0, min(len(self.tokens), m - 1)
        while common < limit and self.tokens[common] == ids[common]:
            common += 1
        if m - common > self.max_forced:  # a prompt, or a longer gap: its keys and values in one call
            m_ = self.model
            self._extend(m_.upload(np.asarray(ids[common:m - 1], dtype=np.int32)),
                         m_.upload(np.asarray([common], dtype=np.int32)), self._k, self._v, m_.params)
            common = m - 1
        forced = ids[common:m]
        state = np.zeros(self._state_len, dtype=np.int32)
        state[POSITION], state[NUM_FORCED], state[STEP] = common, len(forced), 0
        state[FORCED:FORCED + len(forced)] = forced
        self._write_state(state)
        for _ in range(len(forced) - 1 + k):
            self._step(self._state, self._k, self._v, self.model.params)
        out = self.model.to_numpy(self._state)
        drafts = [int(t) for t in out[OUT + len(forced) - 1:OUT + len(forced) - 1 + k]]
        self.tokens = list(ids) + drafts[:-1]  # the last draft was drawn, never fed
        return drafts

    def _write_state(self, state: np.ndarray) -> None:
        # into the same tensor every round (TVMTensorCopyFromBytes waits for the copy, and the
        # stream's earlier steps, which read the old state, come first)
        global_func("runtime.TVMTensorCopyFromBytes")(self._state, ctypes.c_void_p(state.ctypes.data), state.nbytes)
