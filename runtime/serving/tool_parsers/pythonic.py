"""pythonic: Llama 3.2/4 (and ToolACE-style models) answer a call with the whole output a Python
list of calls, [get_weather(city="SF", metric="celsius"), other()], maybe wrapped in
<|python_start|> ... <|python_end|> (Llama 4).

Read with `ast`: keyword arguments whose values are literals (strings, numbers, True/False/None,
lists, tuples, dicts of them) and nothing else; anything else means the output is plain text. All
of it is calls or none of it is, as in vLLM, except that an empty list is text here (vLLM
answers it with no content and no calls).

Streams each call's name once its "(" has come, and its arguments whole when the call's closing
parenthesis has: a Python literal is only known to be one when it is finished.
"""
from __future__ import annotations

import ast
import json
import re

from vtool.runtime.serving.tool_parsers.base import (
    PartialCall,
    Scan,
    ToolParser,
    partial_suffix,
)
from vtool.runtime.serving.tool_parsers.llama3_json import lead_in

START, END = "<|python_start|>", "<|python_end|>"
_OPEN = {"(": ")", "[": "]", "{": "}"}
_BLANK = r"(?:\s|#[^\n]*)*"  # whitespace and comments
_CALL_PREFIX = re.compile(_BLANK + r"([^\W\d]\w*)\s*(\()?")  # a (unicode) identifier, maybe "("


def _string_end(text: str, i: int) -> int | None:
    """Index just past the Python string whose quote is at text[i]; None while unterminated."""
    quote = text[i] * 3 if text.startswith(text[i] * 3, i) else text[i]
    j = i + len(quote)
    while True:
        j = text.find(quote, j)
        if j < 0:
            return None
        backslashes = 0
        while text[j - 1 - backslashes] == "\\":
            backslashes += 1
        if backslashes % 2 == 0:
            return j + len(quote)
        j += 1


def split_list(text: str, i: int) -> tuple[list[tuple[int, int | None]], int | None, bool]:
    """The top-level items of the Python list opening at text[i]: ([(start, end or None)],
    index just past the closing bracket or None, bad brackets)."""
    stack, items, start, j, n = ["]"], [], i + 1, i + 1, len(text)
    while j < n:
        c = text[j]
        if c in "'\"":
            end = _string_end(text, j)
            if end is None:
                break
            j = end
            continue
        if c == "#":  # a comment, to the end of its line
            end = text.find("\n", j)
            if end < 0:
                break
            j = end
            continue
        if c in _OPEN:
            stack.append(_OPEN[c])
        elif c in ")]}":
            if stack.pop() != c:
                return items, None, True
            if not stack:
                items.append((start, j))
                return items, j + 1, False
        elif c == "," and len(stack) == 1:
            items.append((start, j))
            start = j + 1
        j += 1
    items.append((start, None))
    return items, None, False


def read_call(source: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one `name(key=literal, ...)`; None when it is anything else."""
    try:
        node = ast.parse(f"({source}\n)", mode="eval").body  # as inside the list: newlines, comments
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:  # sets, bytes, complex numbers, nan: not JSON
        return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None


class PythonicToolParser(ToolParser):
    name = "pythonic"
    needs_special_tokens = False

    def scan(self, text: str, final: bool) -> Scan:
        k = lead_in(text, START, "[", final)
        if k is None:
            return Scan("", [])
        if k < 0:
            return Scan(text, [])
        items, end, bad = split_list(text, k)
        if bad:
            return Scan(text, [])
        calls: list[PartialCall] = []
        for n, (start, stop) in enumerate(items):
            if stop is None:  # being written: its name, when the "(" is there
                head = _CALL_PREFIX.match(text, start)
                if head is None or head.end() < len(text) and not head.group(2):
                    if not re.fullmatch(_BLANK, text[start:]):
                        return Scan(text, [])  # not a name followed by "("
                    break
                calls.append(PartialCall(start, head.group(1) if head.group(2) else None))
                break
            if not text[start:stop].strip() and n == len(items) - 1 and n > 0:
                break  # a trailing comma: [a(), ]
            call = read_call(text[start:stop])
            if call is None:
                return Scan(text, [])
            calls.append(PartialCall(start, call[0], call[1]))
        if end is None:
            return Scan("", calls) if not final else Scan(text, [])
        if not calls:
            return Scan(text, [])
        rest = text[end:].strip()
        if rest.startswith(END):
            rest = rest[len(END):].strip()
        elif not final and rest and len(rest) == partial_suffix(rest, END):
            return Scan("", calls)
        if rest:
            return Scan(text, [])
        if not final:
            return Scan("", calls)  # text may still follow the list
        try:  # the whole list, as Python reads it (the item split above is a scan)
            whole = ast.parse(text[k:end], mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return Scan(text, [])
        if not isinstance(whole, ast.List) or len(whole.elts) != len(calls):
            return Scan(text, [])
        for call in calls:
            call.certain = True
        return Scan("", calls)


class Llama4PythonicToolParser(PythonicToolParser):
    name = "llama4_pythonic"  # vLLM's name for the same format in Llama 4's wrapper tokens
