"""SentencePiece vocabularies from GGUF (`tokenizer.ggml.model` "llama": Llama 1/2, Mistral v0.1-v0.3,
Phi-3, TinyLlama, Gemma 1-3), built on the HF `tokenizers` library.

What llama.cpp does (llama-vocab.cpp, llm_tokenizer_spm) and how it maps onto `tokenizers`:

- Control, unknown and user-defined tokens are cut out of the text first, as whole pieces
  (`tokenizers`' added tokens, matched on the raw text).
- Each piece of text between them gets a leading space when `tokenizer.ggml.add_space_prefix`
  (default true) says so, then every space becomes "▁" (a `Prepend` + `Replace` normalizer; the
  `Metaspace` pre-tokenizer would not do here: it prepends no "▁" to text that already starts with
  a space, so " " would become "▁" instead of llama.cpp's "▁▁").
- The whole piece is one word (no pre-tokenizer): starting from single characters, the adjacent pair
  whose concatenation is the vocabulary entry with the highest score is merged, again and again.
  A `tokenizers` BPE model does the same walk when its merge list holds every way to split each
  entry into two entries, ordered by the entry's score (`spm_merges`). Where scores tie, llama.cpp
  merges the leftmost pair first; the order here prefers the longer left part, which gives the same
  pieces for the tied entries real vocabularies have (Llama's runs of "▁", all scored -1e9).
- Characters left that are no entry are spelled as <0xXX> byte tokens (`byte_fallback`).

Decoding: "▁" -> " ", runs of byte tokens back into UTF-8 (`ByteFallback` + `Fuse`), and the one
leading space the prefix added is stripped (`Strip`), as transformers' Llama tokenizer does.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from .tokenizer import TokenizerError

# llama.cpp's token types (tokenizer.ggml.token_type)
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)
SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space


class SpmVocabError(TokenizerError):
    """A SentencePiece vocabulary that cannot be built: names the GGUF field at fault."""


def _array(path: Path, meta: Mapping[str, Any], key: str, n: int, kind: type | tuple[type, ...],
           required: bool) -> list[Any] | None:
    value = meta.get(key)
    if value is None:
        if required:
            raise SpmVocabError(f"{path}: {key} is missing; a SentencePiece ('llama') vocabulary needs it "
                                f"({n} entries, one per token)")
        return None
    if not isinstance(value, list) or len(value) != n:
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        raise SpmVocabError(f"{path}: {key} has {got}, expected {n} (one per token in tokenizer.ggml.tokens)")
    bad = next((i for i, v in enumerate(value) if not isinstance(v, kind) or isinstance(v, bool)), None)
    if bad is not None:
        raise SpmVocabError(f"{path}: {key}[{bad}] is {value[bad]!r}, not a number")
    return value


def read_spm_vocab(path: Path, meta: Mapping[str, Any]) -> tuple[list[str], list[float], list[int]]:
    """tokens, scores and token types, checked; an empty token is renamed as llama.cpp does."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise SpmVocabError(f"{path}: tokenizer.ggml.tokens must be a non-empty list of strings")
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    n = len(tokens)
    scores = _array(path, meta, "tokenizer.ggml.scores", n, (int, float), required=True)
    assert scores is not None
    if any(not math.isfinite(s) for s in scores):
        i = next(i for i, s in enumerate(scores) if not math.isfinite(s))
        raise SpmVocabError(f"{path}: tokenizer.ggml.scores[{i}] is {scores[i]}, not a finite number")
    types = _array(path, meta, "tokenizer.ggml.token_type", n, int, required=False) or [NORMAL] * n
    bad = next((i for i, t in enumerate(types) if not UNDEFINED <= t <= BYTE), None)
    if bad is not None:
        raise SpmVocabError(f"{path}: tokenizer.ggml.token_type[{bad}] is {types[bad]}, not a llama.cpp token "
                            f"type (0-6)")
    return tokens, [float(s) for s in scores], list(types)


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
    """Every split of a mergeable entry into two entries, best first: by the entry's score, then the
    longer left part (see the module's docstring)."""
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    ranked = []
    for i, tok in enumerate(tokens):
        if types[i] not in (NORMAL, UNUSED, UNDEFINED) or ids[tok] != i or len(tok) < 2:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], -cut, i, left, right))
    ranked.sort()
    return [[left, right] for *_, left, right in ranked]


