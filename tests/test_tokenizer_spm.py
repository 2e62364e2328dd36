"""SentencePiece vocabularies from GGUF (runtime/text/spm.py): tokenizer.ggml.model 'llama' (Llama 2,
Phi-3) and Gemma 4's 'gemma4' BPE over SentencePiece's spelling.

- llama.cpp's reference vectors (ggml-vocab-{llama-spm,phi-3,gemma-4}.gguf .inp/.out, tests/support/assets.py).
- The `sentencepiece` library as the reference on random text: no tokenizer.model ships in any package
  we can fetch, so the test writes one from the GGUF's own pieces, scores and types (a BPE ModelProto
  with byte fallback and the dummy prefix, as Llama 2's tokenizer.model is) and compares encode and decode.
- Round trips, special tokens (ids checked against llama.cpp's llama_tokenize with parse_special), BOS,
  streaming with byte-fallback tokens, malformed vocabularies and `vtool tokenize`.
"""
from __future__ import annotations

import functools
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vtool import VtoolError
from vtool.runtime.text.tokenizer import Tokenizer, TokenizerError, _gguf_fields

try:  # tests/ on sys.path (conftest) or tests as a package
    import assets
except ImportError:  # pragma: no cover
    from .support import assets

SPM_FAMILIES = ["llama-spm", "phi-3"]
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Any Unicode text but surrogates (not encodable).
TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)


@functools.lru_cache(maxsize=None)
def tok(family: str) -> Tokenizer:
    return Tokenizer.from_gguf(assets.required(assets.llama_cpp_vocab, family))


def _specials(t: Tokenizer) -> list[str]:
    return [a.content for a in t.backend.get_added_tokens_decoder().values()]


# --- llama.cpp's reference vectors -------------------------------------------------------------------

@pytest.mark.parametrize("family", SPM_FAMILIES + ["gemma-4"])
def test_matches_llama_cpp_vectors(family: str) -> None:
    vectors = assets.required(assets.llama_cpp_vectors, family)
    bad = [(text, got, want) for text, want in vectors
           if (got := tok(family).encode(text, add_special_tokens=False)) != want]
    detail = "; ".join(f"{t!r}: got {g[:10]} want {w[:10]}" for t, g, w in bad[:5])
    assert not bad, f"{len(vectors) - len(bad)}/{len(vectors)} vectors of ggml-vocab-{family} agree; {detail}"
    assert len(vectors) >= 46


def test_space_prefix_is_llama_cpps() -> None:
    """' ' is "▁▁" (259), not "▁" (29871): the space llama.cpp prepends comes on top of the text's own
    (a Metaspace pre-tokenizer drops it; that is why a naive conversion misses many vectors)."""
    t = tok("llama-spm")
    assert t.encode(" ", add_special_tokens=False) == [259]
    assert t.encode("  Hello", add_special_tokens=False) == [259, 15043]  # "▁▁", "▁Hello" as llama.cpp
    assert t.encode("Hello world", add_special_tokens=False) == [15043, 3186]


# --- the sentencepiece library as reference ----------------------------------------------------------

def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _key(num: int, wire: int) -> bytes:
    return _varint(num << 3 | wire)


def _msg(num: int, payload: bytes) -> bytes:
    return _key(num, 2) + _varint(len(payload)) + payload


def _int(num: int, value: int) -> bytes:
    return _key(num, 0) + _varint(value)


def sentencepiece_model(meta: dict[str, Any]) -> bytes:
    """A sentencepiece ModelProto (sentencepiece_model.proto, written by hand: no protobuf needed) for a
    GGUF's vocabulary: BPE, byte fallback, identity normalizer, dummy prefix, whitespace escaped. The
    token types share llama.cpp's numbering; sentencepiece wants exactly one UNKNOWN piece (Phi-3's
    [PAD...] placeholders are marked unknown too), so the others become CONTROL."""
    unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
    out = bytearray()
    for i, (piece, score, ty) in enumerate(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"],
                                               meta["tokenizer.ggml.token_type"])):
        ty = 2 if i == unk else (3 if ty == 2 else ty or 1)
        out += _msg(1, _msg(1, piece.encode()) + _key(2, 5) + struct.pack("<f", score) + _int(3, ty))
    # TrainerSpec: model_type=BPE(2), byte_fallback, unk/bos/eos/pad ids
    out += _msg(2, _int(3, 2) + _int(35, 1) + _int(40, unk) + _int(41, 1) + _int(42, 2) + _int(43, -1))
    # NormalizerSpec: name, add_dummy_prefix, remove_extra_whitespaces, escape_whitespaces
    out += _msg(3, _msg(1, b"identity") + _int(3, 1) + _int(4, 0) + _int(5, 1))
    return bytes(out)


