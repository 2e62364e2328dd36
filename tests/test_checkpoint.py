"""vtool.runtime.weights.checkpoint: safetensors folders and GGUF files -> HF config + HF tensors.

transformers (offline) is the oracle for GGUF: its GGUF loader dequantizes with the same
gguf-py code and un-permutes Q/K for llama, so our tensors must equal its state_dict.
The real default model (SmolLM2-135M Q4_1) is loaded once per session by transformers.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from vtool.runtime.weights.checkpoint import CheckpointError, TensorInfo, open_checkpoint
from vtool.runtime.weights.gguf_reader import llama3_rope_scaling, unpermute_rows

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

Q = gguf.GGMLQuantizationType
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def transformers_load(folder: Path, filename: str) -> tuple[dict[str, np.ndarray], Any]:
    """(state_dict as float32 numpy, config) of a GGUF through transformers, dequantized."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kwargs: dict[str, Any] = {"gguf_file": filename, "dtype": torch.float32}
    if hasattr(transformers, "GgufConfig"):  # transformers 5: ask for plain dense weights
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    sd = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    return sd, model.config


def hf_rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(getattr(config, "rope_theta", None) or params["rope_theta"])


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, written out independently of the reader."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# offsets of the float16 scale fields inside one block; everything else may be any byte
# byte offsets of each block's float16 scales (gguf-py's block layouts)
F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q2_K: (80, 82),
              Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
              Q.IQ2_XXS: (0,), Q.TQ2_0: (64,)}


def random_blocks(rows: int, cols: int, qtype: Any, rng: np.random.Generator) -> np.ndarray:
    """Valid random quantized bytes (rows, bytes per row): random codes, finite small scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = rng.uniform(-0.05, 0.05, size=(rows, cols // block, 1)).astype("<f2")
        raw[..., off : off + 2] = scale.view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(path: Path, arch: str, kv: dict[str, Any], tensors: dict[str, Any]) -> Path:
    """tensors: name -> float ndarray (torch order; F32/F16) or (uint8 blocks, GGMLQuantizationType)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, val in kv.items():
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        elif isinstance(val, str):
            w.add_string(key, val)
        else:
            w.add_array(key, val)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# HF name piece -> GGUF name piece (the reverse of the reader's table, kept separate on purpose)
HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name_of(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[module]}.{suffix}"


TINY = dict(hidden=256, inter=512, layers=2, heads=4, kv=2, vocab=320)


def tiny_model(arch: str, rng: np.random.Generator, tie: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """HF-layout float32 weights and GGUF metadata of a tiny llama/qwen2/qwen3."""
    h, inter, heads, kv, vocab = TINY["hidden"], TINY["inter"], TINY["heads"], TINY["kv"], TINY["vocab"]
    hd = 128 if arch == "qwen3" else h // heads  # qwen3: head_dim != hidden / heads, as in Qwen3 itself
    r = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1  # noqa: E731
    w = {"model.embed_tokens.weight": r(vocab, h), "model.norm.weight": r(h)}
    if not tie:
        w["lm_head.weight"] = r(vocab, h)
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": r(h), p + "post_attention_layernorm.weight": r(h),
              p + "self_attn.q_proj.weight": r(heads * hd, h), p + "self_attn.k_proj.weight": r(kv * hd, h),
              p + "self_attn.v_proj.weight": r(kv * hd, h), p + "self_attn.o_proj.weight": r(h, heads * hd),
              p + "mlp.gate_proj.weight": r(inter, h), p + "mlp.up_proj.weight": r(inter, h),
              p + "mlp.down_proj.weight": r(h, inter)}
        if arch == "qwen2":
            w |= {p + "self_attn.q_proj.bias": r(heads * hd), p + "self_attn.k_proj.bias": r(kv * hd),
                  p + "self_attn.v_proj.bias": r(kv * hd)}
        if arch == "qwen3":
            w |= {p + "self_attn.q_norm.weight": r(hd), p + "self_attn.k_norm.weight": r(hd)}
    kv_meta: dict[str, Any] = {
        f"{arch}.block_count": TINY["layers"], f"{arch}.context_length": 1024, f"{arch}.embedding_length": h,
        f"{arch}.feed_forward_length": inter, f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv, f"{arch}.rope.freq_base": 500000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.vocab_size": vocab,
        "tokenizer.ggml.bos_token_id": 5, "tokenizer.ggml.eos_token_id": 7,
    }
    if arch == "qwen3":
        kv_meta |= {f"{arch}.attention.key_length": hd, f"{arch}.attention.value_length": hd}
    else:
        kv_meta[f"{arch}.rope.dimension_count"] = hd
    return w, kv_meta


