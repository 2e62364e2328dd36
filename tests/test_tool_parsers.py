"""Tool-call parsers for tool_choice "auto" (runtime/serving/tool_parsers/), checked against what
nobody here wrote: real chat templates (llama.cpp's collection, from the llama-cpp-python sdist)
render the tools and past calls, and the call a template writes into the history must come back
out of the parser unchanged; the real Qwen3 tokenizer cuts outputs into the pieces a server
streams; hypothesis cuts them anywhere else. A stream must join up to what extract() returns.
"""
from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from assets import llama_cpp_templates_dir, qwen3_tokenizer_dir
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from vtool import VtoolError
from vtool.runtime.serving.reasoning import reasoning_parser
from vtool.runtime.serving.tool_parsers import (
    TOOL_PARSERS,
    ToolExtraction,
    ToolParser,
    tool_parser,
)
from vtool.runtime.text.chat_template import render_chat_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "days": {"type": "integer", "description": "How many days ahead"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "description": "What to look for"},
        "max_results": {"type": "integer", "description": "At most this many"},
        "safe": {"type": "boolean", "description": "Safe search"},
        "filters": {"type": "object", "description": "Field filters"},
        "sites": {"type": "array", "items": {"type": "string"}, "description": "Only these sites"},
        "score": {"type": "number", "description": "Minimum score"}},
        "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def make(name: str, tools: list[dict] | None = TOOLS) -> ToolParser:
    return tool_parser(name)(tools)


def calls_of(got: ToolExtraction) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in got.calls]


def run_stream(parser: ToolParser, chunks: list[str], incremental: bool = True) -> tuple[str, list[dict]]:
    """Push the chunks (final on the last); (content, [{"id", "name", "arguments"}] by index)."""
    stream, content, calls = parser.stream(incremental=incremental), "", {}
    for k, chunk in enumerate(chunks):
        delta = stream.push(chunk, final=k == len(chunks) - 1)
        content += delta.content
        for d in delta.tool_calls:
            if "id" in d:  # a call's first delta: index, id, type, name, empty arguments
                assert d["index"] == len(calls) and d["type"] == "function" and d["function"]["arguments"] == ""
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, [calls[k] for k in range(len(calls))]


def assert_stream_agrees(parser: ToolParser, text: str, chunks: list[str]) -> None:
    """Streamed in these chunks, both ways, the text gives what extract() gives: the same content,
    the same calls in the same order. Incremental streaming can only differ for a call that
    turned out malformed after its first delta went out; its content still agrees."""
    assert "".join(chunks) == text
    want = parser.extract(text)
    content, calls = run_stream(parser, chunks, incremental=False)
    assert content == (want.content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == calls_of(want)
    content, calls = run_stream(parser, chunks)
    assert content == (want.content or "")
    streamed = [(c["name"], c["arguments"]) for c in calls]
    if len(streamed) == len(want.calls):
        assert [(n, json.loads(a)) for n, a in streamed] == calls_of(want)
    else:  # the extracted calls are among the streamed ones, in order
        parsed = iter([(n, _loads_or_none(a)) for n, a in streamed])
        assert all(any(s == w for s in parsed) for w in calls_of(want))


def _loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def cut(text: str, points: list[int]) -> list[str]:
    points = sorted(points)
    return [text[i:j] for i, j in zip([0, *points], [*points, len(text)])]


# -- the registry ------------------------------------------------------------------------------

def test_registry_has_vllm_names_and_refuses_others_by_listing_them():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "llama4_json", "llama4_pythonic", "mistral",
                                    "pythonic", "qwen3_coder", "qwen3_xml"]
    assert all(cls.name == name for name, cls in TOOL_PARSERS.items())
    with pytest.raises(VtoolError, match="'hermes2' is not one of hermes, llama3_json, .*qwen3_xml"):
        tool_parser("hermes2")
    # markers that are special tokens need the detokenizer to keep them (vLLM's adjust_request)
    assert {n: c.needs_special_tokens for n, c in TOOL_PARSERS.items()} == {
        "hermes": True, "llama3_json": True, "llama4_json": True, "mistral": True, "pythonic": False,
        "llama4_pythonic": False, "qwen3_coder": False, "qwen3_xml": False}


