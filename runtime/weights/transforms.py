"""Named transforms that make a compiled parameter from checkpoint tensors.

The manifest names one of these per parameter; a name not in the registry is refused,
so an artifact from a newer vtool never binds weights it does not understand.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from vtool import VtoolError


def _identity(sources: Sequence[np.ndarray]) -> np.ndarray:
    (only,) = sources
    return only


def _concat_rows(sources: Sequence[np.ndarray]) -> np.ndarray:
    # q|k|v and gate|up: stacked along the output dimension (rows of W, entries of b).
    return np.concatenate(sources, axis=0)


def _first_row(sources: Sequence[np.ndarray]) -> np.ndarray:
    # BERT's token_type_embeddings: only segment 0's row is compiled (models/bert.py).
    (only,) = sources
    return np.ascontiguousarray(only[:1])


def _stack_experts(sources: Sequence[np.ndarray]) -> np.ndarray:
    # a mixture of experts' down projections, one [H, I] per expert -> [E, H, I] (models/moe.py)
    return np.stack(sources)


def _stack_gate_up_experts(sources: Sequence[np.ndarray]) -> np.ndarray:
    # every expert's gate, then every expert's up, [I, H] each -> [E, 2I, H], expert e = gate_e|up_e
    experts = len(sources) // 2
    return np.stack([np.concatenate((g, u), axis=0) for g, u in zip(sources[:experts], sources[experts:])])


def _transpose(sources: Sequence[np.ndarray]) -> np.ndarray:
    # GPT-2's Conv1D matrices, stored [in, out] -> Linear's [out, in] (models/gpt2.py)
    (only,) = sources
    return np.ascontiguousarray(only.T)


def _plus_one(sources: Sequence[np.ndarray]) -> np.ndarray:
    # Gemma's RMSNorm scales by (1 + w): folded into the weight once, at load (models/gemma.py)
    (only,) = sources
    return (only.astype(np.float32) + np.float32(1.0)).astype(only.dtype)


TRANSFORMS: dict[str, Callable[[Sequence[np.ndarray]], np.ndarray]] = {
    "identity": _identity,
    "plus_one": _plus_one,
    "transpose": _transpose,
    "concat_rows": _concat_rows,
    "stack_experts": _stack_experts,
    "stack_gate_up_experts": _stack_gate_up_experts,
    "first_row": _first_row,
}


def apply_transform(name: str, sources: Sequence[np.ndarray]) -> np.ndarray:
    try:
        fn = TRANSFORMS[name]
    except KeyError:
        raise VtoolError(f"unknown weight transform {name!r}; this runtime knows {sorted(TRANSFORMS)}") from None
    return fn(sources)
