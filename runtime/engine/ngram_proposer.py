"""N-gram drafts (vLLM's "ngram" method, llama.cpp's prompt lookup): find the sequence's last
n tokens earlier in its own prompt and output, and propose the tokens that followed them.

The longest n in [prompt_lookup_min, prompt_lookup_max] that matches wins; among its matches
the latest one, whose continuation is the freshest copy of the text being repeated. No model
runs, so a proposal costs a few vectorised comparisons over the context.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_drafts(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the last n tokens (n from
    max_n down to min_n); [] when nothing matches."""
    total = tokens.size
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        # windows starting at 0 .. total-n-1: every earlier occurrence, the suffix itself excluded
        windows = sliding_window_view(tokens[:total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Drafts for a sequence whose tokens are `token_ids`, at most min(k, limit) of them."""
        n = min(self.k, limit)
        if n <= 0 or len(token_ids) <= self.min_n:
            return []
        return ngram_drafts(np.asarray(token_ids, dtype=np.int64), n, self.min_n, self.max_n)