def test_tool_call_to_openai_and_ids():
    got = make("hermes").extract('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    (call,) = got.calls
    assert call.to_openai() == {"id": call.id, "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)
    ids = {c.id for c in make("mistral").extract('[TOOL_CALLS][{"name": "a", "arguments": {}}, '
                                                  '{"name": "b", "arguments": {}}]').calls}
    assert len(ids) == 2 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)  # Mistral's templates demand it


# -- each format, exact values -----------------------------------------------------------------

HERMES_TWO = ('Let me look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "search_web", "arguments": {"query": "天気 \\"today\\"", '
              '"sites": ["a.jp"]}}\n</tool_call>')


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", HERMES_TWO, "Let me look both up.\n",
     [("get_weather", {"city": "Zürich", "days": 2}), ("search_web", {"query": '天気 "today"', "sites": ["a.jp"]})]),
    ("hermes", "No tools needed: 4.", "No tools needed: 4.", []),
    ("hermes", '<tool_call>{"name":"f","arguments":{}}</tool_call>\n\nDone.', "\n\nDone.", [("f", {})]),
    ("hermes", '<tool_call>\n{"arguments": {"q": 1}, "name": "f"}\n</tool_call>', None, [("f", {"q": 1})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),  # end tag eaten
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", ('<|python_tag|>{"name": "a", "parameters": {"x": [1, {"y": "}"}]}}; '
                    '{"name": "b", "arguments": {}}'), None, [("a", {"x": [1, {"y": "}"}]}), ("b", {})]),
    ("llama3_json", '\n {"name": "a", "parameters": {}}\n', None, [("a", {})]),
    ("llama3_json", 'Sure: {"name": "a", "parameters": {}}', 'Sure: {"name": "a", "parameters": {}}', []),
    ("llama3_json", '{"name": "Ada", "born": 1815}', '{"name": "Ada", "born": 1815}', []),  # JSON, not a call
    ("mistral", ('Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                '{"name": "search_web", "arguments": {"query": "q"}, "id": "abcdefghi"}]'), "Checking. ",
     [("get_weather", {"city": "Rome"}), ("search_web", {"query": "q"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]search_web[ARGS]{"query": "q"}', None,
     [("get_weather", {"city": "Rome"}), ("search_web", {"query": "q"})]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Rome"}', None, [("get_weather", {"city": "Rome"})]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome"}', None,
     [("get_weather", {"city": "Rome"})]),
    ("mistral", '[TOOL_CALLS][{"name": "now"}]', None, [("now", {})]),
    ("pythonic", '[get_weather(city="SF", unit="celsius"), search_web(query=\'a, b\', sites=["x"], safe=True)]',
     None, [("get_weather", {"city": "SF", "unit": "celsius"}),
            ("search_web", {"query": "a, b", "sites": ["x"], "safe": True})]),
    ("pythonic", '<|python_start|>[f(n=-1.5, t=(1, 2), d={"k": None}, s="""x]y""")]<|python_end|>', None,
     [("f", {"n": -1.5, "t": [1, 2], "d": {"k": None}, "s": "x]y"})]),
    ("pythonic", "[f(),\n g(a=1),\n]", None, [("f", {}), ("g", {"a": 1})]),
    ("pythonic", "[f(a=1),  # not ) or ]\n g(b='#')]", None, [("f", {"a": 1}), ("g", {"b": "#"})]),
    ("pythonic", "[météo(ville='Genève')]", None, [("météo", {"ville": "Genève"})]),
    ("pythonic", "[1] is a citation.", "[1] is a citation.", []),
    ("pythonic", "[f(x=y)]", "[f(x=y)]", []),  # a name, not a literal
    ("pythonic", "[f(1)]", "[f(1)]", []),  # positional
    ("pythonic", "[f(x={1, 2})]", "[f(x={1, 2})]", []),  # a set has no JSON
    ("pythonic", "[]", "[]", []),
    ("pythonic", "[f()] and then text", "[f()] and then text", []),
])
def test_extract(name, text, content, calls):
    got = make(name).extract(text)
    assert (got.content, calls_of(got)) == (content, calls)
    assert_stream_agrees(make(name), text, list(text))


