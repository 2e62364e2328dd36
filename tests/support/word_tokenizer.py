"""A word-level tokenizer for tiny models whose checkpoints carry none (the engine needs one)."""
from __future__ import annotations

from pathlib import Path


def write_word_tokenizer(vocab: int, folder: Path) -> Path:
    """folder/tokenizer.json: a word-level tokenizer over `vocab` ids ("t0", "t1", ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"
