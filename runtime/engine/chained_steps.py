"""Chained decode steps: queue step N+1 before step N's tokens reach the host.

vLLM's async scheduling. On a GPU a decode step's tokens are drawn on the device; the host
used to wait for them, take them into the requests, schedule, and only then queue the next
step, so the device sat idle for that host work every step. When the next step is known
without step N's tokens (every sequence of step N sampled on the device and simply decodes
once more, no request waits for admission, every request has room for two more tokens),
the engine queues it at once, with each sequence's input token read on the device from
step N's draw (a device-to-device copy into the step's token-id buffer, stream-ordered after
the draw), and collects step N while the device runs it.

What that changes, and what it does not:
- Tokens, logprobs and seeded draws are the same: a request's generator draws one uniform
  per step in step order either way, and the host sampler (a chained step may need it, e.g.
  when min_tokens is reached by step N's token) sees step N's token before it draws.
- A request that step N ends (a stop token, or a stop string found by the text stage) has
  already had one more step queued: that row's token is dropped when the step is collected
  (the engine skips finished requests), as vLLM drops it; its KV blocks are freed as usual,
  and the write the queued step makes to them comes before any later use, in stream order.
- New requests are admitted by the scheduler: when one could be, the engine waits for step
  N as before.
- A step whose draw reports logprobs does not chain: collecting it copies those rows of its
  logits to the host, and a next step captured at the same batch size writes the same logits
  buffer (a CUDA graph's static output) before that copy would run.
- TVM's KV cache copies each step's page tables on a non-blocking stream of its own, so the
  next step's copy must not start under a running step: PagedKVCache.fence_steps makes each
  begin_forward wait for the previous step's model work (its logits), which leaves only the
  previous step's draw overlapped with this step's queueing.

On by default where the model thread runs the chained step's entry call (engine/model_thread.py)
and the step has at least two sequences (EngineConfig.chain_steps None): step N is then collected
and its outputs built while step N+1's call queues it, on another thread. Chaining alone measured
no faster (on the H200 with an 8B-shape model at 64 sequences the waiting engine's step already
equals the model step plus its draw; on an H100 with the SmolLM2 shape the host work simply moved),
nor did either way for one sequence of a small model, whose host is the bottleneck
(docs/BENCHMARKS.md, "Chained decode steps", "The model thread"): one-sequence steps chain only
once the engine has seen the host wait on the device longer than it takes to queue a step
(engine/chain_rule.py). VTOOL_CHAINED_STEPS=1 chains every step that can, thread or not, =0 none.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from vtool.runtime.artifact.tvm_runtime import global_func
from vtool.runtime.engine.request import Request
from vtool.runtime.engine.step_types import ScheduledSequence, SchedulerOutput

PENDING_TOKEN = -1  # a chained step's input token: on the device, not known to the host yet
_INT32_BYTES = 4


@dataclasses.dataclass(frozen=True)
class DeviceTokens:
    """Where a chained step's input tokens are: rows of an earlier step's drawn token ids."""

    tensor: Any  # int32 [b] on the device (a LaunchedDraw's tokens)
    rows: tuple[int, ...]  # the row of `tensor` for each sequence of the step, in batch order


def copy_runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(destination start, source start, length) for each maximal run of the step's sequences
    whose source rows are consecutive: one copy each (a batch that lost one sequence is two)."""
    return [(dst, src, n) for _, src, dst, n in part_runs([(0, r) for r in rows])]


def part_runs(sources: Sequence[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """(part, source row, destination row, length) for each maximal run of destination rows
    (sources[d] = (part, row) feeds destination row d) whose sources are consecutive rows of one
    part: one device copy each (here one part; a split mixed step's two, mixed_steps.py)."""
    runs: list[tuple[int, int, int, int]] = []
    for dst, (part, src) in enumerate(sources):
        if runs and runs[-1][0] == part and runs[-1][1] + runs[-1][3] == src and runs[-1][2] + runs[-1][3] == dst:
            p, s, d, n = runs[-1]
            runs[-1] = (p, s, d, n + 1)
        else:
            runs.append((part, src, dst, 1))
    return runs


def fill_token_ids(model: Any, host_ids: Sequence[int], source: DeviceTokens,
                   create_view: Callable[..., Any] | None = None, copy: Callable[[Any, Any], None] | None = None) -> Any:
    """The step's int32 token ids on the device: `host_ids` (pad rows' tokens; PENDING_TOKEN at
    the device rows, uploaded as 0 so that no row ever holds an id outside the vocabulary) put in
    the "ids" slot, then each run of device rows copied over it from `source`. Both copies are
    queued on the stream; neither waits for the device (a device-to-device copy never does)."""
    create_view = create_view or global_func("runtime.TVMTensorCreateView")
    copy = copy or global_func("runtime.TVMTensorCopyFromTo")
    host = np.array(host_ids, dtype=np.int32)
    host[host == PENDING_TOKEN] = 0
    ids = model.upload(host, slot="ids")
    shape_of = model.ffi.Shape
    for dst, src, n in copy_runs(source.rows):
        copy(create_view(source.tensor, shape_of([n]), "int32", src * _INT32_BYTES),
             create_view(ids, shape_of([n]), "int32", dst * _INT32_BYTES))
    return ids


def chain_rows(requests: Sequence[Request], step: SchedulerOutput, on_device_draw: bool,
               running: Sequence[Request], can_admit: bool, max_num_batched_tokens: int,
               room: Callable[[Request], int]) -> list[int] | None:
    """Which sequences of a launched step the next step decodes once more, chained to it: the
    indices of its unfinished requests, in order; None when the next step needs the scheduler.

    The next step is known without the launched step's tokens only when every sequence of that
    step samples, on the device, a plain token (no drafts, no grammar: a mask depends on the
    token before it; no penalties or min_tokens: their edits do too), the scheduler's running
    list is exactly those requests still unfinished (nothing else running, nothing preempted),
    no waiting request could be admitted, and each request has room for the launched step's
    token and one more."""
    if not on_device_draw or can_admit:
        return None
    for s in step.sequences:
        if not s.sample or s.draft_ids or s.logits_processors or s.return_logits:
            return None
        if s.sampler is not None and s.sampler.edits_follow_tokens:
            return None
    rows = [i for i, r in enumerate(requests) if not r.finished]
    kept = [requests[i] for i in rows]
    if not kept or len(kept) > max_num_batched_tokens or list(running) != kept:
        return None
    if any(room(r) < 2 for r in kept):
        return None
    return rows


def chained_step(requests: Sequence[Request], before: Sequence[ScheduledSequence]) -> SchedulerOutput:
    """The chained step: each request decodes the token its sequence in the step before drew
    (PENDING_TOKEN here; the runner reads it on the device), at the position after that step's
    tokens (before[i] is requests[i]'s share of that step: a decode, or a prompt's last chunk)."""
    row = ScheduledSequence.decode_row
    return SchedulerOutput(tuple(row(r.request_id, r.seq_id, PENDING_TOKEN, s.num_computed + s.num_tokens, r.sampler)
                                 for r, s in zip(requests, before)))