QWEN3_CODER_TWO = """I'll search first.

<tool_call>
<function=search_web>
<parameter=query>
line one
  indented <b>bold</b> & "quoted"
</parameter>
<parameter=max_results>
5
</parameter>
<parameter=safe>
False
</parameter>
<parameter=filters>
{"lang": "fr", "year": [2020, 2021]}
</parameter>
<parameter=sites>
['a.fr', "b.fr"]
</parameter>
<parameter=score>
0.75
</parameter>
</function>
</tool_call>
<tool_call>
<function=get_weather>
<parameter=city>
null
</parameter>
<parameter=days>
three
</parameter>
<parameter=extra>
42
</parameter>
</function>
</tool_call>"""


def test_qwen3_coder_converts_values_by_the_tool_schema():
    got = make("qwen3_coder").extract(QWEN3_CODER_TWO)
    assert got.content == "I'll search first.\n\n"
    assert calls_of(got) == [
        ("search_web", {"query": 'line one\n  indented <b>bold</b> & "quoted"', "max_results": 5, "safe": False,
                        "filters": {"lang": "fr", "year": [2020, 2021]}, "sites": ["a.fr", "b.fr"], "score": 0.75}),
        # null is null for any type; a value that is not its type, or a parameter the schema
        # lacks, stays the string the model wrote
        ("get_weather", {"city": None, "days": "three", "extra": "42"})]
    # without the request's tools nothing is typed
    untyped = make("qwen3_coder", tools=None).extract(QWEN3_CODER_TWO)
    assert calls_of(untyped)[0][1]["max_results"] == "5" and calls_of(untyped)[1][1]["city"] is None
    # vLLM's lenient ends: a parameter closed by the next one, a function by </tool_call>
    lenient = make("qwen3_coder").extract("<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n"
                                          "<parameter=days>\n4\n</tool_call>")
    assert calls_of(lenient) == [("get_weather", {"city": "Lima", "days": 4})]
    assert make("qwen3_xml").extract(QWEN3_CODER_TWO).calls[1].name == "get_weather"


MALFORMED = {
    "hermes": ['<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',  # bad JSON
               '<tool_call>\n{"name": "f", "arguments": {"a": 1}} trailing\n</tool_call>',
               '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',  # arguments not an object
               '<tool_call>\n{"name": "f", "arguments": {"a": NaN}}\n</tool_call>',
               '<tool_call>\n{"name": "f"}\n</tool_call>',
               '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',
               '<tool_call>\n{"name": ["f"], "arguments": {}}\n</tool_call>',
               '<tool_call>\n{"name": "f", "name": "g", "arguments": {}}\n</tool_call>',
               'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'],  # cut by max_tokens
    "qwen3_coder": ["<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
                    "<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>",
                    "<tool_call>\n<function=get_we",
                    "<tool_call>\nget_weather(city='x')\n</tool_call>"],
    "llama3_json": ['{"name": "f", "parameters": {"a": 1}',
                    '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {',
                    '{"name": "f", "parameters": {"a": 1}, "arguments": {}}',
                    '{"name": "f", "parameters": {"a": 1}} and some words'],
    "mistral": ['[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arg',
                '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}},]',
                '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"',
                '[TOOL_CALLS]get weather[ARGS]{}',
                '[TOOL_CALLS]'],
    "pythonic": ['[get_weather(city="SF"), search_web(query="x"',
                 "[get_weather(city=f'{x}')]",
                 "[get_weather(city='SF') + 1]",
                 "[os.system(cmd='ls')]",
                 "[f(**kw)]"],
}


@pytest.mark.parametrize("name, text", [(n, t) for n, ts in MALFORMED.items() for t in ts])
def test_malformed_or_cut_off_calls_are_text(name, text):
    got = make(name).extract(text)
    assert (got.content, got.calls) == (text, [])
    assert_stream_agrees(make(name), text, list(text))


def test_a_bad_call_stays_text_where_it_stood_and_the_good_ones_stay_calls():
    good = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "b", "arguments": {oops}}\n</tool_call>'
    got = make("hermes").extract(f"Hi.\n{good}\n{bad}\n{good}")
    assert got.content == f"Hi.\n\n{bad}\n" and [c.name for c in got.calls] == ["a", "a"]
    got = make("mistral").extract('[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{oops}[TOOL_CALLS]c[ARGS]{}')
    assert got.content == "[TOOL_CALLS]b[ARGS]{oops}" and [c.name for c in got.calls] == ["a", "c"]


# -- streaming ---------------------------------------------------------------------------------

