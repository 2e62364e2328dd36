"""Speculative verification: which proposed tokens a sequence keeps, from the target model's
logits at every proposed position (rows [k+1, V]: row j follows the j-th draft).

Greedy rows keep the longest prefix of drafts that equals the target's own argmax and then
take the target's token, so the output is the one decoding without speculation gives.
Random rows use speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023):
draft d drawn from q is kept with probability min(1, p(d) / q(d)); on a rejection the token
is drawn from normalise(max(p - q, 0)); after k kept drafts one more token comes from the
last row. The result is distributed exactly as p, the target's distribution after the
request's temperature, top-k, top-p and min-p. An n-gram draft is a point mass (q(d) = 1):
kept with probability p(d), else drawn from p without d.

Each row is processed with the request's history as of that position (penalties, logit
bias, min_tokens, grammar masks), because the sampler records every kept token before the
next row is read. Verification stops at a stop token, a finished grammar, or the room the
request has left, so nothing is recorded past the request's end.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vtool import VtoolError
from vtool.runtime.sampling.device import sequence_on_device
from vtool.runtime.sampling.host import (SampleResult, SequenceSampler, draw_index, raw_logprobs, scratch_buffers,
                                         target_probs)


def _ended(seq: SequenceSampler, token: int) -> bool:
    return seq.is_stop_token(token) or any(getattr(p, "is_terminated", None) and p.is_terminated()
                                           for p in seq.logits_processors)


def verify_drafts(rows: np.ndarray, drafts: Sequence[int], seq: SequenceSampler, room: int,
                  draft_probs: np.ndarray | None = None) -> tuple[list[SampleResult], int]:
    """The tokens the sequence takes from this step (1 to len(drafts) + 1 of them, each
    recorded in `seq`) and how many of them are accepted drafts. `draft_probs` [k, V] is the
    distribution each draft was drawn from (None: the drafts were proposed deterministically,
    as n-gram lookup and greedy draft models do)."""
    rows = np.asarray(rows)
    k = len(drafts)
    if rows.ndim != 2 or rows.shape[0] != k + 1:
        raise VtoolError(f"verification needs {k + 1} logits rows for {k} drafts, got {rows.shape}")
    if room < 1:
        raise VtoolError(f"verification needs room for at least one token, got {room}")
    vocab = rows.shape[1]
    seq._check_vocab(vocab)
    scratch = scratch_buffers(vocab)
    p = seq.params
    results: list[SampleResult] = []
    accepted = 0
    for j in range(k + 1):
        raw = np.ascontiguousarray(rows[j], dtype=np.float32)
        raw_max = raw.max()
        if not np.isfinite(raw_max):
            raise VtoolError(f"logits row {j} has no finite maximum ({raw_max}): the model produced NaN/inf")
        x = seq.process_logits(raw, out=scratch.x) if seq.needs_processing() or not p.greedy else raw
        draft = int(drafts[j]) if j < k else None
        if p.greedy:
            token = int(np.argmax(x))
            if not np.isfinite(x[token]):
                raise VtoolError(f"row {j}: every token is masked (min_tokens/stop ids cover the vocabulary)")
            kept = token == draft
        else:
            target = target_probs(x, p, scratch, row=j)
            if draft is None:
                token, kept = draw_index(target, seq.rng.random()), False
            else:
                q = None if draft_probs is None else np.asarray(draft_probs[j], dtype=np.float64)
                q_d = 1.0 if q is None else float(q[draft])
                kept = q_d > 0.0 and seq.rng.random() * q_d < target[draft]
                if kept:
                    token = draft
                else:
                    if q is None:
                        residual = target.copy()
                        residual[draft] = 0.0
                    else:
                        residual = np.maximum(target - q, 0.0)
                    if residual.sum() <= 0.0:  # p == q up to rounding: any draw from p is right
                        residual = target
                    token = draw_index(residual, seq.rng.random())
        seq.append_token(token)
        results.append(raw_logprobs(raw, raw_max, token, p.logprobs, scratch))
        if kept:
            accepted += 1
        if not kept or _ended(seq, token) or len(results) >= room:
            break
    return results, accepted


def greedy_on_device(seq: SequenceSampler) -> bool:
    """Whether a greedy sequence's verification can use the device's argmax of each row: no
    logits processors, penalties, bias, min_tokens or logprobs change or read its rows
    (sampling/device.py can_sample_on_device), so the argmax is all verify_drafts would use."""
    return seq.params.greedy and sequence_on_device(seq) and not seq.needs_processing()


def verify_greedy_argmax(tokens: Sequence[int], logprobs: Sequence[float], drafts: Sequence[int],
                         seq: SequenceSampler, room: int) -> tuple[list[SampleResult], int]:
    """verify_drafts for a greedy_on_device sequence, from the argmax of each of its k+1 rows
    (token and its raw logprob, drawn on the device) instead of the rows themselves: the same
    tokens, with far less copied from the device."""
    k = len(drafts)
    if len(tokens) != k + 1 or len(logprobs) != k + 1:
        raise VtoolError(f"verification needs {k + 1} argmax rows for {k} drafts, got {len(tokens)}")
    if room < 1:
        raise VtoolError(f"verification needs room for at least one token, got {room}")
    results: list[SampleResult] = []
    accepted = 0
    for j in range(k + 1):
        token, logprob = int(tokens[j]), float(logprobs[j])
        if token < 0 or not np.isfinite(logprob):
            raise VtoolError(f"logits row {j} has no finite maximum: the model produced NaN/inf")
        kept = j < k and token == int(drafts[j])
        seq.append_token(token)
        results.append(SampleResult(token_id=token, logprob=logprob))
        if kept:
            accepted += 1
        if not kept or _ended(seq, token) or len(results) >= room:
            break
    return results, accepted
