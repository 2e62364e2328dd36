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


# -- EmbeddingGemma (Gemma3TextModel with bidirectional attention) ---------------------------

TINY_WINDOW = 8  # config.json's; transformers reads 8 // 2 + 1 = 5: keys with |i - j| < 5


def st_reference(folder: Path, hidden, mask) -> np.ndarray:
    """The checkpoint's sentence-transformers head, from its files: Pooling (mean only), Dense
    layers (Identity activation), Normalize; in float64 torch."""
    import torch
    from safetensors.torch import load_file

    mask = mask.unsqueeze(-1).double()
    vec = None
    for m in sorted(json.loads((folder / "modules.json").read_text()), key=lambda m: m["idx"]):
        kind = m["type"].rsplit(".", 1)[-1]
        if kind == "Pooling":
            cfg = json.loads((folder / m["path"] / "config.json").read_text())
            assert cfg["pooling_mode_mean_tokens"], cfg
            vec = (hidden.double() * mask).sum(1) / mask.sum(1)
        elif kind == "Dense":
            cfg = json.loads((folder / m["path"] / "config.json").read_text())
            assert cfg["activation_function"].endswith("Identity"), cfg
            w = load_file(str(folder / m["path"] / "model.safetensors"))
            vec = vec @ w["linear.weight"].double().T + (w["linear.bias"].double() if "linear.bias" in w else 0)
        elif kind == "Normalize":
            vec = torch.nn.functional.normalize(vec, dim=-1)
    return vec.numpy()


def make_tiny_embeddinggemma(folder: Path, seed: int = 0, head_dim: int = 24) -> Path:
    """A random Gemma3TextModel with bidirectional attention (EmbeddingGemma's layout: GQA 4/2,
    a sliding window shorter than the inputs, local and global rope bases, sandwich and q/k norms)
    and a random sentence-transformers head (mean pooling, Dense 64->96->48, Normalize), written
    into `folder`. head_dim 24 (!= 64/4) on the CPU; the GPU run takes EmbeddingGemma's 256."""
    import torch
    from safetensors.torch import save_file
    from tiny_models import spread_init
    from transformers import Gemma3TextConfig, Gemma3TextModel

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512, rms_norm_eps=1e-6, query_pre_attn_scalar=24,
        sliding_window=TINY_WINDOW, use_bidirectional_attention=True, pad_token_id=0, bos_token_id=2,
        eos_token_id=1, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    config.architectures = ["Gemma3TextModel"]
    model = Gemma3TextModel(config).to(torch.float32).eval()
    spread_init(model)
    with torch.no_grad():  # Gemma's RMSNorm scales by 1 + w
        for name, p in model.named_parameters():
            if "norm" in name:
                p.sub_(1.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False,
         "pooling_mode_lasttoken": False, "include_prompt": True}))
    for path, (n_in, n_out) in (("2_Dense", (64, 96)), ("3_Dense", (96, 48))):
        (folder / path).mkdir()
        (folder / path / "config.json").write_text(json.dumps(
            {"in_features": n_in, "out_features": n_out, "bias": False,
             "activation_function": "torch.nn.modules.linear.Identity"}))
        save_file({"linear.weight": torch.randn(n_out, n_in) / n_in**0.5}, str(folder / path / "model.safetensors"))
    return folder