def to_gguf_tensors(arch: str, weights: dict[str, np.ndarray], qtype_of: Any, rng: np.random.Generator) -> dict[str, Any]:
    """HF weights -> GGUF tensors as llama.cpp writes them (llama Q/K rows permuted)."""
    out: dict[str, Any] = {}
    for hf, arr in weights.items():
        name = gguf_name_of(hf)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            arr = llamacpp_permute(arr, TINY["heads"] if ".attn_q." in name else TINY["kv"])
        qtype = qtype_of(name, arr)
        if qtype is None or arr.ndim == 1:
            out[name] = arr
        elif qtype == Q.F16:
            out[name] = arr.astype(np.float16)
        elif qtype == Q.BF16:
            out[name] = (gguf.quants.quantize(arr, Q.BF16), Q.BF16)
        else:
            out[name] = (random_blocks(arr.shape[0], arr.shape[1], qtype, rng), qtype)
    return out


def safetensors_dir(tmp: Path, tensors: dict[str, np.ndarray], config: dict | None = None) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config or {"architectures": ["LlamaForCausalLM"]}))
    save_file(tensors, str(tmp / "model.safetensors"))
    return tmp


# ---------------------------------------------------------------------------------------
# the real default model against transformers
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_gguf() -> Path:
    from vtool.runtime.weights.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def real_ckpt(real_gguf: Path):
    return open_checkpoint(real_gguf)


@pytest.fixture(scope="module")
def oracle(real_gguf: Path):
    import torch
    from hf_oracle import load_gguf_model  # shared with the parity tests: one 20-45 s load per session

    model = load_gguf_model(real_gguf)
    return {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}, model.config


@pytest.mark.slow
def test_real_gguf_tensors_equal_transformers(real_ckpt, oracle):
    sd, config = oracle
    ours = real_ckpt.tensors()
    assert real_ckpt.format == "gguf" and len(ours) == 272
    # transformers lists the tied lm_head too; we do not, since the file has no output.weight
    assert set(sd) - set(ours) == {"lm_head.weight"} and config.tie_word_embeddings
    worst = 0.0
    for name, info in ours.items():
        arr = real_ckpt.load(name)
        assert arr.dtype == np.float32 and arr.shape == info.shape == sd[name].shape, name
        worst = max(worst, float(np.max(np.abs(arr - sd[name]))))
    assert worst == 0.0  # same dequantizer, same permutation: bit-identical
    assert {i.dtype for i in ours.values()} == {"Q4_1", "Q8_0", "F32"}
    assert ours["model.embed_tokens.weight"] == TensorInfo("model.embed_tokens.weight", (49152, 576), "Q8_0")


