"""A batch's token bitmasks, filled at once: the grammar rows' masks are computed on llguidance's
Rust threads in one call (llguidance.numpy.fill_next_token_bitmask_par with one process-wide
LLExecutor), the other bitmask sources' by their own fill_bitmask.

Two users:
- the device sampler (runtime/sampling/device.py) needs the whole batch's [b, W] int32 mask to
  upload: fill_batch_bitmask;
- the host sampler (runtime/sampling/host.py sample_batch) masks row by row with each processor's
  apply(); prefill_grammars computes the masks of every grammar in the batch first, in one
  parallel call, and hands each GrammarProcessor its words (set_prefilled), so its apply() does
  not compute them one request after another.

A grammar here is an object with GrammarProcessor's mask surface: `matcher` (an llguidance
LLMatcher), `num_words`, `check()`, `has_current_words()`, `current_words()` and
`set_prefilled(words)`.
A wrapper that applies a grammar only some of the time (sampling/reasoning_gate.py's
ReasoningGate) names the grammar in force as `active_grammar` (None: none now).

Masks are packed as logits_processors.py describes: bit j of int32 word i allows token 32*i + j.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

_EXECUTOR: Any = None
_EXECUTOR_LOCK = threading.Lock()


def executor() -> Any:
    """The process's llguidance.LLExecutor: one thread per usable core (up to 32). The
    caller's thread only waits during a fill (llguidance drops the GIL), so every core may
    compute masks; llguidance's own default (80% of the cores) is one thread on two."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            import llguidance

            try:
                cores = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):  # not Linux
                cores = os.cpu_count() or 1
            _EXECUTOR = llguidance.LLExecutor(max(1, min(32, cores)))
        return _EXECUTOR


def grammar_of(processor: Any) -> Any | None:
    """The grammar whose mask `processor` applies now, if it is one this module computes in
    parallel (a GrammarProcessor, or a wrapper's active_grammar), else None."""
    for _ in range(4):  # wrappers of wrappers, boundedly
        if processor is None:
            return None
        if hasattr(processor, "matcher") and hasattr(processor, "set_prefilled"):
            return processor
        if not hasattr(processor, "active_grammar"):
            return None
        processor = processor.active_grammar
    return None


def _compute(grammars: Sequence[Any]) -> None:
    """Bring every grammar's words up to its current state: those that hold them already are
    left alone, the others are computed in one parallel call.

    Except when they are all copies of one compiled grammar (requests of one schema, sharing
    GrammarProcessor.compiled): copies share llguidance's lexer state, and many threads
    filling copies of a single grammar are slower than one thread filling them in turn, so
    they compute their own one after another. Measured on the H200 machine's 16 cores,
    SmolLM2's vocabulary, 32 tool-call JSON schemas at spread states, in turn / at once:
    32 requests of one schema 3.0-3.6 / 4.4-4.6 ms; 4 schemas x 8 requests 2.5-3.2 /
    1.9-2.1 ms; 32 distinct schemas 2.6-3.6 / 1.3-1.4 ms. On 2 cores all of these are about
    2 ms either way."""
    todo = list({id(g): g for g in grammars if not g.has_current_words()}.values())
    for g in todo:
        g.check()  # a matcher in an error state: the GrammarError apply() would raise
    if len({id(getattr(g, "compiled", g)) for g in todo}) < 2:
        for g in todo:
            g.current_words()
        return
    from llguidance.numpy import fill_next_token_bitmask_par

    by_width: dict[int, list[Any]] = {}
    for g in todo:
        by_width.setdefault(g.num_words, []).append(g)
    for width, group in by_width.items():
        words = np.empty((len(group), width), np.int32)
        fill_next_token_bitmask_par(executor(), [(g.matcher, k) for k, g in enumerate(group)], words)
        for k, g in enumerate(group):
            g.set_prefilled(words[k])


def prefill_grammars(rows: Sequence[Sequence[Any]], minimum: int = 2) -> int:
    """For the host sampler: the masks of the grammars among these rows' processors, computed
    together when at least `minimum` of them need computing (fewer: each computes its own in
    apply(), as before). Returns how many grammars were computed here."""
    grammars = [g for row in rows for p in row if (g := grammar_of(p)) is not None]
    need = len({id(g) for g in grammars if not g.has_current_words()})
    if need < minimum:
        return 0
    _compute(grammars)
    return need


def fill_batch_bitmask(rows: Sequence[Sequence[Any]], words: np.ndarray) -> None:
    """words (int32 [b, W], C-contiguous, W = ceil(V / 32)): row i becomes the AND of the masks
    of rows[i]'s processors, each a BitmaskSource (fill_bitmask); a row with none allows
    every token (-1). The grammars' masks are computed in one parallel call. A grammar whose
    vocabulary is narrower than W allows no token past it; one wider is cut to W words."""
    if words.dtype != np.int32 or words.ndim != 2 or not words.flags["C_CONTIGUOUS"] \
            or words.shape[0] != len(rows):
        raise ValueError(f"fill_batch_bitmask: words must be C-contiguous int32 [{len(rows)}, W], "
                         f"got {words.dtype} {words.shape}")
    width = words.shape[1]
    words.fill(-1)
    found = [[(p, grammar_of(p)) for p in row] for row in rows]
    _compute([g for row in found for _, g in row if g is not None])
    scratch = None
    for i, row in enumerate(found):
        for processor, grammar in row:
            if grammar is not None:
                m = min(width, grammar.num_words)
                words[i, :m] &= grammar.current_words()[:m]
                words[i, m:] = 0
                continue
            if scratch is None:
                scratch = np.empty(width, np.int32)
            scratch.fill(0)
            processor.fill_bitmask(scratch)
            words[i] &= scratch
