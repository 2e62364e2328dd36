"""Batched decode from CUDA graphs at a few batch sizes, padded up to them (vLLM's
--cuda-graph-sizes).

A CUDA build made with CUDA graph sizes (`vtool build --cuda-graph-sizes`, on by default)
holds `batch_decode_captured` beside `batch_decode`: the same function, whose kernel runs
between KV-cache calls TVM captures into CUDA graphs once per distinct batch size (the size
is the graph's cache key) for sizes up to the largest the build planned memory for
(toolchain/pipeline.py says how). Each size a step runs at costs a capture the first time,
and a graph's memory for good, so a decode step of n sequences runs at the smallest listed
size >= n and the other rows are padding; a step over the largest size, or one the KV cache
has no room to pad, runs the uncaptured `batch_decode` at its own size. One sequence keeps
`decode`, captured at build time.

Padding rows. TVM's paged KV cache wants each row of a decode step to be a sequence that
appends one token, and rows are independent everywhere (matmuls, norms, attention), so a pad
row is a sequence of its own: a reserved id (PAD_SEQ_BASE - i, negative, never one the
scheduler gives out), added to the cache before the step at length 0, appending token
PAD_TOKEN at position 0 (one page, taken from the free pages the real rows leave), and
removed once the step has ended, so between steps the KV state, TVM's and the block mirror's,
is exactly that of the unpadded step. The runner gets a view of the first n rows of the
logits: pad rows never reach a sampler.

The same manifest says whether the library also holds `batch_verify_captured` (speculative
verification captured per token count, not padded; `captured_verify_tokens`, which the model
runner reads).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, Sequence

import numpy as np

from vtool.runtime.artifact.tvm_runtime import global_func
from vtool.runtime.engine.chained_steps import DeviceTokens, fill_token_ids

# The entry points' names, as toolchain/families.py writes them (a test holds them equal).
CAPTURED_ENTRY = "batch_decode_captured"
CAPTURED_VERIFY_ENTRY = "batch_verify_captured"
PAD_SEQ_BASE = -(1 << 40)  # pad row i is KV sequence PAD_SEQ_BASE - i
PAD_TOKEN = 0  # a valid id in any vocabulary; its row's logits are dropped
# VTOOL_ENFORCE_EAGER=1: never run the captured entry (batched decode runs `batch_decode`,
# uncaptured, at its own size; one sequence still runs `decode`, captured at build time).
ENFORCE_EAGER_ENV = "VTOOL_ENFORCE_EAGER"


def captured_verify_tokens(model: Any) -> int:
    """The most tokens a step may hold to run `batch_verify_captured` (one CUDA graph per token
    count, logits at every position), or 0: a library without it (CPU builds, CUDA builds made
    with --cuda-graph-sizes none or before it) or VTOOL_ENFORCE_EAGER=1."""
    manifest = getattr(model, "manifest", {})
    graphs = manifest.get("build", {}).get("pipeline", {}).get("cuda_graph_verify")
    if (not graphs or CAPTURED_VERIFY_ENTRY not in manifest.get("entry_points", ())
            or os.environ.get(ENFORCE_EAGER_ENV, "") not in ("", "0")):
        return 0
    return int(graphs["max_tokens"])


def usable_sizes(built: Sequence[int], max_batch: int) -> tuple[int, ...]:
    """The sizes a runtime pads to: the build's sizes from 2 (one sequence runs `decode`) up
    to the KV cache's max batch (TVM sizes its per-step arrays by it), plus the max batch
    itself where it falls between two built sizes: the graphs are captured per size, so any
    size up to the build's largest works, and a batch between the last usable size and the
    max batch then pads to the max batch rather than running uncaptured."""
    if not built:
        return ()
    sizes = {s for s in built if 2 <= s <= max_batch}
    if 2 <= max_batch < max(built):
        sizes.add(max_batch)
    return tuple(sorted(sizes))


def pick_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest size >= n, or None (n past the largest)."""
    return next((s for s in sorted(sizes) if s >= n), None)


@dataclasses.dataclass(frozen=True)
class PaddingPlan:
    rows: int  # the step's own rows (sequences)
    size: int  # the batch size it runs at
    pad_ids: tuple[int, ...]  # the KV sequences of rows `rows`..`size`-1

    @property
    def pages(self) -> int:
        """KV pages the pad rows hold during the step (one token each, at position 0)."""
        return len(self.pad_ids)