@pytest.mark.slow
def test_real_gguf_config_matches_transformers(real_ckpt, oracle):
    _, hf = oracle
    cfg = real_ckpt.config()
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert cfg[key] == getattr(hf, key), key
    assert cfg["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert cfg["rms_norm_eps"] == 1e-5  # float32 1e-5 read back as the number the converter wrote
    assert cfg["rope_theta"] == pytest.approx(hf_rope_theta(hf), rel=1e-7)
    assert cfg["rope_scaling"] is None
    assert real_ckpt.generation_config() is None


def test_real_gguf_accepted_by_model_config(real_ckpt):
    from vtool.models.config import parse_hf_config

    mc = parse_hf_config(real_ckpt.config())
    assert (mc.family, mc.head_dim, mc.num_key_value_heads, mc.tie_word_embeddings) == ("llama", 64, 3, True)


def test_real_gguf_load_dtypes_and_refusals(real_ckpt):
    name = "model.layers.3.self_attn.k_proj.weight"
    f32 = real_ckpt.load(name)
    bf = real_ckpt.load(name, "bfloat16")
    f16 = real_ckpt.load(name, "float16")
    assert bf.dtype == ml_dtypes.bfloat16 and f16.dtype == np.float16
    np.testing.assert_array_equal(bf, f32.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(f16, f32.astype(np.float16))
    with pytest.raises(CheckpointError, match=r"model\.layers\.99\.mlp\.up_proj\.weight"):
        real_ckpt.load("model.layers.99.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match="float64"):
        real_ckpt.load(name, "float64")


def test_real_gguf_metadata(real_ckpt):
    md = real_ckpt.metadata()
    assert md["general.architecture"] == "llama"
    tokens = md["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == 49152 and tokens[1] == "<|im_start|>"
    assert isinstance(md["tokenizer.ggml.merges"], list) and isinstance(md["tokenizer.chat_template"], str)
    assert md["tokenizer.ggml.eos_token_id"] == 2 and md["tokenizer.ggml.add_bos_token"] is False
    assert not any(k.startswith("GGUF.") for k in md)


# ---------------------------------------------------------------------------------------
# synthetic GGUF files
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_f32_roundtrip(tmp_path, arch):
    """F32 storage: the reader must give back exactly the HF weights (names, layout, un-permute)."""
    rng = np.random.default_rng(0)
    weights, kv = tiny_model(arch, rng)
    ck = open_checkpoint(write_gguf(tmp_path / "m.gguf", arch, kv, to_gguf_tensors(arch, weights, lambda n, a: None, rng)))
    assert set(ck.tensors()) == set(weights)
    for name, want in weights.items():
        assert ck.tensors()[name] == TensorInfo(name, want.shape, "F32")
        np.testing.assert_array_equal(ck.load(name), want, err_msg=name)
    cfg = ck.config()
    from vtool.models.config import parse_hf_config

    mc = parse_hf_config(cfg)
    assert mc.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert (mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads) == (256, 4, 2)
    assert mc.head_dim == (128 if arch == "qwen3" else 64)
    assert cfg["attention_bias"] == (arch == "qwen2") and not mc.tie_word_embeddings
    assert (cfg["rope_theta"], cfg["rms_norm_eps"], cfg["bos_token_id"], cfg["eos_token_id"]) == (500000.0, 1e-6, 5, 7)


MIXED = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS,
         Q.F16, Q.BF16]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_quantized_equal_transformers(tmp_path, arch):
    """Every supported GGML type, spread over the tensors, against transformers' loader."""
    rng = np.random.default_rng(1)
    weights, kv = tiny_model(arch, rng, tie=arch == "qwen2")
    order = iter(range(10_000))
    pick = lambda name, arr: MIXED[next(order) % len(MIXED)] if arr.ndim == 2 else None  # noqa: E731
    write_gguf(tmp_path / "m.gguf", arch, kv, to_gguf_tensors(arch, weights, pick, rng))
    ck = open_checkpoint(tmp_path / "m.gguf")
    assert {i.dtype for i in ck.tensors().values() if len(i.shape) == 2} == {t.name for t in MIXED}
    sd, hf = transformers_load(tmp_path, "m.gguf")
    expected_extra = {"lm_head.weight"} if arch == "qwen2" else set()
    assert set(sd) - set(ck.tensors()) == expected_extra and set(ck.tensors()) <= set(sd)
    for name, info in ck.tensors().items():
        arr = ck.load(name)
        assert arr.shape == info.shape == sd[name].shape, name
        np.testing.assert_array_equal(arr, sd[name], err_msg=f"{name} ({info.dtype})")
    cfg = ck.config()
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                "intermediate_size", "vocab_size", "tie_word_embeddings"):
        assert cfg[key] == getattr(hf, key), key
    # Qwen2Config has no head_dim field: it is hidden_size / num_attention_heads there
    assert cfg["head_dim"] == getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def test_gguf_dequant_shapes_per_type(tmp_path):
    """Each type: torch-order shape and the values of gguf.quants.dequantize."""
    rng = np.random.default_rng(2)
    tensors: dict[str, Any] = {}
    types = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]
    for i, qt in enumerate(types):
        tensors[f"blk.{i}.ffn_up.weight"] = (random_blocks(3 + i, 512, qt, rng), qt)
    tensors["blk.0.ffn_down.weight"] = rng.standard_normal((5, 7)).astype(np.float16)
    tensors["blk.0.ffn_gate.weight"] = (gguf.quants.quantize(rng.standard_normal((4, 6)).astype(np.float32), Q.BF16), Q.BF16)
    ck = open_checkpoint(write_gguf(tmp_path / "t.gguf", "llama", {}, tensors))
    for i, qt in enumerate(types):
        name = f"model.layers.{i}.mlp.up_proj.weight"
        assert ck.tensors()[name] == TensorInfo(name, (3 + i, 512), qt.name)
        want = gguf.quants.dequantize(tensors[f"blk.{i}.ffn_up.weight"][0], qt)
        np.testing.assert_array_equal(ck.load(name), want)
    assert ck.load("model.layers.0.mlp.down_proj.weight", "float16").dtype == np.float16
    np.testing.assert_array_equal(ck.load("model.layers.0.mlp.down_proj.weight"),
                                  tensors["blk.0.ffn_down.weight"].astype(np.float32))
    bf = ck.load("model.layers.0.mlp.gate_proj.weight", "bfloat16")
    assert bf.shape == (4, 6) and bf.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bf.view(np.uint16), tensors["blk.0.ffn_gate.weight"][0].view(np.uint16))


