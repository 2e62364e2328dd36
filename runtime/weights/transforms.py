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


TRANSFORMS: dict[str, Callable[[Sequence[np.ndarray]], np.ndarray]] = {
    "identity": _identity,
    "concat_rows": _concat_rows,
}


def apply_transform(name: str, sources: Sequence[np.ndarray]) -> np.ndarray:
    try:
        fn = TRANSFORMS[name]
    except KeyError:
        raise VtoolError(f"unknown weight transform {name!r}; this runtime knows {sorted(TRANSFORMS)}") from None
    return fn(sources)