def plan_padding(n: int, sizes: Sequence[int], free_pages: int) -> PaddingPlan | None:
    """How a decode step of n sequences runs padded, or None when it runs unpadded and
    uncaptured: n < 2 (`decode`), n past the largest size, or fewer free pages (after the
    real rows' appends) than pad rows."""
    if n < 2:
        return None
    size = pick_size(n, sizes)
    if size is None or size - n > free_pages:
        return None
    return PaddingPlan(n, size, tuple(PAD_SEQ_BASE - i for i in range(size - n)))


class DecodeBuckets:
    """Runs an all-decode step through the captured entry at a padded size (the model
    runner's hook, runtime/engine/runner.py `_forward`)."""

    def __init__(self, model: Any, kv: Any, sizes: Sequence[int], entry: str = CAPTURED_ENTRY,
                 create_view: Any = None):
        """`entry`: the function run at the padded size (tests pad a CPU build's batch_decode);
        `create_view`: runtime.TVMTensorCreateView unless given."""
        self.model, self.kv, self.sizes = model, kv, tuple(sorted(sizes))
        self._create_view = create_view or global_func("runtime.TVMTensorCreateView")
        self.entry = model.function(entry)

    @classmethod
    def for_model(cls, model: Any, kv: Any) -> DecodeBuckets | None:
        """The padder for a loaded model and its KV cache, or None when there is nothing to
        pad to: a library without the captured entry (CPU builds, CUDA builds made with
        --cuda-graph-sizes none or before it), or VTOOL_ENFORCE_EAGER=1."""
        manifest = getattr(model, "manifest", {})
        graphs = manifest.get("build", {}).get("pipeline", {}).get("cuda_graph_batch")
        if (not graphs or CAPTURED_ENTRY not in manifest.get("entry_points", ())
                or os.environ.get(ENFORCE_EAGER_ENV, "") not in ("", "0")):
            return None
        max_batch = getattr(kv, "max_num_seqs", None) or max(graphs["sizes"])
        sizes = usable_sizes(graphs["sizes"], max_batch)
        return cls(model, kv, sizes) if sizes else None

    def plan(self, seq_ids: Sequence[int]) -> PaddingPlan | None:
        """The padding for a decode step of these sequences, given the pages free now."""
        blocks = self.kv.blocks
        free = blocks.num_free_blocks - sum(blocks.blocks_needed(s, 1) for s in seq_ids)
        return plan_padding(len(seq_ids), self.sizes, free)

    def forward(self, step: Any, device_tokens: DeviceTokens | None = None,
                call: Callable[..., Any] | None = None) -> Any | None:
        """Run an all-decode SchedulerOutput padded: the logits of its own rows ([n, 1, V]
        float32, a view on the device), or None when this step runs unpadded instead (then
        nothing was done). device_tokens: the rows' input tokens are on the device, drawn by
        the step before (a chained step, engine/chained_steps.py). call: how the entry point is
        called, call(graph key, function, *args) (the model runner's call_entry, which may run
        it on the model thread); None calls it here."""
        sequences = step.sequences
        seq_ids = [s.seq_id for s in sequences]
        plan = self.plan(seq_ids)
        if plan is None:
            return None
        m, kv = self.model, self.kv
        tokens = [s.token_ids[0] for s in sequences] + [PAD_TOKEN] * plan.pages
        ids = m.upload(np.asarray(tokens, dtype=np.int32), slot="ids") if device_tokens is None else \
            fill_token_ids(m, tokens, device_tokens, self._create_view)
        flat = m.function("embed")(ids, m.params)
        added: list[int] = []
        try:
            for pad in plan.pad_ids:
                kv.add(pad)
                added.append(pad)
            kv.begin_forward(seq_ids + list(plan.pad_ids), [1] * plan.size, queued_early=device_tokens is not None)
            try:
                embeds = self._create_view(flat, m.ffi.Shape([plan.size, 1, m.hidden_size]), m.dtype, 0)
                args = (embeds, kv.tvm, m.params)
                logits, _ = call((CAPTURED_ENTRY, plan.size), self.entry, *args) if call is not None \
                    else self.entry(*args)
            finally:
                kv.end_forward()
        finally:
            for pad in added:  # the pad rows' pages go back: the KV state is the unpadded step's
                kv.remove(pad)
        return self._create_view(logits, m.ffi.Shape([plan.rows, 1, m.vocab_size]), "float32", 0)
