"""One chat choice's text as the assistant message OpenAI clients read (issue 14), whole or
streamed: the reasoning section split off into `reasoning` (--reasoning-parser), then the
answer as plain `content`, as a forced tool call (a named function or "required": the grammar
made it the call's JSON), or as `content` and `tool_calls` found by the --tool-call-parser
("auto").

Streaming gives the same message as the whole text, however it arrives in pieces: each stage
holds back what may still turn into a tag (serving/reasoning.py, serving/tool_parsers/).
"""
from __future__ import annotations

from typing import Any

from vtool.runtime.serving.protocol import ChatCompletionRequest, DeltaMessage
from vtool.runtime.serving.reasoning import ReasoningParser
from vtool.runtime.serving.tool_calls import ToolCallStream, forced_tool_calls, tool_call_delta


def tool_mode(req: ChatCompletionRequest, tool_parser: Any) -> str:
    """How the answer's tool calls are read: "forced" (the grammar wrote the call), "auto" (a
    parser finds calls in free text) or "none"."""
    if not req.tools:
        return "none"
    if req.named_tool() is not None or req.effective_tool_choice == "required":
        return "forced"
    if req.effective_tool_choice == "auto" and tool_parser is not None and req.tool_functions():
        return "auto"
    return "none"


class ChoiceShaper:
    def __init__(self, req: ChatCompletionRequest, reasoning_parser: ReasoningParser | None, tool_parser: Any,
                 include_reasoning: bool = True):
        """tool_parser: the --tool-call-parser class (serving/tool_parsers), or None."""
        self.req = req
        self.reasoning_parser = reasoning_parser
        self.include_reasoning = include_reasoning
        self.mode = tool_mode(req, tool_parser)
        self.parser = tool_parser(req.tools) if self.mode == "auto" else None
        # streaming state
        self._reasoning = reasoning_parser.stream() if reasoning_parser is not None else None
        self._forced = ToolCallStream()
        self._auto = self.parser.stream() if self.parser is not None else None
        self.called = False  # a tool call was made (streamed): finish_reason "tool_calls"

    # -- whole ------------------------------------------------------------------------------
    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the message's fields: content, reasoning, tool_calls; the finish reason)."""
        reasoning, content = self.reasoning_parser.split(text) if self.reasoning_parser else (None, text)
        out: dict[str, Any] = {"content": content if self.reasoning_parser else text,
                               "reasoning": reasoning if self.include_reasoning else None}
        if self.mode == "forced":
            calls = forced_tool_calls(self.req, content or "")
            if calls is not None:
                out.update(content=None, tool_calls=calls)
                return out, self._finish(finish_reason, named=self.req.named_tool() is not None)
        elif self.mode == "auto":
            found = self.parser.extract(content or "")
            if found.calls:
                out.update(content=found.content, tool_calls=[c.to_openai() for c in found.calls])
                return out, self._finish(finish_reason)
        return out, finish_reason

    @staticmethod
    def _finish(reason: str | None, named: bool = False) -> str | None:
        # as vLLM: a call that ended the answer reports "tool_calls" ("stop" for a named choice)
        return "tool_calls" if reason == "stop" and not named else reason

    # -- streamed ---------------------------------------------------------------------------
    def push(self, text: str, final: bool) -> DeltaMessage | None:
        """The delta for the choice's next piece of text; None when everything is held back."""
        if self._reasoning is not None:
            reasoning, content = self._reasoning.push(text, final=final)
        else:
            reasoning, content = "", text
        delta = DeltaMessage()
        if reasoning and self.include_reasoning:
            delta.reasoning = reasoning
        if self.mode == "forced":
            calls = tool_call_delta(self.req, self._forced, content, final)
            if calls is not None:
                delta.content, delta.tool_calls = calls.content, calls.tool_calls
        elif self.mode == "auto":
            piece = self._auto.push(content, final=final)
            if piece.content:
                delta.content = piece.content
            delta.tool_calls = piece.tool_calls
        elif content or (not reasoning and self._reasoning is None):
            delta.content = content
        if delta.tool_calls:
            self.called = True
        if delta.reasoning is None and delta.content is None and not delta.tool_calls:
            return None
        return delta

    def stream_finish(self, reason: str | None) -> str | None:
        if not self.called:
            return reason
        return self._finish(reason, named=self.mode == "forced" and self.req.named_tool() is not None)
