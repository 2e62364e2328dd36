"""Reading JSON that is still being written: where a value ends, and a call object
({"name": ..., "arguments": {...}}) as far as it goes.

Only what a later character cannot change is reported: a value is finished when its closing
bracket or quote has come (a bare number or literal when a delimiter follows it), and "bad" means
no continuation can make it valid JSON. A finished value is then checked by json.loads, which
decides. NaN and Infinity, which Python's json reads but JSON clients do not, count as bad.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vtool.runtime.serving.tool_parsers.base import PartialCall, skip_ws

BAD = -1  # value_end's answer for text that is not JSON, whatever follows
_CLOSE = {"{": "}", "[": "]"}
_SCALAR = set("0123456789+-.eEtrufalsn")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(raw: str) -> Any:
    return json.loads(raw, parse_constant=_reject_constant)


def string_end(text: str, i: int) -> int | None:
    """Index just past the JSON string opening at text[i] ('"'); None while unterminated."""
    j = i + 1
    while True:
        j = text.find('"', j)
        if j < 0:
            return None
        backslashes = 0
        while text[j - 1 - backslashes] == "\\":
            backslashes += 1
        if backslashes % 2 == 0:
            return j + 1
        j += 1


def value_end(text: str, i: int, final: bool) -> int | None:
    """Index just past the JSON value starting at text[i]; None while unfinished; BAD."""
    n = len(text)
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in _CLOSE:
        stack = [_CLOSE[c]]
        j = i + 1
        while j < n:
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in _CLOSE:
                stack.append(_CLOSE[c])
            elif c in "}]":
                if stack.pop() != c:
                    return BAD
                if not stack:
                    return j + 1
            j += 1
        return None
    if c not in _SCALAR:
        return BAD
    j = i
    while j < n and text[j] in _SCALAR:
        j += 1
    return j if j < n or final else None  # "12" may still become "123"


@dataclass
class ObjectScan:
    pairs: list[tuple[str, int, int | None]]  # (key, value start, value end or None)
    end: int | None = None  # index just past the closing brace
    bad: bool = False


def scan_object(text: str, i: int, final: bool) -> ObjectScan:
    """The top-level keys of the object opening at text[i] ('{') and where their values lie."""
    scan = ObjectScan([])
    n, j, state, key = len(text), i + 1, "first", ""
    while True:
        j = skip_ws(text, j)
        if j >= n:
            return scan
        c = text[j]
        if state in ("first", "key"):
            if c == "}" and state == "first":
                scan.end = j + 1
                return scan
            if c != '"':
                scan.bad = True
                return scan
            end = string_end(text, j)
            if end is None:
                return scan
            try:
                key = json.loads(text[j:end])
            except ValueError:
                scan.bad = True
                return scan
            j, state = end, "colon"
        elif state == "colon":
            if c != ":":
                scan.bad = True
                return scan
            j, state = j + 1, "value"
        elif state == "value":
            end = value_end(text, j, final)
            if end == BAD:
                scan.bad = True
                return scan
            scan.pairs.append((key, j, end))
            if end is None:
                return scan
            j, state = end, "next"
        else:  # after a value
            if c == "}":
                scan.end = j + 1
                return scan
            if c != ",":
                scan.bad = True
                return scan
            j, state = j + 1, "key"


@dataclass
class ObjectCall:
    status: str  # "good" (the object is finished and a call), "bad", or "open" (unfinished)
    call: PartialCall | None = None  # what is known of the call (good or open)
    end: int | None = None  # index just past the object (good)


def read_call_object(text: str, i: int, final: bool, arg_keys: tuple[str, ...] = ("arguments",),
                     args_optional: bool = False) -> ObjectCall:
    """The call object opening at text[i]: {"name": NAME, ARG_KEY: {...}} (other keys ignored).
    The arguments are the object's own text, so streamed pieces join into exactly that."""
    scan = scan_object(text, i, final)
    if scan.bad:
        return ObjectCall("bad")
    keys = [k for k, _, _ in scan.pairs]
    if any(keys.count(k) > 1 for k in ("name", *arg_keys)) or sum(k in keys for k in arg_keys) > 1:
        return ObjectCall("bad")  # which one would count is a guess
    call = PartialCall(key=i, name=None)
    for key, start, end in scan.pairs:
        if key == "name":
            if text[start] != '"':
                return ObjectCall("bad")
            if end is not None:
                try:
                    call.name = json.loads(text[start:end])
                except ValueError:  # a bad escape
                    return ObjectCall("bad")
                if not call.name:
                    return ObjectCall("bad")
        elif key in arg_keys:
            if text[start] != "{":
                return ObjectCall("bad")
            call.arguments = text[start:end]
    if scan.end is None:
        return ObjectCall("bad") if final else ObjectCall("open", call)
    try:
        obj = loads(text[i:scan.end])
    except (ValueError, RecursionError):
        return ObjectCall("bad")
    if "name" not in obj:
        return ObjectCall("bad")
    if not any(k in obj for k in arg_keys):
        if not args_optional:
            return ObjectCall("bad")
        call.arguments = "{}"
    return ObjectCall("good", call, scan.end)