def build_spm_backend(path: Path, meta: Mapping[str, Any]) -> _Backend:
    """tokenizer.ggml.model 'llama': merges by score, from tokens and scores."""
    tokens, scores, types = read_spm_vocab(path, meta)
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    if not isinstance(prefix, bool):
        raise SpmVocabError(f"{path}: tokenizer.ggml.add_space_prefix is {prefix!r}, not a boolean")
    backend = _bpe(path, meta, tokens, spm_merges(tokens, scores, types))
    return _finish(backend, meta, tokens, types, prefix)


def build_gemma4_backend(path: Path, meta: Mapping[str, Any]) -> _Backend:
    """tokenizer.ggml.model 'gemma4': a BPE with a merge list over SentencePiece's spelling ("▁" for
    spaces, <0xXX> byte tokens), no space prefix; llama.cpp cuts the text at runs of newlines only."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise SpmVocabError(f"{path}: tokenizer.ggml.tokens must be a non-empty list of strings")
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    types = _array(path, meta, "tokenizer.ggml.token_type", len(tokens), int, required=False) \
        or [NORMAL] * len(tokens)
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not merges or not all(isinstance(m, str) for m in merges):
        raise SpmVocabError(f"{path}: tokenizer.ggml.merges is missing or not a list of strings; a 'gemma4' "
                            f"vocabulary needs its merge list")
    if any(" " in t for t in tokens):  # "a b" is ambiguous then: cut at the first space after the
        merges = [[m[:m.find(" ", 1)], m[m.find(" ", 1) + 1:]] if m.find(" ", 1) > 0 else ["", ""]
                  for m in merges]      # first character, as llama.cpp does
    backend = _bpe(path, meta, tokens, merges)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated")
    return _finish(backend, meta, tokens, types, prefix=False)


def _bpe(path: Path, meta: Mapping[str, Any], tokens: list[str], merges: list[Any]) -> _Backend:
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    # Handed over as tokenizer.json text: models.BPE(vocab, merges) would want a tuple per merge.
    model = {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
             "vocab": vocab, "merges": merges}
    text = json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                       "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
                       "model": model}, ensure_ascii=False)
    del model, vocab
    try:
        return _Backend.from_str(text)
    except Exception as e:  # the Rust side raises plain Exception
        raise SpmVocabError(f"{path}: the vocabulary does not build ({e})") from e


def _finish(backend: _Backend, meta: Mapping[str, Any], tokens: list[str], types: list[int],
            prefix: bool) -> _Backend:
    steps = [normalizers.Prepend(SPACE)] if prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
    dec = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    # As llama.cpp: control and unknown tokens are special (skipped when decoding with
    # skip_special_tokens); user-defined ones are matched whole too but decode as text.
    rstrip = _rstrip_tokens(meta, tokens, types)
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False, rstrip=tokens[i] in rstrip)
                                for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False, rstrip=tokens[i] in rstrip)
                        for i, t in enumerate(types) if t == USER_DEFINED])
    return backend


def _rstrip_tokens(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> set[str]:
    """Tokens that swallow the whitespace after them. A GGUF has no field for it: llama.cpp sets it by
    model name, for Phi-3 only (its tokenizer.json marks <|end|>, <|user|>, ... rstrip): every special
    token but <unk>, <s> and <|endoftext|>."""
    name = meta.get("general.name")
    if not isinstance(name, str) or not any(k in name.lower() for k in ("phi-3", "phi3")):
        return set()
    return {t for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN, USER_DEFINED)} \
        - {"<unk>", "<s>", "<|endoftext|>"}
