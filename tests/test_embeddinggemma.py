"""EmbeddingGemma (Gemma3TextModel, use_bidirectional_attention): models/gemma_encoder.py.

Tiny (always runs): a random Gemma3TextModel with odd shapes (GQA 4/2, head_dim 24 != 64/4, a
sliding window shorter than the inputs, local and global rope bases, sandwich and q/k norms) and a
random sentence-transformers head (mean pooling, Dense 64->96->48, Normalize), built for the host at
float32; hidden states of a right-padded batch of different lengths against transformers' eager
Gemma3TextModel on the same folder, then the vectors through runtime/engine/pooling.py.

Real (EmbeddingGemma-300M, 1.2 GB, tests/support/assets.py embeddinggemma_dir): runs when the asset is
cached, or when VTOOL_TEST_EMBEDDINGGEMMA=1 asks for the download; otherwise skipped with that
reason. LLM.embed against transformers' Gemma3TextModel (one padded batch of every text) plus the
checkpoint's pooling computed here from modules.json (mean -> 2_Dense -> 3_Dense -> Normalize), for texts
of 3 to 455 tokens (the longest is beyond the 257-token bidirectional window of the sliding layers; the
Embedder batches texts of similar lengths together), and a live `vtool serve` answering POST /v1/embeddings.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

import assets
from embed_oracle import TINY_WINDOW, cosines, make_tiny_embeddinggemma, st_reference
from vtool.models.config import ConfigError, parse_hf_config

TINY_LENGTHS = [23, 3, 17, 11]


# ------------------------------------------------------------------------------ tiny (CI)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from vtool.toolchain.build import build_artifact

    folder = make_tiny_embeddinggemma(tmp_path_factory.mktemp("tiny-embeddinggemma"))
    return folder, build_artifact(folder, "host", "float32")


def tiny_batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    width = max(TINY_LENGTHS)
    ids = np.zeros((len(TINY_LENGTHS), width), np.int32)
    mask = np.zeros_like(ids)
    for row, n in enumerate(TINY_LENGTHS):
        ids[row, :n] = [2] + rng.integers(3, 512, n - 1).tolist()
        mask[row, :n] = 1
    return ids, mask


def test_config_reads_the_bidirectional_window_as_transformers():
    from transformers import Gemma3TextConfig

    raw = {"architectures": ["Gemma3TextModel"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
           "sliding_window": 512, "use_bidirectional_attention": True,
           "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
    c = parse_hf_config(raw)
    assert c.sliding_window == Gemma3TextConfig(**{k: v for k, v in raw.items() if k != "architectures"}
                                                ).sliding_window == 257
    assert c.sliding_layers == (0, 2) and c.qk_norm and c.sandwich_norms and c.model_rope
    with pytest.raises(ConfigError, match="without use_bidirectional_attention"):
        parse_hf_config(raw | {"use_bidirectional_attention": False})
    with pytest.raises(ConfigError, match="use_bidirectional_attention with Gemma3ForCausalLM"):
        parse_hf_config(raw | {"architectures": ["Gemma3ForCausalLM"]})


def test_tiny_hidden_states_and_vectors_match_transformers(tiny):
    import torch
    from transformers import Gemma3TextModel
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.engine.pooling import load_pooler
    from vtool.runtime.weights.checkpoint import open_checkpoint

    folder, artifact = tiny
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert (manifest["task"], manifest["family"], manifest["entry_points"]) == ("embed", "gemma3_embed", ["encode"])
    names = {p["name"]: p for p in manifest["params"]}
    assert names["layers.0.self_attn.qkv_proj.weight"]["sources"] == [
        f"layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert names["layers.1.pre_feedforward_layernorm.weight"]["transform"] == "plus_one"

    ids, mask = tiny_batch()
    m = CompiledModel(artifact, open_checkpoint(folder))
    got = m.to_numpy(m.function("encode")(m.upload(ids), m.upload(mask), m.params))

    hf = Gemma3TextModel.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    assert hf.config.sliding_window == TINY_WINDOW // 2 + 1
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).last_hidden_state
    err = max(float(np.abs(got[r, :n] - want[r, :n].numpy()).max()) for r, n in enumerate(TINY_LENGTHS))
    scale = float(want.abs().max())
    print("tiny max |diff|", err, "max |h|", scale)
    assert err < 1e-4 * max(1.0, scale), err

    # the window is real: the same weights attending globally everywhere give other states
    wide = Gemma3TextModel.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                           sliding_window=2 * max(TINY_LENGTHS)).eval()
    with torch.no_grad():
        unwindowed = wide(input_ids=torch.tensor(ids, dtype=torch.long),
                          attention_mask=torch.tensor(mask)).last_hidden_state
    assert float((unwindowed[0, :TINY_LENGTHS[0]] - want[0, :TINY_LENGTHS[0]]).abs().max()) > 100 * err

    pooler = load_pooler(folder, 64, manifest["default_pooling"])
    vec = pooler.finish(pooler.pool(got, TINY_LENGTHS))
    ref = st_reference(folder, want, torch.tensor(mask))
    cos = cosines(vec, ref)
    print("tiny cosine", cos.tolist())
    assert vec.shape == (len(TINY_LENGTHS), 48) and cos.min() >= 0.99999, cos
    # one row alone (no padding) gives the states it had inside the padded batch
    alone = m.to_numpy(m.function("encode")(m.upload(ids[2:3, :TINY_LENGTHS[2]]),
                                            m.upload(mask[2:3, :TINY_LENGTHS[2]]), m.params))
    np.testing.assert_allclose(alone[0], got[2, :TINY_LENGTHS[2]], atol=1e-4 * max(1.0, scale))


def test_embedder_batches_only_similar_lengths():
    """Attention costs the padded width squared per row: a text shorter than half its batch's width
    starts another batch instead of being padded to it."""
    import types

    from vtool.runtime.engine.embed import Embedder

    groups = Embedder._groups(types.SimpleNamespace(max_batch_tokens=8192), [3, 455, 21, 18, 14, 9])  # type: ignore
    assert groups == [[1], [2, 3, 4], [5], [0]]
    assert Embedder._groups(types.SimpleNamespace(max_batch_tokens=40), [10, 10, 10, 10, 10]) == [[0, 1, 2, 3], [4]]


# ------------------------------------------------------------------------------ EmbeddingGemma-300M


HEAVY_ENV = "VTOOL_TEST_EMBEDDINGGEMMA"
real = pytest.mark.skipif(not (os.environ.get(HEAVY_ENV) == "1" or assets.embeddinggemma_cached()),
                          reason=f"EmbeddingGemma-300M (1.2 GB download) is not cached: set {HEAVY_ENV}=1 to fetch "
                                 "it (tests/support/assets.py embeddinggemma_dir)")
MODEL = "embeddinggemma"
TEXTS = [
    "Hi",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France, with an estimated population of two million.",
    "title: none | text: The quick brown fox jumps over the lazy dog.",
    " ".join(f"Sentence number {i} talks about apples, rivers, mountains and the number {i * 7}." for i in range(24)),
    "task: search result | query: how do embeddings work?",
]


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    return assets.required(assets.embeddinggemma_dir)


@pytest.fixture(scope="module")
def gemma_llm(gemma_dir):
    from vtool import LLM
    from vtool.toolchain.build import build_artifact

    build_artifact(gemma_dir, "host")
    return LLM(str(gemma_dir))  # the artifact above, from the build cache


def gemma_reference(folder: Path, texts: list[str]) -> tuple[np.ndarray, list[list[int]]]:
    import torch
    from transformers import AutoTokenizer, Gemma3TextModel

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = Gemma3TextModel.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    ids = [row[: int(n)].tolist() for row, n in zip(enc["input_ids"], enc["attention_mask"].sum(1))]
    return st_reference(folder, hidden, enc["attention_mask"]), ids


@pytest.fixture(scope="module")
def gemma_ref(gemma_dir):
    return gemma_reference(gemma_dir, TEXTS)


@real
@pytest.mark.slow
def test_embeddinggemma_matches_transformers(gemma_llm, gemma_ref):
    want, ref_ids = gemma_ref
    tokenizer = gemma_llm.get_tokenizer()
    assert [tokenizer.encode(t) for t in TEXTS] == ref_ids
    lengths = [len(i) for i in ref_ids]
    assert max(lengths) > 257 > min(lengths), lengths  # one text reaches beyond the sliding window
    t0 = time.perf_counter()
    got = np.array(gemma_llm.embed(TEXTS))
    seconds = time.perf_counter() - t0
    cos = cosines(got, want)
    print(f"EmbeddingGemma-300M: {len(TEXTS)} texts of {lengths} tokens in {seconds:.2f} s; cosine vs "
          f"transformers {[round(float(c), 7) for c in cos]} (min 1 - {1 - float(cos.min()):.1e}), "
          f"max |diff| {float(np.abs(got - want).max()):.2e}")
    assert got.shape == (len(TEXTS), 768)
    assert cos.min() >= 0.999, cos
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # the short texts (3-21 tokens) as one right-padded encode call, whatever the Embedder's batching
    short = [i for i, n in enumerate(lengths) if n < 257]
    embedder = gemma_llm.embedder
    batched = embedder.pooler.finish(embedder._encode([ref_ids[i] for i in short]))
    cos_batch = cosines(batched, want[short])
    print("one padded batch of", [lengths[i] for i in short], "tokens: min cosine 1 -", f"{1 - float(cos_batch.min()):.1e}")
    assert cos_batch.min() >= 0.999, cos_batch
    # the model card's Matryoshka sizes are not in config.json: `dimensions` is refused, as vLLM does
    from vtool.runtime.engine.pooling import PoolingError

    with pytest.raises(PoolingError, match="does not support matryoshka"):
        gemma_llm.embed("hello", dimensions=256)


@real
@pytest.mark.slow
def test_embeddinggemma_server(gemma_dir, gemma_llm, gemma_ref, tmp_path):
    import httpx
    import openai
    from live_server import vtool_serve

    want, _ = gemma_ref
    with vtool_serve(["--model", str(gemma_dir), "--served-model-name", MODEL], tmp_path / "server.log",
                     timeout=600, poll=0.5) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        out = client.embeddings.create(model=MODEL, input=TEXTS)
        got = np.array([d.embedding for d in out.data])
        cos = cosines(got, want)
        print("served: min cosine vs transformers 1 -", f"{1 - float(cos.min()):.1e}")
        assert out.model == MODEL and len(out.data) == len(TEXTS) and cos.min() >= 0.999, cos
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=60)
        assert r.status_code >= 400, r.text  # an embedding server refuses generation
