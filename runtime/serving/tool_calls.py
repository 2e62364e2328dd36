"""A forced tool call's answer as OpenAI's tool_calls (issue 14): the grammar of a named
function or of "required" (serving/structured_output.py) makes the model's text the call's JSON;
here it becomes `message.tool_calls`, or the deltas OpenAI streams (index, id and name first,
then argument fragments).
"""
from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from vtool.runtime.serving.protocol import ChatCompletionRequest, DeltaMessage


@dataclasses.dataclass
class ToolCallStream:
    """A choice's forced tool call while it streams."""

    id: str = dataclasses.field(default_factory=lambda: tool_call_id())
    text: str = ""
    started: bool = False


def tool_call_delta(req: ChatCompletionRequest, ts: ToolCallStream, text: str, final: bool) -> DeltaMessage | None:
    """A named call streams as OpenAI sends it: index, id and name first, then argument
    fragments (`text`, the answer's next piece). "required" (a list of calls) comes whole when
    the choice ends (`final`); text that is not a complete call then comes as content."""
    ts.text += text
    name = req.named_tool()
    if name is not None:
        calls = []
        if not ts.started:
            ts.started = True
            calls.append({"index": 0, "id": ts.id, "type": "function", "function": {"name": name, "arguments": ""}})
        if text:
            calls.append({"index": 0, "function": {"arguments": text}})
        return DeltaMessage(tool_calls=calls) if calls or final else None
    if not final:
        return None
    calls = forced_tool_calls(req, ts.text)
    if calls is None:
        return DeltaMessage(content=ts.text)
    return DeltaMessage(tool_calls=[{"index": k, **call} for k, call in enumerate(calls)])


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def forced_tool_calls(req: ChatCompletionRequest, text: str) -> list[dict[str, Any]] | None:
    """The calls a forced tool choice produced (its grammar made `text` the call's JSON), as
    OpenAI's tool_calls; None when the text is not a complete call (cut by max_tokens)."""
    name = req.named_tool()
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if name is not None:
        calls = [(name, value)]
    elif isinstance(value, list) and all(isinstance(c, dict) and "name" in c for c in value):
        calls = [(c["name"], c.get("parameters", {})) for c in value]
    else:
        return None
    return [{"id": tool_call_id(), "type": "function",
             "function": {"name": n, "arguments": json.dumps(args, ensure_ascii=False)}} for n, args in calls]