@functools.lru_cache(maxsize=None)
def sp_reference(family: str) -> Any:
    import sentencepiece

    meta = _gguf_fields(assets.required(assets.llama_cpp_vocab, family))
    return sentencepiece.SentencePieceProcessor(model_proto=sentencepiece_model(meta))


@pytest.mark.parametrize("family", SPM_FAMILIES)
def test_sentencepiece_reference_reproduces_the_vectors(family: str) -> None:
    """The hand-written sentencepiece model is a faithful reference: it gives llama.cpp's vectors too."""
    sp = sp_reference(family)
    vectors = assets.required(assets.llama_cpp_vectors, family)
    assert [sp.encode(text) for text, _ in vectors] == [want for _, want in vectors]


@pytest.mark.parametrize("family", SPM_FAMILIES)
@SETTINGS
@given(text=TEXT)
def test_encode_and_decode_agree_with_sentencepiece(family: str, text: str) -> None:
    t, sp = tok(family), sp_reference(family)
    assume(not any(s in text for s in _specials(t)))  # sentencepiece matches no control tokens in text
    ids = t.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)
    assert t.decode(ids) == sp.decode(ids)


@pytest.mark.parametrize("text", ["   ", "a" + " " * 20 + "b", " " * 33, "\t\t  \n   x", "x\n\n\n   \n"])
@pytest.mark.parametrize("family", SPM_FAMILIES)
def test_whitespace_runs_split_as_sentencepiece(family: str, text: str) -> None:
    """Runs of spaces: the "▁▁", "▁▁▁", ... entries all share one score, so only the tie-break decides."""
    assert tok(family).encode(text, add_special_tokens=False) == sp_reference(family).encode(text)


# --- round trip and decoding -------------------------------------------------------------------------

