"""`vtool tokenize <tokenizer.json | model dir | model.gguf> <corpus.txt>`: count and list a file's
token ids, like llama.cpp's llama-tokenize (`--ids --show-count`), with the time taken."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vtool import VtoolError

from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from rich.console import Console


@dataclass
class TokenizeReport:
    tokenizer: str
    corpus: str
    n_chars: int
    ids: list[int]
    load_seconds: float
    encode_seconds: float

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    @property
    def tokens_per_second(self) -> float:
        return self.n_tokens / self.encode_seconds if self.encode_seconds > 0 else float("inf")


def tokenize_file(tokenizer_path: str, corpus_path: str, add_special_tokens: bool = True) -> TokenizeReport:
    """Tokenize the whole file as one text. Special tokens are added as the model asks (BOS for Llama 3),
    as llama-tokenize does unless --no-bos."""
    corpus = Path(corpus_path)
    try:
        text = corpus.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise VtoolError(f"{corpus}: corpus file not found") from None
    except UnicodeDecodeError as e:
        raise VtoolError(f"{corpus}: not UTF-8 text ({e})") from None
    t0 = time.perf_counter()
    tok = Tokenizer.load(tokenizer_path)
    t1 = time.perf_counter()
    ids = tok.encode(text, add_special_tokens=add_special_tokens)
    t2 = time.perf_counter()
    return TokenizeReport(str(tokenizer_path), str(corpus), len(text), ids, t1 - t0, t2 - t1)


def run_tokenize(tokenizer_path: str, corpus_path: str, console: Console, add_special_tokens: bool = True) -> int:
    """Print the ids and the count; return the exit status (VtoolError propagates to the CLI)."""
    r = tokenize_file(tokenizer_path, corpus_path, add_special_tokens)
    # soft_wrap: a long id list must not be cut or re-flowed into a table; markup off for raw ids.
    console.print("[" + ", ".join(map(str, r.ids)) + "]", soft_wrap=True, markup=False, highlight=False)
    console.print(f"Total number of tokens: {r.n_tokens}", highlight=False)
    console.print(f"[dim]{r.n_chars} characters; tokenizer loaded in {r.load_seconds:.2f} s; encoded in "
                  f"{r.encode_seconds * 1000:.1f} ms ({r.tokens_per_second:,.0f} tokens/s)[/dim]")
    return 0
