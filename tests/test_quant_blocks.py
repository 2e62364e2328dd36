"""GGUF block repacking (vtool.runtime.weights.quant_blocks) and the build's choice of which
weights stay quantized (vtool.models.weights.kept_formats). No compiler involved.

The repacked parts must dequantize to exactly what gguf.quants.dequantize (the code
transformers' GGUF loader uses) gives: every format's dequantization is exact in float32.
K-quant blocks come from tests/support/quant_gguf.py's numpy encoders (gguf-py cannot quantize
K-quants), themselves held to gguf-py's dequantizer within the quantization error.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quant_gguf import QK_K, encode_q2_k, encode_q3_k, encode_q4_k, encode_q5_k, encode_q6_k, quantize
from vtool.models.config import parse_hf_config
from vtool.models.weights import expected_source_shapes, format_runs, kept_formats, plan_parameters, weight_modules
from vtool.runtime.weights import ggml_blocks
from vtool.runtime.weights.quant_blocks import QuantFormatError, dequantize, repack

Q = gguf.GGMLQuantizationType
FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
F16_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
               "IQ4_XS": (0,)}  # d (and m/dmin)


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(FORMATS), tiles=st.integers(1, 6), blocks=st.integers(1, 3),
       scale=st.sampled_from([1e-3, 0.1, 3.0, 200.0]), seed=st.integers(0, 2**31 - 1))
def test_repack_dequantizes_like_gguf(fmt, tiles, blocks, scale, seed):
    rows, cols = tiles * ggml_blocks.TILE_ROWS, blocks * ggml_blocks.block_cols(fmt)
    w = (np.random.default_rng(seed).standard_normal((rows, cols)) * scale).astype(np.float32)
    raw = quantize(w, Q[fmt])
    parts = repack(fmt, raw, cols)
    assert tuple(parts) == ggml_blocks.parts(fmt)
    for name, arr in parts.items():
        assert arr.shape == ggml_blocks.part_shape(fmt, name, rows, cols)
        assert str(arr.dtype) == ggml_blocks.part_dtype(fmt, name)
        assert arr.flags.c_contiguous
    want = gguf.quants.dequantize(raw, Q[fmt]).reshape(rows, cols)
    np.testing.assert_array_equal(dequantize(fmt, parts), want)


@settings(max_examples=20, deadline=None)
@given(fmt=st.sampled_from(FORMATS), seed=st.integers(0, 2**31 - 1))
def test_repack_of_random_bytes_matches_gguf(fmt, seed):
    """Any byte pattern (not only what the quantizer writes): nibbles, signs, scales."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[Q[fmt]]
    raw = rng.integers(0, 256, size=(8, 2, size), dtype=np.uint8)
    for off in F16_OFFSETS[fmt]:  # finite float16 scales
        raw[..., off:off + 2] = rng.uniform(-2, 2, size=(8, 2, 1)).astype("<f2").view(np.uint8)
    raw = raw.reshape(8, -1)
    want = gguf.quants.dequantize(raw, Q[fmt]).reshape(8, 2 * block)
    np.testing.assert_array_equal(dequantize(fmt, repack(fmt, raw, 2 * block)), want)


def test_block_table_agrees_with_gguf():
    """ggml_blocks (the one table the runtime and the models read) against gguf-py's sizes."""
    assert ggml_blocks.IQ4_VALUES == tuple(gguf.quants.IQ4_NL.kvalues)
    assert set(ggml_blocks.FORMATS) == set(FORMATS)
    assert set(ggml_blocks.QUANT_PARTS) == {p for f in FORMATS for p in ggml_blocks.parts(f)}
    for name, fmt in ggml_blocks.FORMATS.items():
        assert (fmt.block_weights, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[Q[name]]
        assert fmt.block_weights == ggml_blocks.block_cols(name)
        assert ggml_blocks.part_dtype(name, "qweight") == fmt.qweight_dtype


@pytest.mark.parametrize("fmt, most", [("Q8_0", 1.0), ("Q4_0", 1.0), ("Q4_1", 1.0), ("Q5_0", 1.0), ("Q5_1", 1.0),
                                       ("Q2_K", 1.0), ("Q3_K", 114 / 110), ("Q4_K", 148 / 144), ("Q5_K", 180 / 176),
                                       ("Q6_K", 1.0), ("IQ4_NL", 1.0), ("IQ4_XS", 138 / 136)])
def test_repacked_bytes_are_about_the_files(fmt, most):
    """Kept weights cost the file's bytes (Q3_K/Q4_K/Q5_K: their 6-bit scales take a byte each)."""
    rows, cols = 8, 2 * QK_K
    raw = quantize(np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32), Q[fmt])
    assert sum(a.nbytes for a in repack(fmt, raw, cols).values()) == pytest.approx(most * raw.nbytes)


