"""Formats that wrap each call in a start and an end tag (hermes, qwen3_coder):
content <tool_call>BODY</tool_call> <tool_call>BODY</tool_call> ...

Text outside the calls is content; a stretch of whitespace alone between or after calls is not
(the newline a template puts between calls). A call whose body does not parse stays in the
content as text. A body cut off by the end of the output is a call only if it is complete but
for its end tag (a stop string may have eaten it), as in vLLM.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vtool.runtime.serving.tool_parsers.base import PartialCall, Scan, partial_suffix


@dataclass
class Body:
    status: str  # "good", "bad", or "open" (may still become either)
    calls: list[PartialCall] = field(default_factory=list)


# (body, its offset in the text, closed by the end tag, cut off by the end of the output)
BodyParser = Callable[[str, int, bool, bool], Body]


def scan_tagged(text: str, final: bool, start: str, end: str, parse_body: BodyParser) -> Scan:
    parts: list[str] = []
    calls: list[PartialCall] = []
    run, pos = "", 0  # run: content since the last good call
    while True:
        i = text.find(start, pos)
        if i < 0:
            tail = text[pos:]
            if not final:
                tail = tail[:len(tail) - partial_suffix(tail, start)]
            run += tail
            if run.strip():
                parts.append(run)  # still open unless final, but only ever growing
            break
        run += text[pos:i]
        body_at = i + len(start)
        j = text.find(end, body_at)
        closed = j >= 0
        body = text[body_at:j] if closed else text[body_at:]
        if not closed and not final:
            body = body[:len(body) - partial_suffix(body, end)]
        block_end = j + len(end) if closed else len(text)
        got = parse_body(body, body_at, closed, final and not closed)
        if got.status == "good":
            if run.strip():
                parts.append(run)
            run = ""
            calls.extend(got.calls)
            pos = block_end
            if not closed:
                break
        elif got.status == "bad":
            run += text[i:block_end]  # the call's text is content, up to its end tag
            if not closed:
                parts.append(run)
                break
            pos = block_end
        else:  # open: what comes before is settled (whitespace only if the call fails)
            if run.strip():
                parts.append(run)
            calls.extend(got.calls)
            break
    return Scan("".join(parts), calls)
