"""schedules/cpu/encoder_attention.py: the CPU kernel of an encoder's whole attention, against
numpy's softmax(q.k * scale) . v over each query's visible keys (mask != 0 and, with a window,
|i - j| < window), under hypothesis over rows, lengths and values; and its wiring: a CPU float32
embedding build calls it (models/dense_attention.py) and still equals transformers (the tiny
EmbeddingGemma at head_dim 32, which the kernel takes; test_embeddinggemma.py's head_dim 24
keeps the Relax ops)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tvm = pytest.importorskip("tvm")

from vtool.schedules.cpu.encoder_attention import DenseAttentionKernels  # noqa: E402
from vtool.targets import buildable  # noqa: E402

# (q heads, kv heads, head dim, scale, window): GQA with a window; one head per KV head, no window
SHAPES = [(4, 2, 32, 0.2, 5), (3, 3, 16, 0.25, 0)]


def reference(qkv: np.ndarray, mask: np.ndarray, hq: int, hkv: int, scale: float, window: int) -> np.ndarray:
    b, n, _, d = qkv.shape
    out = np.zeros((b, n, hq, d))
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
    for row in range(b):
        for i in range(n):
            keys = [j for j in range(n) if mask[row, j] and (not window or abs(i - j) < window)]
            if not keys:
                continue
            for h in range(hq):
                hk = h // (hq // hkv)
                s = np.array([q[row, i, h] @ k[row, j, hk] for j in keys], np.float64) * scale
                p = np.exp(s - s.max())
                out[row, i, h] = (p / p.sum()) @ v[row, keys, hk]
    return out


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"hq{s[0]}-hkv{s[1]}-d{s[2]}-w{s[4]}")
def kernel(request):
    hq, hkv, d, scale, window = request.param
    func = DenseAttentionKernels().func(hq, hkv, d, scale, window).with_attr("global_symbol", "main")
    # the host's own instruction set: the kernel's 16-lane vectors are split by LLVM where the CPU
    # has 8 (an AVX-512 target crashed the run with SIGILL on an AVX2-only EPYC)
    target = tvm.target.Target({**buildable("host").tvm, "num-cores": 2})
    with target:
        return request.param, tvm.compile(tvm.IRModule({"main": func}), target=target)


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_kernel_matches_numpy(kernel, data):
    (hq, hkv, d, scale, window), lib = kernel
    b = data.draw(st.integers(1, 3), label="rows")
    n = data.draw(st.integers(1, 40), label="width")
    lengths = [n] + [data.draw(st.integers(1, n), label="length") for _ in range(b - 1)]  # right padding
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    qkv = rng.standard_normal((b, n, hq + 2 * hkv, d)).astype("float32")
    mask = np.zeros((b, n), np.int32)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    out = tvm.runtime.tensor(np.full((b, n, hq, d), np.nan, "float32"))
    lib["main"](tvm.runtime.tensor(qkv), tvm.runtime.tensor(mask), out)
    got, want = out.numpy(), reference(qkv, mask, hq, hkv, scale, window)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_shapes_it_does_not_take():
    kernels = DenseAttentionKernels()
    assert kernels.func(4, 2, 24, 0.2, 0) is None  # head dim not a multiple of 16
    assert kernels.func(3, 2, 32, 0.2, 0) is None  # query heads not a multiple of the KV heads


def test_tiny_embeddinggemma_through_the_kernel_matches_transformers(tmp_path):
    import torch
    from transformers import Gemma3TextModel

    from embed_oracle import make_tiny_embeddinggemma
    from test_embeddinggemma import TINY_LENGTHS, tiny_batch
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.toolchain.build import build_artifact

    folder = make_tiny_embeddinggemma(tmp_path / "tiny-d32", head_dim=32)
    artifact = build_artifact(folder, "host", "float32")
    assert json.loads((artifact / "manifest.json").read_text())["task"] == "embed"
    assert b"dense_attention" in (artifact / "model.so").read_bytes()  # the kernel, not the Relax ops
    ids, mask = tiny_batch()
    m = CompiledModel(artifact, open_checkpoint(folder))
    got = m.to_numpy(m.function("encode")(m.upload(ids), m.upload(mask), m.params))
    hf = Gemma3TextModel.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).last_hidden_state
    err = max(float(np.abs(got[r, :n] - want[r, :n].numpy()).max()) for r, n in enumerate(TINY_LENGTHS))
    scale = float(want.abs().max())
    assert err < 1e-4 * max(1.0, scale), err