@given(n_head=st.integers(1, 6), half=st.integers(1, 8), cols=st.integers(0, 3))
@settings(max_examples=50, deadline=None)
def test_unpermute_inverts_llamacpp_permute(n_head, half, cols):
    shape = (n_head * 2 * half,) + ((cols,) if cols else ())
    w = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    np.testing.assert_array_equal(unpermute_rows(llamacpp_permute(w, n_head), n_head), w)


def _llamacpp_rope_factors(theta, dim, factor, low, high, orig):
    # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors, verbatim in spirit
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_freqs_become_rope_scaling(tmp_path, factor):
    rng = np.random.default_rng(3)
    weights, kv = tiny_model("llama", rng)
    tensors = to_gguf_tensors("llama", weights, lambda n, a: None, rng)
    tensors["rope_freqs.weight"] = _llamacpp_rope_factors(500000.0, 64, factor, 1.0, 4.0, 8192)
    ck = open_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", kv, tensors))
    assert ck.config()["rope_scaling"] == {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in ck.tensors() and len(ck.tensors()) == len(weights)
    from vtool.models.config import parse_hf_config

    assert parse_hf_config(ck.config()).rope_scaling["rope_type"] == "llama3"
    assert llama3_rope_scaling(np.ones(32, np.float32), 500000.0, 64) is None


def test_unmappable_rope_freqs_refused(tmp_path):
    rng = np.random.default_rng(4)
    weights, kv = tiny_model("llama", rng)
    tensors = to_gguf_tensors("llama", weights, lambda n, a: None, rng)
    tensors["rope_freqs.weight"] = rng.uniform(1, 3, 32).astype(np.float32)
    ck = open_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", kv, tensors))
    with pytest.raises(CheckpointError, match="rope_freqs.weight"):
        ck.config()


@pytest.mark.parametrize("kind,named", [("longrope", r"longrope.*qwen2\.rope\.scaling\.type"),
                                        ("yarn", r"yarn.*qwen2\.rope\.scaling\.original_context_length")])
def test_unsupported_gguf_rope_scaling_refused(tmp_path, kind, named):
    """longrope outside phi3, and yarn without its original context, are refused by name."""
    kv = tiny_model("qwen2", np.random.default_rng(5))[1] | {"qwen2.rope.scaling.type": kind, "qwen2.rope.scaling.factor": 4.0}
    ck = open_checkpoint(write_gguf(tmp_path / "m.gguf", "qwen2", kv, {"output_norm.weight": np.ones(256, np.float32)}))
    with pytest.raises(CheckpointError, match=named):
        ck.config()


def test_linear_rope_scaling_mapped(tmp_path):
    kv = tiny_model("llama", np.random.default_rng(5))[1] | {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    ck = open_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", kv, {"output_norm.weight": np.ones(256, np.float32)}))
    assert ck.config()["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_gguf_vocab_size_fallbacks(tmp_path):
    kv = tiny_model("llama", np.random.default_rng(6))[1]
    del kv["llama.vocab_size"]
    emb = np.zeros((300, 256), np.float32)
    ck = open_checkpoint(write_gguf(tmp_path / "a.gguf", "llama", kv, {"token_embd.weight": emb}))
    assert ck.config()["vocab_size"] == 300 and ck.config()["tie_word_embeddings"] is True
    kv2 = kv | {"tokenizer.ggml.tokens": [f"t{i}" for i in range(123)]}
    ck2 = open_checkpoint(write_gguf(tmp_path / "b.gguf", "llama", kv2, {"output_norm.weight": np.ones(256, np.float32)}))
    assert ck2.config()["vocab_size"] == 123
    assert ck2.metadata()["tokenizer.ggml.tokens"][:2] == ["t0", "t1"]


def test_unsupported_gguf_architecture_refused(tmp_path):
    kv = {"bloom.block_count": 1, "bloom.embedding_length": 8}
    ck = open_checkpoint(write_gguf(tmp_path / "g.gguf", "bloom", kv, {"output_norm.weight": np.ones(8, np.float32)}))
    with pytest.raises(CheckpointError, match=r"'bloom'.*llama, qwen2, qwen3") as e:
        ck.config()
    assert "g.gguf" in str(e.value)


@pytest.mark.parametrize("qtype", [Q.Q8_1, Q.Q8_K, Q.F64])
def test_unsupported_gguf_tensor_type_refused(tmp_path, qtype):
    if qtype == Q.F64:
        t: Any = np.zeros((2, 4), np.float64)
    else:  # types no model file holds (llama.cpp's activation formats)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        t = (np.zeros((2, 256 // block * size), np.uint8), qtype)
    ck = open_checkpoint(write_gguf(tmp_path / "q.gguf", "llama", {}, {"blk.0.ffn_up.weight": t}))
    with pytest.raises(CheckpointError, match=rf"'blk\.0\.ffn_up\.weight'.*{qtype.name}.*Q5_0.*IQ4_XS"):
        ck.tensors()


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.TQ2_0])
def test_rare_gguf_types_are_dequantized_with_a_notice(tmp_path, qtype, caplog):
    rng = np.random.default_rng(4)
    blocks = random_blocks(4, 512, qtype, rng)
    ck = open_checkpoint(write_gguf(tmp_path / "r.gguf", "llama", {}, {"blk.0.ffn_up.weight": (blocks, qtype)}))
    with caplog.at_level("WARNING", logger="vtool.weights"):
        assert ck.tensors()["model.layers.0.mlp.up_proj.weight"].dtype == qtype.name
    assert f"GGML type {qtype.name}" in caplog.text and "dequantized at load" in caplog.text
    np.testing.assert_array_equal(ck.load("model.layers.0.mlp.up_proj.weight"), gguf.quants.dequantize(blocks, qtype))


@pytest.mark.parametrize("name", ["blk.0.ffn_gate_exps.weight", "blk.0.attn_norm.bias", "rope_factors_long.weight", "blk.x.attn_q.weight"])
def test_unknown_gguf_tensor_refused(tmp_path, name):
    ck = open_checkpoint(write_gguf(tmp_path / "u.gguf", "llama", {}, {name: np.zeros(4, np.float32)}))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        ck.tensors()


def test_not_a_gguf_and_truncated_gguf_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(CheckpointError, match="bad.gguf.*not a GGUF"):
        open_checkpoint(bad)
    rng = np.random.default_rng(7)
    good = write_gguf(tmp_path / "good.gguf", "llama", tiny_model("llama", rng)[1],
                      {"blk.0.ffn_up.weight": rng.standard_normal((64, 64)).astype(np.float32)})
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: truncated: tensor 'blk\.0\.ffn_up\.weight'"):
        open_checkpoint(cut).tensors()
    cut.write_bytes(good.read_bytes()[:300])  # inside the metadata
    with pytest.raises(CheckpointError, match=r"cut\.gguf: unreadable GGUF file \(truncated or corrupt\)"):
        open_checkpoint(cut).config()


def test_runtime_reader_does_not_import_compiler_or_torch(tmp_path):
    rng = np.random.default_rng(8)
    weights, kv = tiny_model("llama", rng)
    path = write_gguf(tmp_path / "m.gguf", "llama", kv, to_gguf_tensors("llama", weights, lambda n, a: Q.Q4_K, rng))
    st_dir = safetensors_dir(tmp_path / "st", {"a": np.ones((2, 2), np.float32)})
    code = (
        "import sys\nfrom vtool.runtime.weights.checkpoint import open_checkpoint\n"
        f"c = open_checkpoint({str(path)!r}); c.config(); c.load('model.layers.0.self_attn.q_proj.weight')\n"
        f"open_checkpoint({str(st_dir)!r}).load('a')\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'tvm')"
        " or m.startswith(('vtool.models', 'vtool.toolchain'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------------------
float_arrays = st.sampled_from(["<f4", "<f2"]).flatmap(
    lambda dt: st.lists(st.integers(0, 5), min_size=0, max_size=3).map(
        lambda shape: np.random.default_rng(sum(shape) + len(shape)).standard_normal(shape).astype(dt)
    )
)


@given(arrays=st.dictionaries(st.from_regex(r"[a-z]{1,6}(\.[a-z0-9]{1,4}){0,3}", fullmatch=True), float_arrays, min_size=1, max_size=5))
@FAST
def test_safetensors_roundtrip(tmp_path_factory, arrays):
    folder = safetensors_dir(tmp_path_factory.mktemp("st"), arrays)
    ck = open_checkpoint(folder)
    assert ck.format == "safetensors" and set(ck.tensors()) == set(arrays)
    for name, arr in arrays.items():
        info = ck.tensors()[name]
        assert info == TensorInfo(name, arr.shape, "F32" if arr.dtype == np.float32 else "F16")
        np.testing.assert_array_equal(ck.load(name, "float16" if arr.dtype == np.float16 else "float32"), arr)
        np.testing.assert_array_equal(ck.load(name), arr.astype(np.float32))
        assert ck.load(name, "bfloat16").dtype == ml_dtypes.bfloat16


def test_safetensors_bf16_from_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as torch_save

    t = torch.randn(6, 10, dtype=torch.bfloat16)
    (tmp_path / "config.json").write_text("{}")
    torch_save({"w": t, "b": torch.randn(3, dtype=torch.float16)}, str(tmp_path / "model.safetensors"))
    ck = open_checkpoint(tmp_path)
    assert ck.tensors()["w"] == TensorInfo("w", (6, 10), "BF16")
    bf = ck.load("w", "bfloat16")
    assert bf.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bf.view(np.uint16), t.view(torch.int16).numpy().view(np.uint16))
    np.testing.assert_array_equal(ck.load("w"), t.float().numpy())
    np.testing.assert_array_equal(ck.load("w", "float16"), t.float().numpy().astype(np.float16))
    b = ck.load("b", "bfloat16")  # f16 -> bf16 goes through f32: one rounding
    np.testing.assert_array_equal(b, ck.load("b").astype(ml_dtypes.bfloat16))


def test_safetensors_config_and_generation_config(tmp_path):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 8}
    folder = safetensors_dir(tmp_path, {"x": np.zeros(2, np.float32)}, cfg)
    ck = open_checkpoint(folder)
    assert ck.config() == cfg and ck.generation_config() is None
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "eos_token_id": [1, 2]}))
    assert ck.generation_config() == {"temperature": 0.7, "eos_token_id": [1, 2]}
    (folder / "generation_config.json").write_text("{not json")
    assert ck.generation_config() is None


