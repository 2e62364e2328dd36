"""A step that admits prompts beside running decodes, run as two model calls (opt-in,
VTOOL_SPLIT_MIXED_STEPS=1; not yet shown to pay on a GPU).

Under continuous batching a request that arrives while others decode joins the next step: its
prompt chunk and every running sequence's one token go through `batch_prefill` together. With
TVM's TIR attention (a CUDA build without FlashInfer) that mixed step is slow: the paged prefill
kernel takes every decode row with its whole context, and nothing of it is in a CUDA graph. In
served runs of 256 prompts at 64 on an H100 such steps took 6-11 ms for the SmolLM2 shape (decode
steps ~2-3 ms) and 40-64 ms for the 8B shape (~8 ms): a third to nearly half of each run's time
(docs/BENCHMARKS.md, "Mixed steps in two calls").

Split, the sequences computing one token run as an all-decode step (the captured `batch_decode`,
padded to a graph size), the rest (prompt chunks) through `batch_prefill`, each with its own
begin/end_forward over disjoint sequences of TVM's cache, the second waiting for the first's
model work (PagedKVCache.fence_steps: TVM rewrites its page-table buffer on a copy stream that
does not wait for queued kernels), and the logit rows the step wants are copied, in the step's
own order, into one device buffer, so the sampler sees the step it scheduled. The decode rows
then get decode's numerics, as in any other step.

Why opt-in: on an H200 the SmolLM2 shape's split mixed steps cost what the unsplit ones did
(~10 ms: the host queues either in about that time), and the 8B shape's died with an illegal
address before the second call waited for the first; with that wait the split is correct on
the CPU and untested on a GPU (tests/bench/mixed_steps.py with VTOOL_SPLIT_MIXED_STEPS=1 / 0 on
the 8B shape is the check). Never split: steps whose rows verify drafts or return logits, and
steps without both kinds.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from vtool.runtime.engine.chained_steps import part_runs
from vtool.runtime.engine.step_types import SchedulerOutput

SPLIT_ENV = "VTOOL_SPLIT_MIXED_STEPS"
_FLOAT32_BYTES = 4


def splits_mixed_steps() -> bool:
    """Whether the runner splits mixed steps: VTOOL_SPLIT_MIXED_STEPS=1 (off by default)."""
    return os.environ.get(SPLIT_ENV, "") not in ("", "0")


def split_rows(step: SchedulerOutput) -> tuple[list[int], list[int]] | None:
    """(the sequences computing one token, the others) of a step to split, or None: no sequence
    of either kind, or one that verifies drafts or returns its logits."""
    ones: list[int] = []
    rest: list[int] = []
    for i, s in enumerate(step.sequences):
        if s.draft_ids or s.return_logits:
            return None
        (ones if s.num_tokens == 1 else rest).append(i)
    return (ones, rest) if ones and rest else None


def row_sources(owners: Sequence[int], parts: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[int, int]]:
    """For each wanted row of the whole step (owners: the step's sequence per row, -1 for none),
    (part, row in that part's logits). parts[k] = (the step's sequence index of each of part k's
    sequences, part k's own row owners, indices into its sequences, -1 for none)."""
    where: dict[int, tuple[int, int]] = {}
    for k, (indices, part_owners) in enumerate(parts):
        for row, owner in enumerate(part_owners):
            if owner >= 0:
                where[indices[owner]] = (k, row)
    return [where[o] for o in owners]


def gather_rows(model: Any, create_view: Any, copy: Any, vocab: int, sources: Sequence[tuple[int, int]],
                tensors: Sequence[Any]) -> Any:
    """The step's logits [len(sources), vocab] float32 in one device buffer (the "mixed.logits"
    slot, reused: the draw reading it is queued before any later step can write it, and a step
    whose rows the host copies later, for logprobs, is collected before the next mixed step)."""
    out = model.scratch("mixed.logits", (len(sources), vocab), "float32")
    shape = model.ffi.Shape
    row_bytes = vocab * _FLOAT32_BYTES
    for part, src, dst, n in part_runs(sources):
        copy(create_view(tensors[part], shape([n, vocab]), "float32", src * row_bytes),
             create_view(out, shape([n, vocab]), "float32", dst * row_bytes))
    return out
