"""llama3_json: Llama 3.1-3.3 (and Llama 4's JSON mode) answer a call with the whole output
{"name": NAME, "parameters": {...}} ("arguments" also taken), maybe after <|python_tag|>,
several joined by ';'.

Only an output that starts with such an object (after whitespace and the tag) is calls, which is
how vLLM streams them; vLLM's non-streaming path also finds objects inside text, which the
stream cannot, so this keeps the two alike. All of the output is calls or none of it is.
Streams incrementally: the name once known, then the arguments' JSON text as it arrives.
"""
from __future__ import annotations

from vtool.runtime.serving.tool_parsers.base import (
    PartialCall,
    Scan,
    ToolParser,
    skip_ws,
)
from vtool.runtime.serving.tool_parsers.json_scan import read_call_object

PYTHON_TAG = "<|python_tag|>"


def lead_in(text: str, tag: str, opener: str, final: bool) -> int | None:
    """Where the calls start: after whitespace and an optional tag, at `opener`. -1: the output
    is plain text; None: not known yet."""
    k = skip_ws(text, 0)
    rest = text[k:]
    if rest.startswith(tag):
        k = skip_ws(text, k + len(tag))
    elif not final and tag.startswith(rest):
        return None  # empty so far, or part of the tag
    if k >= len(text):
        return -1 if final else None
    return k if text[k] == opener else -1


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = True  # <|python_tag|> is a special token

    def scan(self, text: str, final: bool) -> Scan:
        k = lead_in(text, PYTHON_TAG, "{", final)
        if k is None:
            return Scan("", [])
        if k < 0:
            return Scan(text, [])
        calls: list[PartialCall] = []
        while True:
            got = read_call_object(text, k, final, arg_keys=("parameters", "arguments"))
            if got.status == "bad":
                return Scan(text, [])
            assert got.call is not None
            calls.append(got.call)
            if got.status == "open":
                return Scan("", calls)
            assert got.end is not None
            k = skip_ws(text, got.end)
            if k < len(text) and text[k] == ";":
                k = skip_ws(text, k + 1)
            elif k < len(text):
                return Scan(text, [])  # text after the calls: not a call answer
            if k >= len(text):
                if final:
                    for call in calls:
                        call.certain = True
                return Scan("", calls)
            if text[k] != "{":
                return Scan(text, [])


class Llama4JsonToolParser(Llama3JsonToolParser):
    name = "llama4_json"  # vLLM's other name for the same parser
