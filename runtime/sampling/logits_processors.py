"""Per-request logits processors: the seam where grammar masks (structured output, tool calls)
and other per-request rules change a row of logits before the sampler chooses.

A processor sees the request's logits row (float32 [vocab], processed in place) and the
tokens generated so far; after the draw it is told which token was accepted, so a stateful
one (a grammar matcher) can advance. They run first, before logit_bias, penalties and
temperature, as vLLM's per-request processors did; reported logprobs stay the raw model's.

The token bitmask is the packed form grammar engines (xgrammar, llguidance) fill: bit j of
32-bit word i allows token 32*i + j. It crosses to a device as those words.
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from vtool import VtoolError


@runtime_checkable
class LogitsProcessor(Protocol):
    def apply(self, logits: np.ndarray, output_ids: Sequence[int]) -> None:
        """Change `logits` (float32 [vocab]) in place for the next draw."""

    def accept(self, token_id: int) -> None:
        """The token drawn after apply(); a stateful processor advances here."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def pack_allowed(allowed: np.ndarray) -> np.ndarray:
    """A bool [vocab] mask -> its packed int32 words (little-endian bit order within a word)."""
    allowed = np.asarray(allowed, dtype=bool).reshape(-1)
    padded = np.zeros(bitmask_words(allowed.size) * 32, dtype=bool)
    padded[: allowed.size] = allowed
    return np.packbits(padded.reshape(-1, 32), axis=1, bitorder="little").view("<u4").reshape(-1).view(np.int32)


def unpack_allowed(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """Packed int32 words -> a bool [vocab_size] mask."""
    words = np.ascontiguousarray(words, dtype=np.int32).reshape(-1)
    if words.size < bitmask_words(vocab_size):
        raise VtoolError(f"a token bitmask for a vocabulary of {vocab_size} needs {bitmask_words(vocab_size)} "
                         f"32-bit words, got {words.size}")
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


def apply_token_bitmask(logits: np.ndarray, words: np.ndarray) -> None:
    """Disallowed tokens -> -inf, in place. Rows past the vocabulary in the last word are ignored."""
    allowed = unpack_allowed(words, logits.shape[-1])
    logits[~allowed] = -np.inf


class TokenBitmaskProcessor:
    """Allows only the tokens a callback's bitmask allows at each step: the shape a grammar
    matcher plugs into (fill the words for the current state, advance on accept)."""

    def __init__(self, fill: "BitmaskSource"):
        self.source = fill

    def apply(self, logits: np.ndarray, output_ids: Sequence[int]) -> None:
        words = np.zeros(bitmask_words(logits.shape[-1]), dtype=np.int32)
        self.source.fill_bitmask(words)
        apply_token_bitmask(logits, words)

    def accept(self, token_id: int) -> None:
        self.source.accept_token(token_id)


class BitmaskSource(Protocol):
    def fill_bitmask(self, words: np.ndarray) -> None: ...

    def accept_token(self, token_id: int) -> None: ...


class AllowedTokens:
    """A fixed set of allowed tokens (a BitmaskSource): the simplest grammar, and the one tests use."""

    def __init__(self, token_ids: Sequence[int], vocab_size: int):
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise VtoolError(f"allowed token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        if not token_ids:
            raise VtoolError("an allowed-token set must allow at least one token")
        mask = np.zeros(vocab_size, dtype=bool)
        mask[list(token_ids)] = True
        self.words = pack_allowed(mask)
        self.accepted: list[int] = []

    def fill_bitmask(self, words: np.ndarray) -> None:
        words[: self.words.size] = self.words

    def accept_token(self, token_id: int) -> None:
        self.accepted.append(int(token_id))
