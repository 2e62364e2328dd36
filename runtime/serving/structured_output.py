"""What grammar a chat or completion request asks for (issue 14): response_format,
structured_outputs, the older guided_* fields, or a forced tool choice, turned into one
GrammarSpec (runtime/sampling/grammar.py) as plain fields for SamplingParams.structured_outputs.

Called from the request models' validators (serving/protocol.py): a ValueError here names the
request field and becomes a 400.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from vtool.runtime.sampling.grammar import GrammarError, GrammarSpec, spec_fields, spec_from_vllm

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def request_grammar(req: Any) -> Optional[dict[str, Any]]:
    """The one grammar a request asks for; None for free text. More than one constraint, or one
    the grammar engine cannot use, is a ValueError naming the field."""
    asked: list[tuple[str, Callable[[], GrammarSpec]]] = []  # (field, builder)
    so = req.structured_outputs
    # structured_outputs' options (compact JSON) apply to response_format's JSON too, as in vLLM
    compact = not (so is not None and so.disable_any_whitespace)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format",
                      lambda: spec_from_vllm("json_object", True, any_whitespace=compact, field="response_format")))
    elif fmt is not None and fmt.type == "json_schema":
        schema = (fmt.json_schema or {}).get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise ValueError("response_format.json_schema.schema: must be a JSON schema object")
        asked.append(("response_format.json_schema",
                      lambda: spec_from_vllm("json", schema, any_whitespace=compact,
                                             field="response_format.json_schema")))
    elif fmt is not None and fmt.type == "structural_tag":
        tag = {"structures": fmt.structures or [], "triggers": fmt.triggers or []}
        asked.append(("response_format", lambda: spec_from_vllm("structural_tag", tag, field="response_format")))
    if so is not None:
        if so.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern: a custom whitespace pattern is not supported "
                             "(disable_any_whitespace gives compact JSON)")
        if so.disable_additional_properties:
            raise ValueError("structured_outputs.disable_additional_properties: not supported; set "
                             '"additionalProperties": false in the schema')
        for kind, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar),
                            ("json_object", so.json_object or None), ("structural_tag", so.structural_tag)):
            if value is not None:
                field = f"structured_outputs.{kind}"
                asked.append((field, lambda k=kind, v=value, f=field: spec_from_vllm(k, v, any_whitespace=compact,
                                                                                     field=f)))
    for name, kind in GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            asked.append((name, lambda k=kind, v=value, f=name: spec_from_vllm(k, v, field=f)))
    if not asked:
        return None
    if len(asked) > 1:
        raise ValueError(f"{asked[1][0]}: only one structured-output constraint per request; "
                         f"this one also sets {', '.join(f for f, _ in asked if f != asked[1][0])}")
    return _fields(asked[0][1])


def tool_call_grammar(req: Any) -> Optional[dict[str, Any]]:
    """tool_choice as vLLM reads it: "none" leaves the answer free; a named function or
    "required" constrain it to the call's JSON (an arguments object, or vLLM's list of
    {name, parameters}); "auto" is free text that the server's tool-call parser reads (the server
    refuses it without one, as vLLM). None when the answer is free."""
    functions = req.tool_functions()
    choice = req.effective_tool_choice
    if req.tools is None and choice != "none":
        raise ValueError(f"tool_choice: {choice!r} needs tools (vLLM: when using tool_choice, tools must be set)")
    if choice == "none" or (choice in ("auto", "required") and not functions):
        return None  # nothing to call (tools: []): the same as "none", as vLLM and OpenAI agree
    if choice == "auto":
        return None  # free text, read by the server's --tool-call-parser (serving/chat_output.py)
    if req.response_format is not None and req.response_format.type != "text" or req.structured_outputs \
            or any(getattr(req, name) for name in GUIDED):
        raise ValueError("tool_choice: a forced tool call cannot be combined with another structured-output "
                         "constraint")
    if isinstance(choice, dict):
        name = req.named_tool()
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice: a named choice is {'type': 'function', 'function': {'name': ...}}")
        if name not in functions:
            raise ValueError(f"tool_choice: no tool named {name!r} in tools ({', '.join(functions) or 'none given'})")
        schema: Any = functions[name].get("parameters", {"type": "object"})
        field = "tool_choice"
    elif choice == "required":
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [n]},
                            "parameters": fn.get("parameters", {"type": "object"})},
             # tighter than vLLM's: a call holds nothing else, so none can run on without end
             "required": ["name", "parameters"], "additionalProperties": False}
            for n, fn in functions.items()]}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        field = "tools"
    else:
        raise ValueError(f"tool_choice: unknown value {choice!r}; expected 'none', 'auto', "
                         "'required' or a named function")
    # compact JSON: a call's arguments need no free whitespace
    return _fields(lambda: spec_from_vllm("json", schema, any_whitespace=False, field=field))


def _fields(build: Callable[[], GrammarSpec]) -> dict[str, Any]:
    try:
        return spec_fields(build())
    except GrammarError as err:
        raise ValueError(str(err)) from None
