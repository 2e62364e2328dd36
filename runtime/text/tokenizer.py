"""Text <-> token ids for the runtime, on top of the HF `tokenizers` library (which does the BPE).

Two sources:
- a model folder with tokenizer.json (+ tokenizer_config.json, chat_template.jinja): `Tokenizer.from_dir`
- a GGUF file's tokenizer metadata: `Tokenizer.from_gguf`. Byte-level BPE ('gpt2'): the pre-tokenizer
  split regexes per `tokenizer.ggml.pre` follow llama.cpp's llama-vocab.cpp, written in the original
  (tokenizer.json) form that the HF reference tokenizers use. SentencePiece ('llama'): spm.py.

`IncrementalDetokenizer` turns a stream of generated ids into text deltas that never end in a broken
UTF-8 sequence.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from vtool import VtoolError


class TokenizerError(VtoolError):
    """A tokenizer that cannot be loaded or built: names what was found and what is accepted."""


# --- GGUF pre-tokenizers ---------------------------------------------------------------------------

# GPT-2's split (also the base of SmolLM's and StarCoder's).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Qwen2/2.5/3: one digit per piece, case-insensitive contractions.
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: like Qwen2 but combining marks (\p{M}) stay with their letters; no NFC normalizer.
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3: digits in runs of up to three.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _Pre:
    splits: tuple[str, ...]     # applied in order, each on the pieces of the one before (as llama.cpp does)
    nfc: bool = False           # the reference tokenizer.json has an NFC normalizer
    ignore_merges: bool = False  # a piece that is a whole vocab entry is taken as is (Llama 3)
    add_bos: bool = False       # llama.cpp's default when the GGUF has no add_bos_token key


_LLAMA3_PRE = _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)
GGUF_PRE_TOKENIZERS: dict[str, _Pre] = {
    "gpt-2": _Pre((_GPT2,)),
    # SmolLM's tokenizer.json is Digits(individual) + ByteLevel: isolate every \p{N} first.
    "smollm": _Pre((r"\p{N}", _GPT2)),
    # NFC as in Qwen2/3's tokenizer.json (llama.cpp skips it; that differs only on non-NFC text).
    "qwen2": _Pre((_QWEN2,), nfc=True),
    "qwen35": _Pre((_QWEN35,)),
    "llama-bpe": _LLAMA3_PRE,
    "llama3": _LLAMA3_PRE,    # older names llama.cpp treats exactly like llama-bpe
    "llama-v3": _LLAMA3_PRE,
}
# byte-level BPE; SentencePiece and Gemma 4's BPE over SentencePiece's spelling (spm.py); WordPiece 'bert',
# Unigram 't5', ... are refused
SUPPORTED_GGUF_MODELS = ("gpt2", "llama", "gemma4")
_SPM = _Pre((), add_bos=True)  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _gguf_fields(path: Path) -> dict[str, Any]:
    """The tokenizer.* metadata of a GGUF file, as Python values. vtool's light header reader
    (runtime/weights/gguf_reader.py): gguf.GGUFReader would build ~175 MB of numpy views for a 49K-token
    vocabulary, most of a small model's peak memory; this keeps the strings only."""
    # imported here: the gguf package costs import time the tokenizer.json path doesn't need
    from vtool.runtime.weights.gguf_reader import GGUFFile, _Truncated

    try:
        reader = GGUFFile(path, keep=lambda key: key.startswith("tokenizer.") or key == "general.name")
    except (OSError, ValueError, KeyError, IndexError, _Truncated) as e:  # bad magic, truncated, duplicate keys
        raise TokenizerError(f"{path}: cannot read as GGUF ({type(e).__name__}: {e})") from e
    if reader.byte_order != "I":
        raise TokenizerError(f"{path}: cannot read as GGUF (big-endian files are not supported)")
    return reader.fields