def test_text_that_may_become_a_marker_is_held_back():
    stream = make("hermes").stream()
    assert stream.push("Hello <tool").content == "Hello "
    assert stream.push("box> there").content == "<toolbox> there"
    stream = make("mistral").stream()
    assert stream.push("Ok [TOOL_").content == "Ok "
    delta = stream.push('CALLS]get_weather[AR')
    assert (delta.content, delta.tool_calls) == ("", [])  # the name may still go on
    delta = stream.push('GS]{"city": "Ro')
    assert [d["function"] for d in delta.tool_calls] == [{"name": "get_weather", "arguments": ""},
                                                         {"arguments": '{"city": "Ro'}]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", delta.tool_calls[0]["id"])
    stream = make("llama3_json").stream()
    assert stream.push("<|python").content == ""
    assert stream.push("_ta").content == ""
    assert stream.push("x is a tag").content == "<|python_tax is a tag"
    stream = make("hermes").stream()
    assert stream.push("\n\n").content == ""  # whitespace alone may end up as no content
    assert stream.push("Hi").content == "\n\nHi"


def test_arguments_stream_as_they_come_and_calls_whole_when_not_incremental():
    text = 'A\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    chunks = ["A\n<tool_call>\n{\"name\": \"get_", "weather\", \"argu", "ments\": {\"ci", "ty\": \"Paris\"}}",
              "\n</tool_call>"]
    assert "".join(chunks) == text
    stream = make("hermes").stream()
    deltas = [stream.push(c, final=k == len(chunks) - 1) for k, c in enumerate(chunks)]
    assert [d.content for d in deltas] == ["A\n", "", "", "", ""]
    assert [[x["function"] for x in d.tool_calls] for d in deltas] == [
        [], [{"name": "get_weather", "arguments": ""}], [{"arguments": '{"ci'}], [{"arguments": 'ty": "Paris"}'}], []]
    stream = make("hermes").stream(incremental=False)
    deltas = [stream.push(c, final=k == len(chunks) - 1) for k, c in enumerate(chunks)]
    assert [[x["function"] for x in d.tool_calls] for d in deltas] == [
        [], [], [], [], [{"name": "get_weather", "arguments": ""}, {"arguments": '{"city": "Paris"}'}]]


# hypothesis: well-formed outputs of every format, from random calls, cut anywhere

TRICKY = st.lists(st.sampled_from(list("ab é字🦙\"'\\{}[](),;:=<>/\n\t#") + ["</tool", "call>", "[TOOL", "ARGS]"]),
                  max_size=12).map("".join)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False)
    | TRICKY, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY, inner, max_size=3), max_leaves=6)
ARGS = st.dictionaries(st.sampled_from(["city", "q", "n", "x_1", "données"]), JSON_VALUES, max_size=4)
NAMES = st.sampled_from(["get_weather", "search_web", "f", "tool_2", "a-b"])
CONTENT = st.lists(st.sampled_from(list("ab é\n<[{}]>") + ["<tool", "[TOOL", "Sure. "]), max_size=10).map("".join)
MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<function=", "</function>",
           "<parameter=", "</parameter>")


def dumps(value: Any, compact: bool) -> str:
    return json.dumps(value, ensure_ascii=compact, separators=(",", ":") if compact else None)


def py_literal(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{py_literal(k)}: {py_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(py_literal(v) for v in value) + "]"
    return repr(value)


def render(name: str, calls: list[tuple[str, dict]], pre: str, post: str, compact: bool) -> tuple[str, str | None]:
    """An output in the format, and the content extract() must find in it."""
    want = (pre if pre.strip() else "") + (post if post.strip() else "")
    if name == "hermes":
        body = "\n".join(f"<tool_call>\n{dumps({'name': n, 'arguments': a}, compact)}\n</tool_call>" for n, a in calls)
        return pre + body + post, want or None
    if name == "mistral":
        if compact:  # v0.3: one JSON list
            return pre + "[TOOL_CALLS]" + dumps([{"name": n, "arguments": a} for n, a in calls], False) + post, \
                want or None
        return pre + "".join(f"[TOOL_CALLS]{n}[ARGS]{dumps(a, False)}" for n, a in calls) + post, want or None
    if name == "llama3_json":
        tag = "<|python_tag|>" if compact else ""
        return tag + "; ".join(dumps({"name": n, "parameters": a}, compact) for n, a in calls), None
    if name == "pythonic":
        items = ", ".join(f"{n.replace('-', '_')}({', '.join(f'{k}={py_literal(v)}' for k, v in a.items() if k.isidentifier())})"
                          for n, a in calls)
        return ("<|python_start|>" if compact else "") + f"[{items}]", None
    raise AssertionError(name)


def expected_calls(name: str, calls: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    if name == "pythonic":
        return [(n.replace("-", "_"), {k: v for k, v in a.items() if k.isidentifier()}) for n, a in calls]
    return calls


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["hermes", "mistral", "llama3_json", "pythonic"]),
       calls=st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3), pre=CONTENT, post=CONTENT,
       compact=st.booleans(), data=st.data())