# The K-quant encoders in tests/support/quant_gguf.py: valid blocks, within the quantization error.
@settings(max_examples=20, deadline=None)
@given(scale=st.sampled_from([1e-3, 0.1, 3.0, 200.0]), seed=st.integers(0, 2**31 - 1))
def test_k_quant_encoders_round_trip_through_gguf(scale, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((4, 2 * QK_K)) * scale).astype(np.float32)
    w[1, :QK_K] = 0  # an all-zero super-block
    w[2, :32] = np.abs(w[2, :32]) + scale  # a sub-block with no negative weight
    for enc, qtype, bits, rms in ((encode_q4_k, Q.Q4_K, 4, 0.09), (encode_q5_k, Q.Q5_K, 5, 0.045),
                                  (encode_q6_k, Q.Q6_K, 6, 0.025)):
        raw = enc(w)
        assert raw.shape == (4, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
        got = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
        # every weight within half a quantization step of the sub-block's (Q4_K/Q5_K: 32 weights,
        # range max - min over 15/31 steps; Q6_K: 16 weights, |max| over 31), with the
        # rounded-up 6/8-bit scales' slack: 1/63 or 1/127 of the super-block's largest step
        sub = 16 if bits == 6 else 32
        x = w.reshape(4, -1, sub)
        if bits < 6:
            lo = np.minimum(x.min(-1), 0)
            step = (x.max(-1) - lo) / (2 ** bits - 1)
        else:
            step = np.abs(x).max(-1) / 31
        slack = step.reshape(4, -1, QK_K // sub).max(-1, keepdims=True) / (127 if bits == 6 else 63)
        bound = 0.5 * (step.reshape(4, -1, QK_K // sub) + 3 * slack).reshape(4, -1, 1) * (1 + 1e-3)
        assert (np.abs(got - w).reshape(4, -1, sub) <= bound).all(), qtype.name
        assert np.sqrt(np.mean((got - w) ** 2)) <= rms * np.sqrt(np.mean(w ** 2)), qtype.name
        assert np.all(got[1, :QK_K] == 0)


@settings(max_examples=20, deadline=None)
@given(scale=st.sampled_from([1e-3, 0.1, 3.0, 200.0]), seed=st.integers(0, 2**31 - 1))
def test_low_bit_k_quant_encoders_round_trip_through_gguf(scale, seed):
    """Q2_K (q in 0..3 with a 4-bit min per 16) and Q3_K (q in -4..3, signed 6-bit scales per 16):
    every weight within half a step of its 16 weights' (plus the rounded-up scales' slack)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((4, 2 * QK_K)) * scale).astype(np.float32)
    w[1, :QK_K] = 0
    w[2, :16] = np.abs(w[2, :16]) + scale
    for enc, qtype in ((encode_q2_k, Q.Q2_K), (encode_q3_k, Q.Q3_K)):
        raw = enc(w)
        assert raw.shape == (4, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
        got = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
        x = w.reshape(4, -1, 16)
        if qtype == Q.Q2_K:
            step = (x.max(-1) - np.minimum(x.min(-1), 0)) / 3
            slack = step.reshape(4, -1, 16).max(-1, keepdims=True) / 15  # 4-bit scales and mins
            bound = 0.5 * step.reshape(4, -1, 16) + 2 * slack
        else:
            step = np.abs(x).max(-1) / 3.5
            slack = step.reshape(4, -1, 16).max(-1, keepdims=True) / 31
            bound = 0.5 * (step.reshape(4, -1, 16) + 4 * slack)
        assert (np.abs(got - w).reshape(4, -1, 16) <= bound.reshape(4, -1, 1) * (1 + 1e-3)).all(), qtype.name
        assert np.all(got[1, :QK_K] == 0)


@pytest.mark.parametrize("raw_shape, cols, match", [
    ((6, 34), 32, "rows divisible by 4"),
    ((4, 34), 48, "columns by 32"),
    ((4, 35), 32, r"expected \[rows, 34\] bytes"),
])
def test_repack_refuses_bad_sizes(raw_shape, cols, match):
    with pytest.raises(QuantFormatError, match=match):
        repack("Q8_0", np.zeros(raw_shape, np.uint8), cols)


def test_repack_refuses_unknown_format():
    with pytest.raises(QuantFormatError, match="no quantized kernel for GGML type IQ2_XXS"):
        repack("IQ2_XXS", np.zeros((4, 66), np.uint8), 256)


@pytest.mark.parametrize("fmt, raw_shape, cols, match", [
    ("Q4_K", (4, 144), 128, "columns by 256"),
    ("Q6_K", (4, 209), 256, r"expected \[rows, 210\] bytes"),
])
def test_repack_refuses_bad_k_quant_sizes(fmt, raw_shape, cols, match):
    with pytest.raises(QuantFormatError, match=match):
        repack(fmt, np.zeros(raw_shape, np.uint8), cols)


# --- which weights stay in blocks --------------------------------------------------------
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def _stored(types: dict[str, str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    from vtool.models.weights import expected_source_shapes

    cfg = parse_hf_config(CONFIG)
    return {n: (types.get(n, "Q4_1" if len(s) == 2 else "F32"), s) for n, s in expected_source_shapes(cfg).items()}


def test_kept_formats_all_q4_1():
    cfg = parse_hf_config(CONFIG)
    kept, dense = kept_formats(cfg, _stored({}))
    assert kept == {m: "Q4_1" for m in weight_modules(cfg)} and dense == {}


def test_kept_formats_mixed_fused_group_is_split():
    """q/k in Q4_0 with v in Q8_0 cannot be one block matrix: qkv keeps each source in its own
    blocks (a split format, one matmul per run of a format); a group with a part of a type
    without kernels, or a float part, is dequantized, named."""
    cfg = parse_hf_config(CONFIG)
    kept, dense = kept_formats(cfg, _stored({"model.layers.0.self_attn.q_proj.weight": "Q4_0",
                                            "model.layers.0.self_attn.k_proj.weight": "Q4_0",
                                            "model.layers.0.self_attn.v_proj.weight": "Q8_0",
                                            "model.layers.0.mlp.gate_proj.weight": "IQ2_XXS",
                                            "lm_head.weight": "IQ2_XXS", "model.embed_tokens.weight": "F16"}))
    assert kept["model.layers.0.self_attn.qkv_proj"] == "Q4_0,Q4_0,Q8_0"
    assert format_runs(kept["model.layers.0.self_attn.qkv_proj"]) == [("Q4_0", 0, 2), ("Q8_0", 2, 1)]
    assert dense == {"model.layers.0.mlp.gate_up_proj": "IQ2_XXS+Q4_1", "lm_head": "IQ2_XXS"}
    assert "model.embed_tokens" not in kept and "model.embed_tokens" not in dense  # a float table: plain dense


def test_kept_formats_k_quants_need_256_columns():
    """Q4_K/Q6_K stay in blocks only where every source's columns are a multiple of 256: with
    hidden 64 and intermediate 256, down_proj ([64, 256], Q6_K) stays; the rest (64 columns)
    is dequantized, named."""
    cfg = parse_hf_config(CONFIG | {"intermediate_size": 256})
    types = {n: ("Q6_K" if "down_proj" in n else "Q4_K") if len(s) == 2 else "F32"
             for n, s in expected_source_shapes(cfg).items()}
    stored = {n: (types[n], s) for n, s in expected_source_shapes(cfg).items()}
    kept, dense = kept_formats(cfg, stored)
    assert kept == {"model.layers.0.mlp.down_proj": "Q6_K"}
    assert dense == {m: "Q4_K" for m in weight_modules(cfg) if m != "model.layers.0.mlp.down_proj"}


def test_plan_names_the_block_sources():
    class P:
        def __init__(self, shape, dtype):
            self.shape, self.dtype = shape, dtype

    formats = {"model.layers.0.self_attn.qkv_proj": "Q4_1"}
    plan = plan_parameters([("model.layers.0.self_attn.qkv_proj.qweight", P((32, 2, 4, 16), "uint8")),
                            ("model.layers.0.self_attn.qkv_proj.bias", P((128,), "float32")),
                            ("model.layers.0.mlp.down_proj.weight", P((64, 128), "float32"))], formats)
    assert plan[0]["quant"] == {"format": "Q4_1", "part": "qweight"}
    assert plan[0]["transform"] == "concat_rows"
    assert plan[0]["sources"] == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    assert "quant" not in plan[1] and plan[1]["sources"][0].endswith("q_proj.bias")
    assert "quant" not in plan[2] and plan[2]["sources"] == ["model.layers.0.mlp.down_proj.weight"]


def test_plan_names_the_sources_of_each_run_of_a_split_weight():
    """A q|k|v kept as Q5_0 q/k and a Q8_0 v: runs.0 binds q and k's Q5_0 blocks, runs.1 v's Q8_0
    ones; the fused bias stays one parameter over the three."""
    class P:
        def __init__(self, shape, dtype):
            self.shape, self.dtype = shape, dtype

    formats = {"model.layers.0.self_attn.qkv_proj": "Q5_0,Q5_0,Q8_0"}
    p = "model.layers.0.self_attn."
    plan = plan_parameters([(p + "qkv_proj.runs.0.qhigh", P((24, 2, 4, 4), "uint8")),
                            (p + "qkv_proj.runs.1.qweight", P((8, 2, 4, 32), "int8")),
                            (p + "qkv_proj.bias", P((128,), "float32"))], formats)
    assert plan[0]["quant"] == {"format": "Q5_0", "part": "qhigh"} and plan[0]["transform"] == "concat_rows"
    assert plan[0]["sources"] == [p + "q_proj.weight", p + "k_proj.weight"]
    assert plan[1]["quant"] == {"format": "Q8_0", "part": "qweight"} and plan[1]["transform"] == "identity"
    assert plan[1]["sources"] == [p + "v_proj.weight"]
    assert "quant" not in plan[2] and plan[2]["transform"] == "concat_rows"
    assert plan[2]["sources"] == [p + f"{x}_proj.bias" for x in "qkv"]


# --- vtool's light GGUF header reader (runtime/weights/gguf_reader.py GGUFFile) ---------------------------
# Here because the quantized path binds through it. Held to gguf.GGUFReader on the default model.

def test_light_gguf_reader_matches_gguf_package():
    import gguf

    from vtool.runtime.weights.default_model import default_model_path
    from vtool.runtime.weights.ggml_blocks import GGML_TYPES
    from vtool.runtime.weights.gguf_reader import GGUFFile

    for raw, (name, block, size) in GGML_TYPES.items():
        t = gguf.GGMLQuantizationType(raw)
        assert (t.name, *gguf.GGML_QUANT_SIZES[t]) == (name, block, size)
    path = default_model_path()
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(want)
    for key, value in want.items():
        assert ours.fields[key] == value and type(ours.fields[key]) is type(value), key
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type.name, a.shape.tolist(), a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type.name, b.shape.tolist(), int(b.n_bytes), int(b.data_offset))
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
    for a, b in list(zip(ours.tensors, ref.tensors))[:4]:
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))
    only = GGUFFile(path, keep=lambda k: k.startswith("tokenizer."))
    assert set(only.fields) == {k for k in want if k.startswith("tokenizer.")} | {
        k for k in ("general.alignment",) if k in want}