def _build_gguf_backend(path: Path, meta: Mapping[str, Any]) -> tuple[_Backend, _Pre]:
    model = meta.get("tokenizer.ggml.model")
    if model not in SUPPORTED_GGUF_MODELS:
        raise TokenizerError(
            f"{path}: tokenizer.ggml.model is {model!r}; vtool builds GGUF tokenizers only for "
            f"{', '.join(map(repr, SUPPORTED_GGUF_MODELS))} (byte-level BPE, SentencePiece, Gemma 4)")
    if model in ("llama", "gemma4"):
        from .spm import build_gemma4_backend, build_spm_backend  # here: spm.py builds on this module

        return (build_spm_backend if model == "llama" else build_gemma4_backend)(path, meta), _SPM
    pre_name = meta.get("tokenizer.ggml.pre")
    pre = GGUF_PRE_TOKENIZERS.get(pre_name) if isinstance(pre_name, str) else None
    if pre is None:
        seen = "is missing" if pre_name is None else f"is {pre_name!r}, which vtool does not support"
        raise TokenizerError(f"{path}: tokenizer.ggml.pre {seen}; accepted: {', '.join(sorted(GGUF_PRE_TOKENIZERS))}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicated string keeps its first id, as a dict-based vocab must

    # The BPE model goes in as tokenizer.json text, GGUF's "a b" merge strings as they are (the
    # format's legacy merges, split at the space as before): models.BPE(vocab, merges) wants
    # a (str, str) tuple per merge, ~10 MB of Python objects for 50K merges at the moment the
    # process peaks (the weights are bound by then).
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
             "ignore_merges": pre.ignore_merges, "vocab": vocab, "merges": meta.get("tokenizer.ggml.merges") or []}
    text = json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                       "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
                       "model": model}, ensure_ascii=False)
    del model, vocab
    backend = _Backend.from_str(text)
    del text
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) are special: matched whole in text, dropped by skip_special_tokens.
    # User-defined ones (<think>) are matched whole too but are ordinary text when decoding, as in
    # llama.cpp's token_to_piece and HF's non-special added tokens.
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == _CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == _USER_DEFINED])
    return backend, pre


# --- tokenizer_config.json helpers -----------------------------------------------------------------