def test_any_cut_of_a_well_formed_output_streams_to_its_calls(name, calls, pre, post, compact, data):
    if name in ("llama3_json", "pythonic"):
        pre = post = ""  # the calls are the whole output
    assume(not any(m in pre + post for m in MARKERS) and not post.lstrip().startswith(("[", "{")))
    text, content = render(name, calls, pre, post, compact)
    if name in ("hermes", "mistral"):  # args text must not hold the format's own markers
        assume(all(m not in dumps(a, compact) + dumps(a, False) for _, a in calls for m in MARKERS))
    parser = make(name)
    got = parser.extract(text)
    assert (got.content, calls_of(got)) == (content, expected_calls(name, calls))
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert_stream_agrees(parser, text, cut(text, points))


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["hermes", "mistral", "llama3_json", "pythonic", "qwen3_coder"]),
       calls=st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3), pre=CONTENT, compact=st.booleans(),
       data=st.data())
def test_any_cut_off_or_damaged_output_streams_to_what_extract_says(name, calls, pre, compact, data):
    """Outputs cut short at a random point (max_tokens) or with a random character dropped:
    whatever extract() makes of them, a stream of any cut agrees (and nothing raises)."""
    if name == "qwen3_coder":
        text = pre + "".join(qwen3_coder_call(n, a) for n, a in calls)
    else:
        text = render(name, calls, pre, "", compact)[0]
    stop = data.draw(st.integers(0, len(text)))
    text = text[:stop] if data.draw(st.booleans()) else text[:stop] + text[stop + 1:]
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    assert_stream_agrees(make(name), text, cut(text, points))


def qwen3_coder_call(name: str, args: dict) -> str:
    """As Qwen3-Coder's template writes a call: each value raw, objects and lists as JSON."""
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
                     "</parameter>\n" for k, v in args.items())
    return f"\n<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


QWEN3_CODER_VALUES = {
    "query": TRICKY, "max_results": st.integers(-10**6, 10**6), "safe": st.booleans(),
    "score": st.floats(-1e6, 1e6, allow_nan=False).map(lambda f: round(f, 3)),
    "filters": st.dictionaries(TRICKY, JSON_VALUES, max_size=3), "sites": st.lists(TRICKY, max_size=3)}


@settings(max_examples=150, deadline=None)
@given(args=st.fixed_dictionaries({}, optional=QWEN3_CODER_VALUES), pre=CONTENT, data=st.data())
def test_any_cut_of_a_qwen3_coder_output_streams_to_its_typed_calls(args, pre, data):
    assume(not any(m in pre for m in MARKERS))
    assume(not any(m in json.dumps(args, ensure_ascii=False) for m in MARKERS))
    # a string that reads as null or that a template's newline would eat cannot round-trip
    assume(all(not isinstance(v, str) or v.lower() != "null" for v in args.values()))
    text = pre + qwen3_coder_call("search_web", args) + qwen3_coder_call("get_weather", {"city": "Nice"})
    parser = make("qwen3_coder")
    got = parser.extract(text)
    assert (got.content, calls_of(got)) == ((pre + "\n") if pre.strip() else None,
                                            [("search_web", args), ("get_weather", {"city": "Nice"})])
    assert_stream_agrees(parser, text, cut(text, data.draw(st.lists(st.integers(0, len(text)), max_size=8))))


# -- the real Qwen3 tokenizer, token by token --------------------------------------------------

@pytest.fixture(scope="module")
def qwen3() -> Tokenizer:
    return Tokenizer.from_file(str(qwen3_tokenizer_dir() / "tokenizer.json"))


