"""Handing the C heap's free memory back to the system (issue 16: peak memory of `vtool run`).

Loading leaves freed memory in glibc's heap that the process never uses again: the tokenizer's
construction (the GGUF vocabulary and merges as Python objects, tokenizers' JSON parse: about
20 MB for a 150k-token vocabulary) and the binder's row chunks. glibc returns only the top of
its heap on free(); malloc_trim(0) releases every free page inside it too, so that memory does
not sit in the resident set under the weights bound next. A no-op where there is no glibc.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; absent on macOS and musl
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim(0); a few ms)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
