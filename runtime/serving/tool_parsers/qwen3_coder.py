"""qwen3_coder: Qwen3-Coder and Qwen3.5 write each call as XML-ish text,
<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>\n</tool_call>.

A value is raw text (one newline after its tag and one before its end tag are not part of it),
turned into JSON by the type its parameter has in the request's tool schema, as vLLM's
qwen3_coder parser does: strings stay text; integer, number, boolean parsed; object and array by
json.loads, then ast.literal_eval; "null" is null for any type. A value that does not parse as
its type stays a string (vLLM turns a bad boolean into false; the text is more honest). Names and
parameters the schema does not know are kept, values as strings.

Like vLLM, a parameter also ends where the next <parameter= or </function> begins, and a function
where </tool_call> does; but a call cut off by the end of the output is not a call.

Streams the name once its tag is closed, then the arguments one parameter at a time, as each
value is complete (typed values need their whole text): '{' at once, then '"p": value' pieces, '}'
at </function>.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from vtool.runtime.serving.tool_parsers.base import (
    PartialCall,
    Scan,
    ToolParser,
    skip_ws,
)
from vtool.runtime.serving.tool_parsers.tagged import Body, scan_tagged

START, END = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
_NAME = re.compile(r"[^<>\n]+")

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def _schema_type(schema: Any) -> str:
    """The declared type, lowercased; a list of types counts as its first non-null one."""
    if not isinstance(schema, dict) or "type" not in schema:
        return "string"
    kind = schema["type"]
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind).strip().lower()


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def convert(value: str, schema: Any) -> Any:
    """The JSON value of a parameter's raw text, by its schema (None: not in the schema)."""
    if value.lower() == "null":
        return None
    if schema is None:
        return value
    kind = _schema_type(schema)
    if kind in _STRING_TYPES:
        return value
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
            return int(number) if number.is_integer() else number
        except (ValueError, OverflowError):  # inf and nan are not JSON either
            return value
    if kind in ("boolean", "bool", "binary"):
        return {"true": True, "false": False}.get(value.strip().lower(), value)
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            parsed = json.loads(value)
            if _jsonable(parsed):
                return parsed
        except ValueError:
            pass
    try:
        parsed = ast.literal_eval(value)  # e.g. Python's True, single quotes
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value
    return parsed if _jsonable(parsed) else value


def _first(body: str, markers: tuple[str, ...], at: int) -> int:
    found = [i for i in (body.find(m, at) for m in markers) if i >= 0]
    return min(found) if found else -1


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    needs_special_tokens = False  # <tool_call> is an ordinary added token in Qwen's vocab

    def scan(self, text: str, final: bool) -> Scan:
        return scan_tagged(text, final, START, END, self._parse_body)

    def _piece(self, function: str, pname: str, raw: str) -> str:
        props = (self.parameters_of(function) or {}).get("properties")
        schema = props.get(pname) if isinstance(props, dict) else None
        raw = raw.removeprefix("\n")
        raw = raw.removesuffix("\n")
        if isinstance(props, dict) and pname in props and schema is None:
            schema = {}
        return f"{json.dumps(pname, ensure_ascii=False)}: {json.dumps(convert(raw, schema), ensure_ascii=False)}"

    def _parse_body(self, body: str, offset: int, closed: bool, eof: bool) -> Body:
        """One or more <function=...> blocks, whitespace around them."""
        calls: list[PartialCall] = []
        k = 0
        while True:
            k = skip_ws(body, k)
            if k == len(body):
                if closed or eof:
                    return Body("good" if calls else "bad", calls)
                return Body("open", calls)
            if not body.startswith(FUNC, k):
                return Body("open", calls) if not (closed or eof) and FUNC.startswith(body[k:]) else Body("bad")
            gt = body.find(">", k + len(FUNC))
            name_text = body[k + len(FUNC):gt if gt >= 0 else len(body)]
            if name_text and not _NAME.fullmatch(name_text) or gt < 0 and (closed or eof):
                return Body("bad")
            if gt < 0:
                return Body("open", calls)
            function = name_text.strip()
            if not function:
                return Body("bad")
            call = PartialCall(key=offset + k, name=function)
            calls.append(call)
            pieces: list[str] = []
            m = gt + 1
            while True:
                m = skip_ws(body, m)
                call.arguments = "{" + ", ".join(pieces)
                if body.startswith(FUNC_END, m):
                    call.arguments += "}"
                    call.certain = closed or eof  # else text may still come before </tool_call>
                    k = m + len(FUNC_END)
                    break
                if body.startswith(PARAM, m):
                    pgt = body.find(">", m + len(PARAM))
                    if pgt < 0:
                        return Body("bad") if closed or eof else Body("open", calls)
                    pname = body[m + len(PARAM):pgt].strip()
                    if not pname or "<" in pname or "\n" in pname:
                        return Body("bad")
                    vend = _first(body, (PARAM_END, PARAM, FUNC_END), pgt + 1)
                    if vend < 0:
                        if not closed:  # still being written, or cut off
                            return Body("bad") if eof else Body("open", calls)
                        vend = len(body)  # </tool_call> ends it, as in vLLM
                    pieces.append(self._piece(function, pname, body[pgt + 1:vend]))
                    m = vend + len(PARAM_END) if body.startswith(PARAM_END, vend) else vend
                elif m == len(body):
                    if not closed:
                        return Body("bad") if eof else Body("open", calls)
                    call.arguments += "}"  # </tool_call> ends the function, as in vLLM
                    call.certain = True
                    k = m
                    break
                elif not (closed or eof) and (PARAM.startswith(body[m:]) or FUNC_END.startswith(body[m:])):
                    return Body("open", calls)
                else:
                    return Body("bad")  # text between parameters


class Qwen3XmlToolParser(Qwen3CoderToolParser):
    name = "qwen3_xml"  # vLLM's other name for the same format