def token_chunks(tok: Tokenizer, text: str) -> list[str]:
    """The text deltas a server sends as it decodes one token at a time (an incomplete UTF-8
    character waits for the token that finishes it)."""
    ids = tok.encode(text, add_special_tokens=False).ids
    chunks, sent = [], ""
    for k in range(1, len(ids) + 1):
        now = tok.decode(ids[:k], skip_special_tokens=False)
        if now.endswith("\ufffd") and k < len(ids):
            continue
        assert now.startswith(sent)
        chunks.append(now[len(sent):])
        sent = now
    assert sent == text
    return chunks


@pytest.mark.parametrize("name, text", [("hermes", HERMES_TWO), ("qwen3_coder", QWEN3_CODER_TWO),
                                        *[(n, t) for n in ("hermes", "qwen3_coder") for t in MALFORMED[n]]])
def test_qwen3_tokens_stream_to_the_same_calls(qwen3, name, text):
    chunks = token_chunks(qwen3, text)
    if "<tool_call>" in text:  # an added token: the marker arrives whole, as a server sees it
        assert "<tool_call>" in chunks
    assert_stream_agrees(make(name), text, chunks)


# -- real chat templates -----------------------------------------------------------------------

TEMPLATES = {  # file in llama.cpp's models/templates -> (parser, end of the assistant turn)
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": ("hermes", "<|im_end|>"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": ("hermes", "<|im_end|>"),
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("hermes", "<|im_end|>"),
    "Qwen-QwQ-32B.jinja": ("hermes", "<|im_end|>"),
    "Qwen-Qwen3-0.6B.jinja": ("hermes", "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("llama3_json", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("llama3_json", "<|eot_id|>"),
    "meta-llama-Llama-3.3-70B-Instruct.jinja": ("llama3_json", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("mistral", "</s>"),  # [TOOL_CALLS][{...}] (v3)
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("mistral", "</s>"),  # [TOOL_CALLS]f[CALL_ID]id[ARGS]{...}
    "unsloth-mistral-Devstral-Small-2507.jinja": ("mistral", "</s>"),  # [TOOL_CALLS]f[ARGS]{...}
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": ("mistral", "</s>"),
    "LFM2.5-8B-A1B.jinja": ("pythonic", "<|im_end|>"),  # inside LFM's own <|tool_call_start|> tokens
    "Qwen3-Coder.jinja": ("qwen3_coder", "<|im_end|>"),
    "Qwen3.5-4B.jinja": ("qwen3_coder", "<|im_end|>"),
}
OPENS_THINK = {"Qwen-QwQ-32B.jinja", "Qwen3.5-4B.jinja"}  # their generation prompt ends in <think>
SINGLE_CALL = {"llama3_json"}  # the Llama templates refuse more than one call per turn
CONTENT_BEFORE_CALLS = {"Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-QwQ-32B.jinja", "Qwen-Qwen3-0.6B.jinja",
                        "Qwen3-Coder.jinja", "Qwen3.5-4B.jinja", "unsloth-mistral-Devstral-Small-2507.jinja",
                        "mistralai-Ministral-3-14B-Reasoning-2512.jinja", "LFM2.5-8B-A1B.jinja"}
PAST_CALLS = [("get_weather", {"city": "São Paulo", "days": 3, "unit": "celsius"}),
              ("search_web", {"query": "weather \"radar\" 東京", "max_results": 2, "safe": True,
                              "sites": ["a.br", "b.jp"]})]


def history(template: str, parser: str) -> list[dict]:
    calls = PAST_CALLS[:1] if parser in SINGLE_CALL else PAST_CALLS
    ids = [f"call{k:05d}" for k in range(len(calls))]  # 9 alphanumerics: Mistral's templates insist
    content = "Let me check that." if template in CONTENT_BEFORE_CALLS else ""
    # arguments as a dict, as vLLM hands them to templates (they iterate or tojson them)
    assistant = {"role": "assistant", "content": content, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in zip(ids, calls)]}
    tools = [{"role": "tool", "tool_call_id": i, "name": n, "content": '{"ok": true}'} for i, (n, _) in zip(ids, calls)]
    return [{"role": "user", "content": "Weather in São Paulo, and search the radar?"}, assistant, *tools]


def render_template(file: str, messages: list[dict], **kwargs: Any) -> str:
    template = (llama_cpp_templates_dir() / file).read_text()
    return render_chat_template(template, messages, tools=TOOLS, bos_token="<s>", eos_token="</s>",
                                date_string="01 Dec 2025", **kwargs)


def assistant_turn(file: str, end: str) -> str:
    """The text the template puts where the model's answer goes, for the history's tool calls:
    what follows the prompt (with its generation prompt) up to the end of the turn."""
    parser = TEMPLATES[file][0]
    messages = history(file, parser)
    thinking = {"enable_thinking": True} if file in OPENS_THINK else {}
    prompt = render_template(file, messages[:1], add_generation_prompt=True, **thinking)
    full = render_template(file, messages, **thinking)
    if file in OPENS_THINK:  # the prompt opens <think>; the history's turn has none or an empty one
        assert prompt.endswith("<|im_start|>assistant\n<think>\n")
        prompt = prompt[:-len("<think>\n")]
    assert full.startswith(prompt), file
    turn = full[len(prompt):]
    assert end in turn, file
    return turn[:turn.index(end)]


@pytest.mark.parametrize("file", sorted(TEMPLATES))
def test_real_template_shows_the_tools(file):
    prompt = render_template(file, history(file, TEMPLATES[file][0])[:1], add_generation_prompt=True)
    for tool in TOOLS:
        assert tool["function"]["name"] in prompt and tool["function"]["description"] in prompt
    assert "How many days ahead" in prompt  # the parameters too


@pytest.mark.parametrize("file", sorted(TEMPLATES))
def test_a_call_the_real_template_writes_parses_back(file):
    """The template's own rendering of a past call is the model's call format: parsed back, it is
    the same call (names, arguments, their order, the content before them)."""
    name, end = TEMPLATES[file]
    turn = assistant_turn(file, end)
    if file in OPENS_THINK:
        _, turn = reasoning_parser("qwen3").split(turn)  # as the server splits it off
        assert turn is not None
    if file == "LFM2.5-8B-A1B.jinja":  # LFM's wrapper tokens around a pythonic list (vLLM's lfm2 parser)
        assert turn.startswith("Let me check that.<|tool_call_start|>") and turn.endswith("<|tool_call_end|>")
        turn = turn[len("Let me check that.<|tool_call_start|>"):-len("<|tool_call_end|>")]
    want = PAST_CALLS[:1] if name in SINGLE_CALL else PAST_CALLS
    parser = make(name)
    got = parser.extract(turn)
    assert calls_of(got) == want, turn
    wants_content = file in CONTENT_BEFORE_CALLS and name != "pythonic"
    assert (got.content or "").strip() == ("Let me check that." if wants_content else ""), turn
    assert_stream_agrees(parser, turn, list(turn))


REALISTIC = [  # outputs as these models write them (format from each model card / template)
    ("hermes", ('I\'ll check the weather for you.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Tokyo", "unit": "celsius"}}\n</tool_call>')),
    ("hermes", ('<tool_call>\n{"name": "search_web", "arguments": {"query": "best ramen near Shinjuku", '
               '"max_results": 3, "filters": {"open_now": true}}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 1}}\n</tool_call>')),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Berlin", "unit": "celsius"}}'),
    ("llama3_json", ('<|python_tag|>{"name": "search_web", "parameters": {"query": "Berlin events", '
                    '"max_results": 5}}')),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon", "days": 2}}]'),
    ("mistral", '[TOOL_CALLS]search_web[ARGS]{"query": "Lyon museums", "sites": ["lyon.fr"], "score": 0.5}'),
    ("pythonic", '[get_weather(city="Lisbon", unit="celsius"), search_web(query="Lisbon trams", safe=True)]'),
    ("qwen3_coder", ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")),
    ("qwen3_coder", QWEN3_CODER_TWO.split("<tool_call>")[0] + "<tool_call>" + QWEN3_CODER_TWO.split("<tool_call>")[1]),
]


@pytest.mark.parametrize("name, text", REALISTIC)
def test_realistic_outputs_give_calls_that_fit_the_tool_schema(name, text):
    got = make(name).extract(text)
    assert got.calls and text.count("get_weather") + text.count("search_web") == len(got.calls)
    for call in got.calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert_stream_agrees(make(name), text, list(text))
