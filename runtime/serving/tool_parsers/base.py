"""What every tool-call parser shares: the OpenAI shapes of a call, and one streamer for all
formats.

A parser describes its format once, as `scan(text, final)`: the content and the calls that no
later text can change (a tail that may still become a marker is left out, as ReasoningStream
does). extract() is the scan of the whole text, and the streamer sends the difference between
two scans, so a streamed choice joins up to what extract() returns however the text was cut.

A call the format cannot parse (bad JSON inside the markers, a call cut off at max_tokens) is
not a call: its text stays in the content where it stood. With one call, the usual case, that
is vLLM's answer (the whole text as content, no calls). Formats where the calls are the whole
output (llama3_json, pythonic, mistral's JSON list) are all-or-nothing, as in vLLM.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolExtraction:
    content: str | None  # the text outside calls; None when empty or whitespace only
    calls: list[ToolCall]


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI delta dicts


@dataclass
class PartialCall:
    """A call as far as a scan can see it."""

    key: int  # where it starts in the text: the same call keeps its key from scan to scan
    name: str | None  # None until the whole name is known
    arguments: str = ""  # JSON text known so far; each scan's is a prefix of the next one's
    certain: bool = False  # the call and all its arguments are final, whatever text follows


@dataclass
class Scan:
    content: str  # settled content; each scan's is a prefix of the next one's
    calls: list[PartialCall]


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with (text that may
    still grow into the marker, to hold back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\n\r":
        i += 1
    return i


def normalized_json(raw: str) -> str:
    """The arguments as vLLM sends them (json.dumps of the parsed object, unicode kept)."""
    value = json.loads(raw)
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \ud800 escape: keep it escaped
        text = json.dumps(value)
    return text


def chatcmpl_tool_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's id for tool calls


class ToolParser:
    name: ClassVar[str] = ""
    # The call markers are special tokens, which the detokenizer drops unless told to keep them
    # (the server then sets skip_special_tokens false, as vLLM's parsers do).
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        self.tools = list(tools or [])

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def new_id(self) -> str:
        return chatcmpl_tool_id()

    def extract(self, text: str) -> ToolExtraction:
        scan = self.scan(text, final=True)
        calls = [ToolCall(self.new_id(), c.name or "", normalized_json(c.arguments)) for c in scan.calls]
        return ToolExtraction(scan.content if scan.content.strip() else None, calls)

    def stream(self, incremental: bool = True) -> ToolCallStreamer:
        return ToolCallStreamer(self, incremental)

    def parameters_of(self, function: str) -> dict[str, Any] | None:
        """The JSON schema of a requested tool's parameters; None for a name not in `tools`."""
        for tool in self.tools:
            spec = tool.get("function", tool) if isinstance(tool, dict) else None
            if isinstance(spec, dict) and spec.get("name") == function:
                params = spec.get("parameters")
                return params if isinstance(params, dict) else {}
        return None


@dataclass
class _Sent:
    index: int
    arguments: str = ""


class ToolCallStreamer:
    """push() each text delta (final=True on the last); get the content and tool-call deltas
    to send. Names go out whole, once known.

    incremental (vLLM's way): arguments go out as they become known. The content always joins
    up to extract()'s, and so do the calls of a well-formed output; but a call whose deltas had
    begun before it turned out malformed or cut off (max_tokens) cannot be taken back: it stays
    in the stream, while its text also arrives as content and extract() has no such call.
    incremental=False: each call goes out whole once it is certain, so the stream agrees with
    extract() on every output, at the price of holding each call until it closes (for the
    all-or-nothing formats, until the output ends)."""

    def __init__(self, parser: ToolParser, incremental: bool = True):
        self.parser = parser
        self.incremental = incremental
        self.text = ""
        self.content = ""  # content sent
        self.sent: dict[int, _Sent] = {}  # by PartialCall.key

    def push(self, delta: str, final: bool = False) -> StreamDelta:
        self.text += delta
        scan = self.parser.scan(self.text, final)
        out = StreamDelta()
        content = scan.content if scan.content.strip() else ""  # whitespace alone may end as None
        if len(content) > len(self.content) and content.startswith(self.content):
            out.content, self.content = content[len(self.content):], content
        for call in scan.calls:
            if not self.incremental and not call.certain:
                break
            sent = self.sent.get(call.key)
            if sent is None:
                if call.name is None:
                    break  # indexes go in order: a later call waits for this one's name
                sent = self.sent[call.key] = _Sent(len(self.sent))
                out.tool_calls.append({"index": sent.index, "id": self.parser.new_id(), "type": "function",
                                       "function": {"name": call.name, "arguments": ""}})
            if len(call.arguments) > len(sent.arguments) and call.arguments.startswith(sent.arguments):
                out.tool_calls.append({"index": sent.index,
                                       "function": {"arguments": call.arguments[len(sent.arguments):]}})
                sent.arguments = call.arguments
        return out
