"""`from vtool import LLM, SamplingParams`, used the way vLLM's offline API is used."""
from __future__ import annotations

import pytest

from vtool import LLM, SamplingParams, VtoolError


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=tiny_model_dir, max_model_len=256)


def test_generate_keeps_prompt_order_and_counts(llm):
    prompts = ["Hello, my name is", "The president of the United States is", [1, 2, 3]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    assert [o.prompt for o in outs] == ["Hello, my name is", "The president of the United States is", None]
    assert all(len(o.outputs[0].token_ids) == 7 and o.outputs[0].finish_reason == "length" for o in outs)
    again = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    assert again[0].outputs[0].text == outs[0].outputs[0].text
    assert llm.get_tokenizer().decode(outs[0].outputs[0].token_ids) == outs[0].outputs[0].text


def test_n_and_per_prompt_params(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4),
                                     SamplingParams(temperature=0, max_tokens=2, logprobs=2)])
    assert len(outs[0].outputs) == 3 and len(outs[1].outputs) == 1
    assert len(outs[1].outputs[0].logprobs) == 2
    with pytest.raises(VtoolError, match="got 3 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()] * 3)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_cumulative_logprob_only_when_logprobs_are_asked(llm, temperature):
    # vLLM v1: the sum of the chosen tokens' logprobs with logprobs (0 included), None without
    # (then no logsumexp is computed for it).
    kw = dict(temperature=temperature, seed=3, max_tokens=6, ignore_eos=True)
    plain, zero, two = (llm.generate("The capital of France is", SamplingParams(**kw, logprobs=n))[0].outputs[0]
                        for n in (None, 0, 2))
    assert plain.cumulative_logprob is None and plain.logprobs is None
    assert plain.token_ids == zero.token_ids == two.token_ids  # asking for logprobs changes no token
    for out in (zero, two):
        chosen = [step[t].logprob for step, t in zip(out.logprobs, out.token_ids)]
        assert len(chosen) == 6 and all(lp <= 0.0 for lp in chosen)
        assert out.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-9)
    assert zero.cumulative_logprob == pytest.approx(two.cumulative_logprob, abs=1e-6)


def test_chat_uses_the_template(llm):
    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=3))
    want = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Hi"}])
    assert outs[0].prompt == want
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode(want, add_special_tokens=False)


def test_chat_hands_tools_to_the_template_and_a_grammar_makes_the_call(tiny_model_dir, tmp_path):
    """LLM.chat(tools=...) renders them with the model's template (Qwen3's real one here, from
    llama.cpp's collection), and structured_outputs constrains the answer to a call's arguments."""
    import json
    import shutil

    import jsonschema
    from assets import llama_cpp_templates_dir

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text((llama_cpp_templates_dir() / "Qwen-Qwen3-0.6B.jinja").read_text())
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                               "parameters": schema}}]
    llm = LLM(model=model, max_model_len=512)
    out = llm.chat([{"role": "user", "content": "Weather in Paris?"}],
                   SamplingParams(temperature=0, max_tokens=30, structured_outputs={"json": schema, "disable_any_whitespace": True}), tools=tools)[0]
    assert "<tools>" in out.prompt and '"name": "get_weather"' in out.prompt
    jsonschema.validate(json.loads(out.outputs[0].text), schema)
    plain = llm.chat([{"role": "user", "content": "Weather in Paris?"}], SamplingParams(max_tokens=1))[0]
    assert "<tools>" not in plain.prompt
