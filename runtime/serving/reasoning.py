"""Reasoning parsers (`vtool serve --reasoning-parser NAME`): the model's thinking, written between
<think> and </think>, is split from the answer into the chat message's `reasoning` field, as
vLLM's reasoning parsers do, whole (split) and streamed (ReasoningStream, which gives the same
split however the text arrives in pieces).

- deepseek_r1: everything before </think> is reasoning, a leading <think> dropped (DeepSeek-R1's
  template opens the section in the prompt, so the output often starts inside it); without
  </think> the whole output is reasoning.
- qwen3: reasoning only where the output opens a section with <think> or closes one with
  </think> (Qwen3 with enable_thinking false writes neither: all of it is the answer).
"""
from __future__ import annotations

START, END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    opens_in_prompt = False  # the section may be open before the output starts (no <think> in it)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none."""
        if text.startswith(START):
            body, opened = text[len(START):], True
        else:
            body, opened = text, self.opens_in_prompt
        if not opened:
            return None, text or None
        if END in body:
            reasoning, content = body.split(END, 1)
            return reasoning or None, content.lstrip("\n") or None
        return body or None, None

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)


class DeepSeekR1(ReasoningParser):
    name = "deepseek_r1"
    opens_in_prompt = True


class Qwen3(ReasoningParser):
    name = "qwen3"
    opens_in_prompt = False


PARSERS: dict[str, type[ReasoningParser]] = {"deepseek_r1": DeepSeekR1, "qwen3": Qwen3}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in PARSERS:
        from vtool import VtoolError

        raise VtoolError(f"--reasoning-parser {name!r} is not one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


class ReasoningStream:
    """Incremental split: push() each text delta, get (reasoning delta, content delta). Text that
    may still become a tag is held back until it is known, so the pieces joined equal split() of
    the whole, however the text was cut (tests check it with hypothesis)."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""  # everything pushed
        self.sent_reasoning = 0  # characters of the reasoning already emitted
        self.sent_content = 0

    def push(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self._settled(final)
        out_r, out_c = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return out_r, out_c

    def _settled(self, final: bool) -> tuple[str, str]:
        """The reasoning and content no later text can change."""
        text = self.text
        if not final:
            if len(text) < len(START) and START.startswith(text):
                return "", ""  # the output may still open with <think>
            if END not in text:  # a tail that may still grow into </think>
                hold = max((k for k in range(1, len(END)) if text.endswith(END[:k])), default=0)
                text = text[:len(text) - hold]
        reasoning, content = self.parser.split(text)
        return reasoning or "", content or ""
