"""Structured output through `vtool serve` and the openai client (issue 14, first part): the
grammar does all the work on the tiny random model, so every answer follows it; a bad grammar
is a 400 naming its field, and the server keeps serving."""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from test_engine_core import Server  # the same `vtool serve` process fixture

MODEL = "tiny-chat"
USER = [{"role": "user", "content": "Describe a city."}]
# JSON without free whitespace between tokens: the random model would otherwise pad forever
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


class City(BaseModel):  # bounded: the grammar forces the object to close
    size: Literal["small", "big"]
    rank: int = Field(ge=1, le=9)
    coastal: bool


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = Server(tiny_model_dir, tmp_path_factory.mktemp("so") / "server.log")
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model(client):
    done = client.chat.completions.parse(model=MODEL, messages=USER, response_format=City, max_tokens=200,
                                         extra_body=COMPACT)
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and done.choices[0].finish_reason == "stop"


def test_json_schema_streamed_and_not(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    whole = client.chat.completions.create(model=MODEL, messages=USER, response_format=fmt, max_tokens=100,
                                           extra_body=COMPACT)
    body = json.loads(whole.choices[0].message.content)
    assert set(body) == {"ok", "n"} and isinstance(body["ok"], bool) and body["n"] in (1, 2, 3)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=USER, response_format=fmt, max_tokens=100, stream=True, extra_body=COMPACT)
        if c.choices]
    assert json.loads("".join(pieces)).keys() == {"ok", "n"}


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"structured_outputs": {"grammar": 'root ::= "go " ("left" | "right")'}}, lambda t: t in ("go left", "go right")),
])
def test_completions_follow_the_grammar(client, extra, check):
    for seed in range(3):
        done = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, seed=seed, temperature=1.0,
                                         extra_body=extra)
        assert check(done.choices[0].text), done.choices[0].text
        assert done.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, field", [
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
     "response_format.json_schema"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),
])
def test_a_bad_grammar_is_a_400_and_the_server_keeps_serving(server, client, extra, field):
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None


def test_the_python_api_takes_vllms_structured_outputs(tiny_model_dir):
    from vtool import LLM
    from vtool.runtime.sampling.params import SamplingParams, SamplingParamsError

    llm = LLM(model=tiny_model_dir, max_model_len=256)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs={"choice": ["left", "right"]})
    out = llm.generate(["Turn", "Go"], params)
    assert [o.outputs[0].text in ("left", "right") for o in out] == [True, True]
    with pytest.raises(SamplingParamsError, match="structured_outputs.regex"):
        SamplingParams(structured_outputs={"regex": "(("})


def test_vtool_run_takes_a_regex_and_refuses_two_constraints(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "vtool.toolchain.cli", "run", "--model", str(tiny_model_dir),
                               "--prompt", "Code:", "--max-tokens", "20", "--max-model-len", "256", *args],
                              capture_output=True, text=True, timeout=300)

    done = run("--regex", "[0-9]{3}-[a-z]{2}")
    assert done.returncode == 0, done.stderr
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", done.stdout.strip()), done.stdout
    refused = run("--regex", "a", "--choice", "a,b")
    assert refused.returncode == 2 and "one of --json-schema, --regex, --choice" in refused.stderr