@pytest.mark.parametrize("family", SPM_FAMILIES + ["gemma-4"])
@SETTINGS
@given(text=TEXT)
def test_round_trip(family: str, text: str) -> None:
    """decode(encode(text)) == text: the leading space the prefix adds is removed again. Text holding
    "▁" itself (it decodes to a space) or a special token's spelling is left out."""
    t = tok(family)
    assume("\u2581" not in text and not any(s in text for s in _specials(t)))
    assert t.decode(t.encode(text)) == text
    assert t.decode(t.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("family", SPM_FAMILIES + ["gemma-4"])
def test_byte_fallback_reassembles_utf8(family: str) -> None:
    t = tok(family)
    ids = t.encode("🦙 €5", add_special_tokens=False)
    assert any(t.id_to_token(i).startswith("<0x") for i in ids)  # the llama is spelled in bytes
    assert t.decode(ids) == "🦙 €5"
    assert t.decode(ids[:1]) == "\ufffd" or not t.id_to_token(ids[0]).startswith("<0x")  # half a character


# --- special tokens, BOS/EOS -------------------------------------------------------------------------

# Ids from llama.cpp's llama_tokenize(parse_special=true) on the same GGUF files.
SPECIAL_CASES = {
    "llama-spm": [("<s>[INST] Hello [/INST] Hi</s><s>[INST] x",
                   [1, 518, 25580, 29962, 15043, 518, 29914, 25580, 29962, 6324, 2, 1, 518, 25580, 29962, 921]),
                  ("a<unk>b", [263, 0, 289]), (" <s> x", [259, 1, 29871, 921]), ("x</s>  y", [921, 2, 259, 343])],
    # Phi-3: llama.cpp lets <|end|>, <|user|>, ... (not <s>, <unk>, <|endoftext|>) swallow the
    # whitespace after them, as Phi-3's tokenizer.json marks them rstrip.
    "phi-3": [("<|user|>\nHello<|end|>\n<|assistant|>\n", [32010, 15043, 32007, 32001]),
              ("<s><|system|>You are</s>x", [1, 32006, 887, 526, 2, 921]),
              ("a<|endoftext|> b", [263, 32000, 29871, 289]), ("<|end|><|end|>", [32007, 32007])],
}


@pytest.mark.parametrize("family", SPM_FAMILIES)
def test_special_tokens_match_llama_cpp(family: str) -> None:
    t = tok(family)
    for text, want in SPECIAL_CASES[family]:
        assert t.encode(text, add_special_tokens=False) == want, text


@pytest.mark.parametrize("family,bos,eos", [("llama-spm", 1, 2), ("phi-3", 1, 32000), ("gemma-4", 2, 1)])
def test_bos_eos_from_the_gguf(family: str, bos: int, eos: int) -> None:
    t = tok(family)
    assert (t.bos_id, t.eos_id) == (bos, eos)
    ids = t.encode("Hello")
    assert ids[0] == bos and ids[-1] != eos and ids[1:] == t.encode("Hello", add_special_tokens=False)
    assert t.decode(ids) == "Hello" and t.decode(ids, skip_special_tokens=False).endswith("Hello")


def test_phi3_chat_template_renders() -> None:
    t = tok("phi-3")
    prompt = t.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "<|user|>" in prompt and prompt.rstrip().endswith("<|assistant|>")
    assert t.encode(prompt, add_special_tokens=False)[0] == 1  # the template writes <s> itself


# --- streaming ---------------------------------------------------------------------------------------

def _deltas(t: Tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    detok = t.incremental(prompt_ids=prompt)
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("family", SPM_FAMILIES + ["gemma-4"])
@SETTINGS
@given(text=TEXT)
def test_streaming_never_splits_a_character(family: str, text: str) -> None:
    """Byte-fallback tokens stream without a broken character, the deltas add up to the full decode."""
    t = tok(family)
    assume(not any(s in text for s in _specials(t)))
    prompt = t.encode("Say:")
    ids = t.encode(text, add_special_tokens=False)
    deltas = _deltas(t, prompt, ids)
    assert "".join(deltas) == t.decode(prompt + ids)[len(t.decode(prompt)):]
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas), deltas


def test_streaming_holds_back_a_partial_emoji() -> None:
    t = tok("llama-spm")
    ids = t.encode("🦙!", add_special_tokens=False)  # "▁", four byte tokens, "!"
    assert [t.id_to_token(i) for i in ids[1:5]] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    detok = t.incremental(prompt_ids=t.encode("x"))
    assert [detok.push(i) for i in ids[:4]] == [" ", "", "", ""]
    assert detok.push(ids[4]) == "🦙" and detok.push(ids[5]) == "!"


# --- malformed vocabularies and `vtool tokenize` -----------------------------------------------------

def _write(path: Path, model: str = "llama", tokens: list[str] | None = None, scores: list[float] | None = None,
           types: list[int] | None = None, merges: list[str] | None = None, **flags: bool) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens or ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "▁ab"])
    if scores is not None:
        w.add_token_scores(scores)
    if types is not None:
        w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    for key, value in flags.items():
        w.add_bool(f"tokenizer.ggml.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TYPES = [2, 3, 3, 1, 1, 1, 1, 1, 1]


def test_tiny_vocab_merges_by_score(tmp_path: Path) -> None:
    # "▁ab": "▁a"+"b" or "▁"+"ab"; the better-scored pair is merged first
    by_ab = _write(tmp_path / "ab.gguf", scores=[0, 0, 0, -9, -9, -9, -5, -1, -2], types=TYPES)
    assert Tokenizer.from_gguf(by_ab).encode("ab aab", add_special_tokens=False) == [8, 6, 7]
    no_prefix = _write(tmp_path / "np.gguf", scores=[0, 0, 0, -9, -9, -9, -5, -1, -2], types=TYPES,
                       add_space_prefix=False, add_bos_token=False)
    t = Tokenizer.from_gguf(no_prefix)
    assert t.encode("ab") == [7] and t.decode([7, 6]) == "ab a"


@pytest.mark.parametrize("case,field", [
    (dict(types=TYPES), "tokenizer.ggml.scores is missing"),
    (dict(scores=[0.0] * 5, types=TYPES), "tokenizer.ggml.scores has 5 entries, expected 9"),
    (dict(scores=[0.0] * 9, types=TYPES[:3]), "tokenizer.ggml.token_type has 3 entries, expected 9"),
    (dict(scores=[0.0] * 9, types=[9] * 9), r"tokenizer.ggml.token_type\[0\] is 9"),
    (dict(model="gemma4", types=TYPES), "tokenizer.ggml.merges is missing"),
])
def test_malformed_vocab_is_refused_naming_the_field(tmp_path: Path, case: dict, field: str) -> None:
    path = _write(tmp_path / "bad.gguf", **case)
    with pytest.raises(TokenizerError, match=field) as e:
        Tokenizer.from_gguf(path)
    assert isinstance(e.value, VtoolError)


def test_vtool_tokenize_reads_an_spm_gguf(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from vtool.runtime.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Hello world 🦙", encoding="utf-8")
    gguf_path = assets.required(assets.llama_cpp_vocab, "llama-spm")
    done = CliRunner().invoke(main, ["tokenize", str(gguf_path), str(corpus)])
    assert done.exit_code == 0, done.output
    ids = tok("llama-spm").encode("Hello world 🦙")
    assert done.output.splitlines()[0] == "[" + ", ".join(map(str, ids)) + "]" and ids[0] == 1
    bad = _write(tmp_path / "bad.gguf", types=TYPES)
    done = CliRunner().invoke(main, ["tokenize", str(bad), str(corpus)])
    assert done.exit_code == 2 and "tokenizer.ggml.scores is missing" in done.output, done.output