def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_affixes(backend: _Backend) -> tuple[list[int], list[int]]:
    """The ids the tokenizer.json post-processor puts around a single text (e.g. Llama 3's BOS)."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    return [], []


# --- the tokenizer ---------------------------------------------------------------------------------

class Tokenizer:
    """A loaded tokenizer: encode/decode, special ids, and the model's chat template."""

    def __init__(self, backend: _Backend, *, bos_token: str | None = None, eos_token: str | None = None,
                 add_bos: bool | None = None, add_eos: bool | None = None, chat_template: str | None = None,
                 special_tokens: Mapping[str, str] | None = None, source: str = "") -> None:
        self._backend = backend
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self.eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        self.chat_template = chat_template
        # Template variables beyond messages: bos_token, eos_token, pad_token, ... (as transformers passes).
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        # What encode(add_special_tokens=True) puts around the text. An explicit add_bos/add_eos wins;
        # otherwise whatever tokenizer.json's post-processor does.
        prefix, suffix = _special_affixes(backend)
        if add_bos is not None:
            prefix = [self.bos_id] if add_bos and self.bos_id is not None else []
        if add_eos is not None:
            suffix = [self.eos_id] if add_eos and self.eos_id is not None else []
        self._prefix, self._suffix = prefix, suffix

    # constructors

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        """A model folder, a tokenizer.json file, or a .gguf file."""
        p = Path(path)
        if p.is_dir():
            return cls.from_dir(p)
        if p.suffix == ".gguf":
            return cls.from_gguf(p)
        if p.is_file():
            return cls.from_file(p)
        raise TokenizerError(f"{p}: no such file or folder (expected a model folder, tokenizer.json or .gguf)")

    @classmethod
    def from_dir(cls, model_dir: str | Path, tokenizer_config: str | Path | None = None) -> "Tokenizer":
        d = Path(model_dir)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            found = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
            hint = ""
            if "tokenizer.model" in found or ("vocab.json" in found and "merges.txt" in found):
                hint = " (slow-tokenizer files such as tokenizer.model or vocab.json+merges.txt are not read)"
            raise TokenizerError(f"{d}: no tokenizer.json{hint}; vtool needs the fast-tokenizer file "
                                 f"tokenizer.json next to the weights. Found: {', '.join(found) or 'nothing'}")
        return cls.from_file(tj, tokenizer_config)

    @classmethod
    def from_file(cls, tokenizer_json: str | Path, tokenizer_config: str | Path | None = None) -> "Tokenizer":
        """tokenizer.json; tokenizer_config.json and chat_template.jinja are taken from beside it."""
        from .chat_template import select_chat_template

        tj = Path(tokenizer_json)
        try:
            backend = _Backend.from_file(str(tj))
        except Exception as e:  # the Rust side raises plain Exception on bad JSON
            raise TokenizerError(f"{tj}: not a loadable tokenizer.json ({e})") from e
        # tokenizer.json may carry padding and truncation (all-MiniLM-L6-v2's: both to 128); transformers
        # applies them only when a call asks, so encode() here never pads or cuts.
        backend.no_padding()
        backend.no_truncation()
        cfg_path = Path(tokenizer_config) if tokenizer_config else tj.parent / "tokenizer_config.json"
        cfg: dict[str, Any] = {}
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise TokenizerError(f"{cfg_path}: not readable JSON ({e})") from e
        elif tokenizer_config:
            raise TokenizerError(f"{cfg_path}: tokenizer config not found")
        jinja = tj.parent / "chat_template.jinja"
        # transformers saves the template to chat_template.jinja and prefers it over the config's.
        template = jinja.read_text(encoding="utf-8") if jinja.is_file() else \
            select_chat_template(cfg.get("chat_template"), str(cfg_path))
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        specials = {n: _token_content(cfg.get(n)) for n in names}
        add_bos, add_eos = cfg.get("add_bos_token"), cfg.get("add_eos_token")
        return cls(backend, bos_token=specials["bos_token"], eos_token=specials["eos_token"],
                   add_bos=add_bos if isinstance(add_bos, bool) else None,
                   add_eos=add_eos if isinstance(add_eos, bool) else None,
                   chat_template=template, special_tokens=specials, source=str(tj))

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        p = Path(path)
        if not p.is_file():
            raise TokenizerError(f"{p}: GGUF file not found")
        meta = _gguf_fields(p)
        if "tokenizer.ggml.tokens" not in meta:
            raise TokenizerError(f"{p}: the GGUF has no tokenizer (no tokenizer.ggml.tokens)")
        backend, pre = _build_gguf_backend(p, meta)
        tokens = meta["tokenizer.ggml.tokens"]

        # llama.cpp's ids for a SentencePiece vocabulary that names none (<s>, </s>, <unk>)
        defaults = {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0} \
            if meta.get("tokenizer.ggml.model") == "llama" else {}

        def tok(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}", defaults.get(key))
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        add_eos = meta.get("tokenizer.ggml.add_eos_token")
        specials = {"bos_token": tok("bos_token_id"), "eos_token": tok("eos_token_id"),
                    "unk_token": tok("unknown_token_id"), "pad_token": tok("padding_token_id")}
        template = meta.get("tokenizer.chat_template")
        return cls(backend, bos_token=specials["bos_token"], eos_token=specials["eos_token"],
                   add_bos=bool(add_bos) if add_bos is not None else pre.add_bos,
                   add_eos=bool(add_eos) if add_eos is not None else False,
                   chat_template=template if isinstance(template, str) else None,
                   special_tokens=specials, source=str(p))

    # encoding

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> _Backend:
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return self._prefix + ids + self._suffix if add_special_tokens else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def incremental(self, skip_special_tokens: bool = True,
                    prompt_ids: Sequence[int] = ()) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for a conversation (tokenize it with encode(..., add_special_tokens=False):
        templates write their own BOS)."""
        from .chat_template import render_chat_template

        if self.chat_template is None:
            raise TokenizerError(f"{self.source or 'this tokenizer'}: the model has no chat template, so it "
                                 "cannot chat; give it a plain prompt instead")
        variables = {**self.special_tokens, **kwargs}
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    **variables)


class IncrementalDetokenizer:
    """Feed generated ids one at a time; `push` returns the new text, holding it back while the decoded
    tail is U+FFFD (an incomplete UTF-8 sequence, e.g. half an emoji).

    It decodes a short window of ids instead of each id alone, so that decoders which depend on
    neighbours (SentencePiece's leading space, multi-token characters) come out right; the deltas
    joined (plus `flush()`) equal decoding all generated ids at once.
    """

    CONTEXT = 5  # prompt ids decoded as left context for the first delta

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # The backend's decode, called with the slice itself (Tokenizer.decode would copy it
        # into another list first): push runs once per generated token.
        self._backend_decode = tokenizer.backend.decode
        self._ids: list[int] = list(prompt_ids)
        self._prefix = max(len(self._ids) - self.CONTEXT, 0)  # window start (already emitted text)
        self._read = len(self._ids)                            # end of what has been emitted
        self._before: str | None = None  # the text of ids[prefix:read] while they stay put

    def _decode(self, ids: list[int]) -> str:
        return self._backend_decode(ids, skip_special_tokens=self._skip)

    def _emitted(self) -> str:
        """The text of the window's already-emitted ids, ids[prefix:read] (decoded once per window:
        a push that holds text back leaves the window as it was)."""
        if self._before is None:
            self._before = self._decode(self._ids[self._prefix:self._read])
        return self._before

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._emitted()
        now = self._decode(self._ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""  # nothing visible yet, or a character still incomplete
        self._prefix, self._read, self._before = self._read, len(self._ids), None
        return now[len(before):]

    def flush(self) -> str:
        """Whatever is held back (at the end of generation); may contain U+FFFD for truly broken bytes."""
        before = self._emitted()
        now = self._decode(self._ids[self._prefix:])
        self._prefix, self._read, self._before = self._read, len(self._ids), None
        return now[len(before):]
