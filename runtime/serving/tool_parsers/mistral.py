"""mistral: calls after the [TOOL_CALLS] token, in either of Mistral's two forms.

- v0.3 tokenizers (Mistral-7B-v0.3, Nemo): [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...],
  one JSON list, all of it calls or none (a missing "arguments" is {}, as in vLLM).
- v11+ tokenizers (Mistral Small 3.2, Devstral, Ministral 3): [TOOL_CALLS]NAME[ARGS]{...} per call;
  [ARGS] is absent when the detokenizer dropped it (vLLM's mistral_common path), and a
  [CALL_ID]ID between name and [ARGS] (how Mistral Small 3.2's template writes past calls) is
  read and dropped. Each call stands alone. vLLM returns a call whose arguments are bad JSON
  anyway; here, as for every parser, it stays text.

Text before the first [TOOL_CALLS] is content, and so is text after a call's JSON when more than
whitespace. Ids are 9 random alphanumerics: Mistral's templates refuse any other id when the call
comes back in the history. Streams incrementally: the name once known, then the arguments' JSON
text as it arrives.
"""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field

from vtool.runtime.serving.tool_parsers.base import (
    PartialCall,
    Scan,
    ToolParser,
    partial_suffix,
    skip_ws,
)
from vtool.runtime.serving.tool_parsers.json_scan import (
    BAD,
    loads,
    read_call_object,
    value_end,
)

BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_ID = re.compile(r"[A-Za-z0-9]*")
_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass
class _Block:
    status: str  # "good", "bad" or "open"
    calls: list[PartialCall] = field(default_factory=list)
    end: int = 0  # just past the block (good)


def _list_block(text: str, i: int, final: bool) -> _Block:
    """[{call}, {call}, ...] from text[i] ('[')."""
    block = _Block("open")
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            break
        if text[j] == "]" and not block.calls:
            return _Block("bad")  # an empty list calls nothing
        if text[j] != "{":
            return _Block("bad")
        got = read_call_object(text, j, final, args_optional=True)
        if got.status == "bad":
            return _Block("bad")
        assert got.call is not None
        block.calls.append(got.call)
        if got.status == "open":
            break
        assert got.end is not None
        j = skip_ws(text, got.end)
        if j >= len(text):
            break
        if text[j] == "]":
            for call in block.calls:
                call.certain = True
            return _Block("good", block.calls, j + 1)
        if text[j] != ",":
            return _Block("bad")
        j += 1
    return _Block("bad") if final else block


def _named_block(text: str, i: int, final: bool) -> _Block:
    """NAME[CALL_ID]ID[ARGS]{...} from text[i]; the two markers optional."""
    n = len(text)
    name = _NAME.match(text, i)
    assert name is not None
    j = skip_ws(text, name.end())
    if text.startswith(CALL_ID, j):
        j = _ID.match(text, j + len(CALL_ID)).end()  # type: ignore[union-attr]
    rest = text[j:j + len(CALL_ID)]
    if text.startswith(ARGS, j):
        j += len(ARGS)
    elif j < n and text[j] == "{":
        pass
    elif not final and (ARGS.startswith(rest) or CALL_ID.startswith(rest)) and j + len(rest) == n:
        return _Block("open", [PartialCall(key=i, name=None)])  # the name may go on
    else:
        return _Block("bad")
    if not name.group():
        return _Block("bad")
    call = PartialCall(key=i, name=name.group())
    j = skip_ws(text, j)
    if j >= n:
        return _Block("bad") if final else _Block("open", [call])
    if text[j] != "{":
        return _Block("bad")
    end = value_end(text, j, final)
    if end == BAD:
        return _Block("bad")
    call.arguments = text[j:end]
    if end is None:
        return _Block("bad") if final else _Block("open", [call])
    try:
        if not isinstance(loads(call.arguments), dict):
            return _Block("bad")
    except (ValueError, RecursionError):
        return _Block("bad")
    call.certain = True
    return _Block("good", [call], end)


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True  # [TOOL_CALLS] (and [ARGS]) are control tokens

    def new_id(self) -> str:
        return "".join(random.choices(_ALPHANUMERIC, k=9))

    def scan(self, text: str, final: bool) -> Scan:
        parts: list[str] = []
        calls: list[PartialCall] = []
        run, pos = "", 0  # run: content since the last good call
        while True:
            i = text.find(BOT, pos)
            if i < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[:len(tail) - partial_suffix(tail, BOT)]
                run += tail
                if run.strip():
                    parts.append(run)
                break
            run += text[pos:i]
            j = skip_ws(text, i + len(BOT))
            if j >= len(text):
                block = _Block("bad" if final else "open")
            elif text[j] == "[":
                block = _list_block(text, j, final)
            else:
                block = _named_block(text, j, final)
            if block.status == "good":
                if run.strip():
                    parts.append(run)
                run, pos = "", block.end
                calls.extend(block.calls)
            elif block.status == "bad":  # text, up to the next [TOOL_CALLS]
                nxt = text.find(BOT, i + len(BOT))
                if nxt < 0:
                    tail = text[i:]
                    if not final:
                        tail = tail[:len(tail) - partial_suffix(tail, BOT)]
                    parts.append(run + tail)
                    break
                run += text[i:nxt]
                pos = nxt
            else:
                if run.strip():
                    parts.append(run)
                calls.extend(block.calls)
                break
        return Scan("".join(parts), calls)
