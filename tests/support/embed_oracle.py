"""Embedding-model test helpers: transformers' reference vectors (the checkpoint's own
sentence-transformers pooling applied to BertModel's hidden states), cosines, and a tiny
random BERT that borrows a real checkpoint's tokenizer and pooling files."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

# what a sentence-transformers folder holds besides the weights and config.json
_DONOR_FILES = ("modules.json", "sentence_bert_config.json", "special_tokens_map.json", "tokenizer.json",
                "tokenizer_config.json", "vocab.txt")


def reference(folder: Path, texts: list[str], device: str = "cpu") -> np.ndarray:
    """transformers' BertModel (float32), then the checkpoint's sentence-transformers pooling,
    from its files."""
    import torch
    from transformers import AutoTokenizer, BertModel

    modules = json.loads((folder / "modules.json").read_text())
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    pooling = next(m for m in modules if m["type"].endswith("Pooling"))
    cfg = json.loads((folder / pooling["path"] / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = BertModel.from_pretrained(str(folder)).eval().to(device)
    enc = tok(texts, padding=True, return_tensors="pt").to(device)
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state.double()
    mask = enc["attention_mask"].unsqueeze(-1).double()
    if cfg.get("pooling_mode_mean_tokens"):
        vec = (hidden * mask).sum(1) / mask.sum(1)
    elif cfg.get("pooling_mode_cls_token"):
        vec = hidden[:, 0]
    else:
        raise AssertionError(f"the reference does not know the pooling in {cfg}")
    if "Normalize" in kinds:
        vec = torch.nn.functional.normalize(vec, dim=-1)
    return vec.cpu().numpy()


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def make_tiny_bert(folder: Path, donor: Path, seed: int = 0) -> Path:
    """A random BertModel (2 layers, hidden 64, 2 heads of 32, intermediate 128) with the
    donor's vocabulary, tokenizer and pooling files, written as safetensors into `folder`:
    a few MB, so it travels where the real checkpoint (90 MB) does not. Two heads of 32: TVM's CUDA
    decode attention cannot launch head_dim x heads-per-KV-head < 32 (toolchain/cuda.py)."""
    import torch
    from transformers import BertConfig, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    for name in _DONOR_FILES:
        if (donor / name).exists():
            shutil.copy(donor / name, folder / name)
    for sub in donor.iterdir():
        if sub.is_dir() and (sub / "config.json").exists():  # 1_Pooling/, 2_Normalize/ ...
            shutil.copytree(sub, folder / sub.name, dirs_exist_ok=True)
    vocab = json.loads((donor / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=128)
    BertModel(config).eval().save_pretrained(str(folder), safe_serialization=True)
    return folder
