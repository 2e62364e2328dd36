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


def test_chat_uses_the_template(llm):
    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=3))
    want = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Hi"}])
    assert outs[0].prompt == want
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode(want, add_special_tokens=False)
