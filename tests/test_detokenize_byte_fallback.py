"""Incremental detokenization with byte-fallback tokens (<0xE2><0x82><0xAC> for one
character), on the real Mistral-7B tokenizer: deltas never show half a character and
add up to the full decode; transformers agrees on encode and decode."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from assets import mistral_tokenizer_dir
from vtool.runtime.text.tokenizer import Tokenizer

TEXTS = ["naïve café 😀 €5", "日本語のテキスト", "emoji: 🦙🧪🎉", "Ünïcödé and \u0301 combining", "plain ascii"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(mistral_tokenizer_dir())


def test_tokenizer_uses_byte_fallback_for_rare_characters(tok):
    ids = tok.encode("🦙", add_special_tokens=False)
    pieces = [tok.id_to_token(i) for i in ids]
    assert any(p.startswith("<0x") for p in pieces), pieces  # the emoji is spelled in bytes


@pytest.mark.parametrize("text", TEXTS)
def test_matches_transformers(tok, text):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(mistral_tokenizer_dir()))
    assert tok.encode(text) == hf(text)["input_ids"]
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def _deltas(tok: Tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    detok = tok.incremental(prompt_ids=prompt)
    out = [detok.push(i) for i in ids]
    return out + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_and_never_split_a_character(tok, text):
    prompt = tok.encode("Say:", add_special_tokens=True)
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _deltas(tok, prompt, ids)
    assert all("\ufffd" not in d for d in deltas), deltas
    full = tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert "".join(deltas) == full


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=24))
def test_any_text_streams_back_exactly(tok, text):
    prompt = tok.encode("x", add_special_tokens=True)
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert "".join(_deltas(tok, prompt, ids)) == full
