"""A quantized tensor's block rows in its file, read a few rows at a time (issue 16: peak memory).

Binding a weight kept in blocks used to read the whole tensor, repack it into the kernels'
layout (a second copy, plus the repacker's intermediates) and copy that into the runtime's
tensor (a third): for a 150k-token embedding or lm_head, several hundred MB above what stays
resident. The binder (runtime/artifact/library.py) now reads row chunks through a BlockRows,
repacks each chunk (every kept format is row-local, and a chunk of whole tiles repacks into
the same first-dim slice of every part) and writes it straight into the runtime's tensor, so
only one chunk is ever in flight. Bytes are read, not mapped: the page cache holds the file
and none of it counts in this process's resident memory.

Nothing here imports TVM.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from vtool import VtoolError


@dataclasses.dataclass(frozen=True)
class BlockRows:
    """Rows [rows, row_bytes] of GGML blocks at byte `offset` of `path`, in Hugging Face row
    order: HF row i is the file's row `order[i]` (None: the same row)."""

    kind: str  # GGML type name
    path: Path
    offset: int
    rows: int
    row_bytes: int
    order: np.ndarray | None = None

    def read(self, start: int, stop: int) -> np.ndarray:
        """uint8 [stop - start, row_bytes]: HF rows start..stop-1, a fresh array."""
        if not 0 <= start <= stop <= self.rows:
            raise ValueError(f"rows {start}..{stop} of {self.rows}")
        if self.order is None:
            first, last, pick = start, stop, None
        else:  # a reordering within heads: the chunk's rows lie in a span little wider than it
            wanted = self.order[start:stop]
            first, last = (int(wanted.min()), int(wanted.max()) + 1) if stop > start else (start, start)
            pick = wanted - first
        data = np.empty((last - first, self.row_bytes), np.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.offset + first * self.row_bytes)
            if f.readinto(memoryview(data).cast("B")) != data.nbytes:
                raise VtoolError(f"{self.path}: a {self.kind} tensor at byte {self.offset} is cut short")
        return data if pick is None else data[pick]
