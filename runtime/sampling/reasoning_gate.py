"""Structured output that starts after the reasoning section (issue 14), as vLLM applies a
request's grammar once its reasoning parser sees the end of the thinking: a model served with
`--reasoning-parser` thinks freely between <think> and </think>, then the JSON schema, regex or
tool-call grammar constrains the answer that follows.

ReasoningGate wraps a request's GrammarProcessor: until the output holds the end marker's token
ids it masks nothing (every token allowed) and tells the grammar nothing; the tokens after the
marker go to the grammar. It is a LogitsProcessor and a BitmaskSource like the processor it
wraps, so the host and device samplers use it the same way.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


class ReasoningGate:
    """`grammar` applies once `end_ids` (the reasoning end marker's token ids) have been
    generated. `ended`: the prompt already closed the section (no reasoning to wait for)."""

    def __init__(self, grammar: Any, end_ids: Sequence[int], ended: bool = False):
        if not end_ids:
            raise ValueError("a reasoning gate needs the end marker's token ids")
        self.grammar = grammar
        self.end_ids = tuple(int(t) for t in end_ids)
        self.ended = ended
        self._tail: list[int] = []  # the last len(end_ids) tokens while the section is open

    @property
    def active_grammar(self) -> Any | None:
        """The wrapped grammar when it applies (the reasoning is over), else None."""
        return self.grammar if self.ended else None

    # LogitsProcessor
    def apply(self, logits: np.ndarray, output_ids: Sequence[int] = ()) -> None:
        if self.ended:
            self.grammar.apply(logits, output_ids)

    def accept(self, token_id: int) -> None:
        if self.ended:
            self.grammar.accept(token_id)
            return
        self._tail.append(int(token_id))
        del self._tail[:-len(self.end_ids)]
        self.ended = tuple(self._tail) == self.end_ids

    # BitmaskSource
    def fill_bitmask(self, words: np.ndarray) -> None:
        if self.ended:
            self.grammar.fill_bitmask(words)
        else:
            words[:] = -1  # every token: the thinking is free

    def accept_token(self, token_id: int) -> None:
        self.accept(token_id)

    # the grammar's state, as the engine asks it
    def is_terminated(self) -> bool:
        return self.ended and self.grammar.is_terminated()

    def forced_tokens(self) -> list[int]:
        return self.grammar.forced_tokens() if self.ended else []