def _sharded(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(9)
    a = {"model.layers.0.w": rng.standard_normal((3, 4)).astype(np.float32), "model.norm.weight": np.ones(4, np.float32)}
    b = {"model.layers.1.w": rng.standard_normal((4, 3)).astype(np.float16)}
    (tmp_path / "config.json").write_text("{}")
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    wm = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in b}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return tmp_path, a | b


def test_safetensors_sharded(tmp_path):
    folder, want = _sharded(tmp_path)
    ck = open_checkpoint(folder)
    assert set(ck.tensors()) == set(want)
    for name, arr in want.items():
        np.testing.assert_array_equal(ck.load(name), arr.astype(np.float32))


def test_safetensors_missing_shard_refused(tmp_path):
    folder, _ = _sharded(tmp_path)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors.*missing"):
        open_checkpoint(folder)


def test_safetensors_index_names_tensor_absent_from_shard(tmp_path):
    folder, _ = _sharded(tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.2.w"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.w"):
        open_checkpoint(folder)


@given(frac=st.floats(0.0, 0.999))
@FAST
def test_safetensors_truncation_refused(tmp_path_factory, frac):
    """Any cut refuses with the file named; a cut in the data region also names the tensor."""
    folder = safetensors_dir(tmp_path_factory.mktemp("cut"), {
        "first": np.ones((4, 4), np.float32), "second.weight": np.ones((8, 8), np.float32)})
    file = folder / "model.safetensors"
    data = file.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    header = json.loads(data[8:header_end])
    cut = int(frac * len(data))
    file.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="model.safetensors") as e:
        open_checkpoint(folder)
    if cut >= header_end:
        cut_off = [n for n in ("first", "second.weight") if header_end + header[n]["data_offsets"][1] > cut]
        assert "truncated" in str(e.value) and any(f"'{n}'" in str(e.value) for n in cut_off)
    elif cut >= 8:
        assert "header length" in str(e.value)


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.int32, np.uint8])
def test_safetensors_unsupported_dtype_refused(tmp_path, dtype):
    folder = safetensors_dir(tmp_path, {"ok": np.ones(2, np.float32), "model.position_ids": np.arange(4).astype(dtype)})
    with pytest.raises(CheckpointError, match=r"'model\.position_ids'.*dtype (I64|F64|I32|U8).*BF16"):
        open_checkpoint(folder)


def test_safetensors_unknown_tensor_refused(tmp_path):
    ck = open_checkpoint(safetensors_dir(tmp_path, {"a": np.ones(2, np.float32)}))
    with pytest.raises(CheckpointError, match=r"'model\.embed_tokens\.weight'"):
        ck.load("model.embed_tokens.weight")


def test_open_checkpoint_refusals(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere"):
        open_checkpoint(tmp_path / "nowhere")
    binfile = tmp_path / "pytorch_model.bin"
    binfile.write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*\.gguf"):
        open_checkpoint(binfile)
    with pytest.raises(CheckpointError, match="config.json"):
        open_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*pytorch_model\.bin"):
        open_checkpoint(tmp_path)
