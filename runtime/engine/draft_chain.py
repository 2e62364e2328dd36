"""Greedy drafts from a draft library's own cache: `draft_extend` and `draft_step` (a library built
with `vtool build --draft-cache-len N`; the compiled side is models/draft_chain.py), and a target
library's verification over a cache of its own (`chain_verify`, same build option).

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
from typing import Callable

import numpy as np

from vtool.runtime.artifact.draft_state import (FORCED, NUM_FORCED, OUT, POSITION, STEP, V_POSITION,
                                                V_TOKENS)
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.artifact.tvm_runtime import global_func

EXTEND_ENTRY = "draft_extend"
STEP_ENTRY = "draft_step"
VERIFY_ENTRY = "chain_verify"


def has_draft_chain(model: CompiledModel) -> bool:
    return "draft_chain" in model.manifest and model.has_function(STEP_ENTRY) and model.has_function(EXTEND_ENTRY)


def has_chain_verify(model: CompiledModel) -> bool:
    return has_draft_chain(model) and model.has_function(VERIFY_ENTRY) and "max_verify" in model.manifest["draft_chain"]


class _Slot:
    """The device buffers of one role's cache on one library, and which tokens they hold."""

    def __init__(self, model: CompiledModel, state_len: int):
        shape = tuple(model.manifest["draft_chain"]["cache_shape"])
        zeros = np.zeros(shape, dtype=np.float32 if model.dtype == "float32" else np.uint16)  # the bytes of 0.0
        self.k, self.v = model.upload(zeros, dtype=model.dtype), model.upload(zeros, dtype=model.dtype)
        self.state = model.upload(np.zeros(state_len, dtype=np.int32))
        self.owner: str | None = None
        self.tokens: list[int] = []  # the tokens whose keys and values the cache holds, in order


def _slot(model: CompiledModel, role: str, state_len: int) -> _Slot:
    """One slot per (library, role) for the library's whole life: a CUDA build captures draft_step
    and chain_verify with their state and caches as fixed inputs, so the graph holds the addresses
    of the first tensors it ran on, and every later call must pass those same tensors (a second
    set would leave the graph writing into freed memory)."""
    slots = model.__dict__.setdefault("_chain_slots", {})
    if role not in slots:
        slots[role] = _Slot(model, state_len)
    return slots[role]


class _ChainCache:
    """A library's own cache (K and V of one sequence), the request whose tokens it holds, and
    the common-prefix bookkeeping both sides of a round share. Objects of one role on one library
    share their slot (see _slot)."""

    def __init__(self, model: CompiledModel, state_len: int, role: str):
        info = model.manifest["draft_chain"]
        self.model = model
        self.cache_len: int = info["cache_len"]
        self._slot = _slot(model, role, state_len)
        self._k, self._v, self._state = self._slot.k, self._slot.v, self._slot.state
        self._state_len = state_len
        self._extend = model.function(EXTEND_ENTRY)

    @property
    def owner(self) -> str | None:
        return self._slot.owner

    @owner.setter
    def owner(self, value: str | None) -> None:
        self._slot.owner = value

    @property
    def tokens(self) -> list[int]:
        return self._slot.tokens

    @tokens.setter
    def tokens(self, value: list[int]) -> None:
        self._slot.tokens = value

    def release(self, request_id: str) -> None:
        """The request is done. What the cache holds stays: the next request reuses the prefix it
        shares (a chat's earlier turns, a common system prompt)."""
        if self.owner == request_id:
            self.owner = None

    def _sync(self, request_id: str, ids: list[int], keep_last: int) -> int:
        """Bring the cache to hold ids[:common] with common >= len(ids) - keep_last: the tokens it
        lacks beyond the last keep_last go in through draft_extend. Returns common. Any request
        starts from the prefix it shares with what the cache holds, whoever put it there."""
        self.owner = request_id
        m = len(ids)
        common, limit = 0, min(len(self.tokens), m - 1)
        while common < limit and self.tokens[common] == ids[common]:
            common += 1
        # what the calls below write over is no longer held, should one of them fail
        self.tokens = self.tokens[:common]
        if m - common > keep_last:  # a prompt, or a longer gap: its keys and values in one call
            m_ = self.model
            self._extend(m_.upload(np.asarray(ids[common:m - keep_last], dtype=np.int32)),
                         m_.upload(np.asarray([common], dtype=np.int32)), self._k, self._v, m_.params)
            common = m - keep_last
            self.tokens = list(ids[:common])
        return common

    def _write_state(self, state: np.ndarray) -> None:
        # into the same tensor every round (TVMTensorCopyFromBytes waits for the copy, and the
        # stream's earlier steps, which read the old state, come first)
        global_func("runtime.TVMTensorCopyFromBytes")(self._state, ctypes.c_void_p(state.ctypes.data), state.nbytes)


