"""hermes: Hermes-2-Pro/3, Qwen2.5, QwQ and Qwen3 write each call as
<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>, several in a row, after any content.

Streams incrementally, as vLLM does: the name once its string is closed, then the arguments' own
JSON text as it arrives. "parameters" is taken for "arguments" too (some fine-tunes write it).
"""
from __future__ import annotations

from vtool.runtime.serving.tool_parsers.base import Scan, ToolParser, skip_ws
from vtool.runtime.serving.tool_parsers.json_scan import read_call_object
from vtool.runtime.serving.tool_parsers.tagged import Body, scan_tagged

START, END = "<tool_call>", "</tool_call>"


def parse_body(body: str, offset: int, closed: bool, eof: bool) -> Body:
    """One JSON call object, whitespace around it."""
    k = skip_ws(body, 0)
    if k == len(body):
        return Body("bad" if closed or eof else "open")
    if body[k] != "{":
        return Body("bad")
    got = read_call_object(body, k, final=closed or eof, arg_keys=("arguments", "parameters"))
    if got.status == "bad":
        return Body("bad")
    assert got.call is not None
    got.call.key += offset
    if got.status == "open":
        return Body("open", [got.call])
    assert got.end is not None
    if body[got.end:].strip():
        return Body("bad")  # text after the object, inside the tags
    if not (closed or eof):
        return Body("open", [got.call])  # complete, but text may still come before </tool_call>
    got.call.certain = True
    return Body("good", [got.call])


class HermesToolParser(ToolParser):
    name = "hermes"
    # <tool_call> is a special token in some tokenizers (Hermes-2-Pro); vLLM keeps special tokens
    needs_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        return scan_tagged(text, final, START, END, parse_body)
