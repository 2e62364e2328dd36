"""Tool-call parsers for `tool_choice: "auto"` (vtool serve --tool-call-parser NAME): each reads
one model family's call format out of the generated text, whole (extract) or as it streams
(stream), under the names vLLM gives them.

Shared machinery is in base.py (the OpenAI shapes, the one streamer), json_scan.py (JSON still
being written) and tagged.py (calls wrapped in start/end tags); one module per format.
"""
from __future__ import annotations

from vtool.runtime.serving.tool_parsers.base import (
    StreamDelta,
    ToolCall,
    ToolCallStreamer,
    ToolExtraction,
    ToolParser,
)
from vtool.runtime.serving.tool_parsers.hermes import HermesToolParser
from vtool.runtime.serving.tool_parsers.llama3_json import (
    Llama3JsonToolParser,
    Llama4JsonToolParser,
)
from vtool.runtime.serving.tool_parsers.mistral import MistralToolParser
from vtool.runtime.serving.tool_parsers.pythonic import (
    Llama4PythonicToolParser,
    PythonicToolParser,
)
from vtool.runtime.serving.tool_parsers.qwen3_coder import (
    Qwen3CoderToolParser,
    Qwen3XmlToolParser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in (
    HermesToolParser, Llama3JsonToolParser, Llama4JsonToolParser, MistralToolParser, PythonicToolParser,
    Llama4PythonicToolParser, Qwen3CoderToolParser, Qwen3XmlToolParser)}


def tool_parser(name: str) -> type[ToolParser]:
    if name not in TOOL_PARSERS:
        from vtool import VtoolError

        raise VtoolError(f"--tool-call-parser {name!r} is not one of {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]


__all__ = ["TOOL_PARSERS", "StreamDelta", "ToolCall", "ToolCallStreamer", "ToolExtraction", "ToolParser",
           "tool_parser"]