class DraftChain(_ChainCache):
    """The draft cache of one library, and the request whose tokens it holds."""

    def __init__(self, model: CompiledModel):
        info = model.manifest["draft_chain"]
        super().__init__(model, info["state_len"], "draft")
        self.max_steps: int = info["max_steps"]
        self.max_forced: int = info["max_forced"]
        self._step = model.function(STEP_ENTRY)

    def fits(self, num_tokens: int, k: int) -> bool:
        """Whether a sequence of num_tokens tokens can draw k drafts here."""
        return 0 < k <= self.max_steps - self.max_forced + 1 and num_tokens >= 1 and \
            num_tokens + k <= self.cache_len

    def propose(self, request_id: str, ids: list[int], k: int) -> list[int]:
        """k greedy drafts following `ids` (the request's prompt and output so far)."""
        if not self.fits(len(ids), k):
            raise ValueError(f"the draft cache ({self.cache_len} positions) cannot take {len(ids)} tokens "
                             f"and {k} drafts")
        m = len(ids)
        common = self._sync(request_id, ids, self.max_forced)  # at most max_forced tokens left to feed
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


class ChainVerifier(_ChainCache):
    """A target library's own cache (built with --draft-cache-len): chain_verify scores a round's
    drafts for one greedy sequence in one call (captured whole on CUDA), no paged cache involved."""

    def __init__(self, model: CompiledModel):
        info = model.manifest["draft_chain"]
        super().__init__(model, info["verify_state_len"], "verify")
        self.max_verify: int = info["max_verify"]
        self._verify = model.function(VERIFY_ENTRY)

    def fits(self, num_tokens: int, k: int) -> bool:
        """Whether a sequence of num_tokens tokens can have k drafts scored here."""
        return 0 <= k < self.max_verify and num_tokens >= 1 and num_tokens - 1 + self.max_verify <= self.cache_len

    def verify(self, request_id: str, ids: list[int], drafts: list[int]) -> list[int]:
        """The target's greedy token after ids and after each of ids + drafts[:i]: len(drafts) + 1
        tokens (the first mismatch with the drafts, or the one past them all, ends the round)."""
        k = len(drafts)
        if not self.fits(len(ids), k):
            raise ValueError(f"the target's chain cache ({self.cache_len} positions, {self.max_verify} rows) "
                             f"cannot take {len(ids)} tokens and {k} drafts")
        m = len(ids)
        # rows: the tokens the cache lacks (as many as the rows leave room for), then the drafts
        common = self._sync(request_id, ids, self.max_verify - k)
        rows = ids[common:] + list(drafts)
        state = np.zeros(self._state_len, dtype=np.int32)
        state[V_POSITION] = common
        state[V_TOKENS:V_TOKENS + len(rows)] = rows
        self._write_state(state)
        out = self.model.to_numpy(self._verify(self._state, self._k, self._v, self.model.params))
        # every row's keys and values were written (the padding's too, past the tokens: written over later)
        self.tokens = list(ids) + list(drafts)
        return [int(t) for t in out[m - 1 - common:m - common + k]]


def chain_round(target: ChainVerifier, draft: DraftChain, request_id: str, ids: list[int],
                k: int) -> tuple[list[int], int]:
    """One round of greedy speculation after `ids`: the draft proposes up to k tokens (none when
    k is 0 or its cache cannot take them), the target scores them in one chain_verify call and
    keeps the longest prefix it agrees with plus its own next token. Returns (the new tokens,
    the number of drafts proposed); len(new) - 1 of them were accepted."""
    drafts = draft.propose(request_id, ids, k) if k > 0 and draft.fits(len(ids), k) else []
    if not target.fits(len(ids), len(drafts)):
        raise ValueError(f"the chain caches cannot take {len(ids)} tokens and {len(drafts)} drafts")
    greedy = target.verify(request_id, ids, drafts)
    kept = 0
    while kept < len(drafts) and drafts[kept] == greedy[kept]:
        kept += 1
    return drafts[:kept] + [greedy[kept]], len(drafts)


def chain_generate(target: ChainVerifier, draft: DraftChain, prompt: list[int], max_tokens: int, k: int,
                   stop_ids: frozenset[int] = frozenset(), request_id: str = "chain",
                   on_tokens: Callable[[list[int]], None] | None = None) -> tuple[list[int], dict]:
    """Greedy speculative decoding of one sequence with both caches on the device, chain_round
    after chain_round. The tokens are the target's greedy decode (up to and including a stop id);
    on_tokens sees each round's. Returns (tokens, {"rounds", "drafted", "accepted"})."""
    ids, out = list(prompt), []
    stats = {"rounds": 0, "drafted": 0, "accepted": 0}
    while len(out) < max_tokens:
        new, drafted = chain_round(target, draft, request_id, ids, min(k, max_tokens - len(out) - 1))
        stats["rounds"] += 1
        stats["drafted"] += drafted
        stats["accepted"] += len(new) - 1
        done = False
        for i, t in enumerate(new):
            if t in stop_ids or len(out) + i + 1 >= max_tokens:
                new, done = new[:i + 1], True
                break
        out.extend(new)
        ids.extend(new)
        if on_tokens is not None:
            on_tokens(new)
        if done:
            break
    return out, stats
