"""Mixture-of-experts families: Qwen3-MoE (Qwen3MoeForCausalLM) and Mixtral (MixtralForCausalLM).

Tiny random models made by transformers (tests/support/tiny_models.py: 8 experts, top-2, odd
expert sizes 36 and 40, GQA, head_dim != hidden/heads), from safetensors and as llama.cpp lays
them out in GGUF ("qwen3moe"; "llama" with expert tensors for Mixtral: stacked
ffn_{gate,up,down}_exps), give transformers' logits within 1e-4 at float32 (plus transformers'
own float32 rounding, hf_oracle.float32_rounding) and its 32 greedy tokens. The gather-GEMV reads only the chosen experts (NaN in every other expert changes
nothing); a dense layer among MoE layers (mlp_only_layers); quantized stacked experts are
expanded at load; unsupported configs are refused by name; a tiny MoE compiles for sm_90a.
"""
from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch

from hf_gguf import write_moe_as_gguf
from hf_oracle import float32_rounding, greedy
from vtool.models.config import ConfigError, parse_hf_config
from vtool.models.weights import WeightPlanError, check_checkpoint_shapes
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.engine.generate import Generator
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.toolchain.build import build_artifact

PROMPT = [1, 5, 17, 42, 99, 7, 3, 250, 11, 300, 64]
STEPS = 32


@pytest.fixture(scope="module")
def reference(tiny_shape_dir):
    """shape -> (folder, transformers' (prompt logits, greedy tokens, step logits))."""
    from transformers import AutoModelForCausalLM

    made: dict[str, tuple] = {}

    def get(shape: str, steps: int = STEPS):
        if shape not in made:
            folder = tiny_shape_dir(shape)
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            made[shape] = folder, greedy(hf, PROMPT, steps)
        return made[shape]

    return get


def test_the_configs_name_their_experts(reference):
    q = parse_hf_config(json.loads((reference("qwen3moe-experts")[0] / "config.json").read_text()))
    assert (q.family, q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size, q.norm_topk_prob, q.qk_norm) \
        == ("qwen3_moe", 8, 2, 36, False, True)
    m = parse_hf_config(json.loads((reference("mixtral-experts")[0] / "config.json").read_text()))
    assert (m.family, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.norm_topk_prob) \
        == ("mixtral", 8, 2, 40, True)
    assert "num_experts" in q.to_dict()
    dense = parse_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                             "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4})
    assert not any(k in dense.to_dict() for k in ("num_experts", "mlp_only_layers"))  # dense digests unchanged


@pytest.mark.parametrize("shape", ["qwen3moe-experts", "mixtral-experts"])
@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_moe_gives_transformers_logits_and_tokens(reference, tmp_path, shape, source):
    folder, run = reference(shape)
    ref_prompt, ref_tokens, ref_logits = run
    bound = 1e-4 + float32_rounding(folder, PROMPT, run)  # and transformers' own float32 rounding
    path = folder if source == "safetensors" else write_moe_as_gguf(folder, tmp_path / f"{shape}.gguf")
    ckpt = open_checkpoint(path)
    assert ckpt.config()["architectures"] == json.loads((folder / "config.json").read_text())["architectures"]
    gen = Generator(CompiledModel(build_artifact(path, "host", "float32"), ckpt), max_model_len=256)
    err = float(np.abs(gen.prompt_logits(PROMPT) - ref_prompt).max())
    seen: list[np.ndarray] = []
    result = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=STEPS), on_logits=seen.append)
    step_err = max(float(np.abs(a - b).max()) for a, b in zip(seen, ref_logits))
    print(f"{shape} {source}: prompt |diff| {err:.2e}, 32 steps |diff| {step_err:.2e}")
    assert err < bound and step_err < bound, bound
    assert result.token_ids == ref_tokens


def test_dense_layers_among_experts_and_renormalized_weights(reference):
    """Qwen3-MoE's mlp_only_layers keep a dense MLP of intermediate_size; norm_topk_prob true."""
    folder, (ref_prompt, ref_tokens, _) = reference("qwen3moe-dense-layer", 8)
    c = parse_hf_config(json.loads((folder / "config.json").read_text()))
    assert c.norm_topk_prob and c.mlp_only_layers == (1,) and not c.is_moe_layer(1) and c.is_moe_layer(0)
    gen = Generator(CompiledModel(build_artifact(folder, "host", "float32"), open_checkpoint(folder)),
                    max_model_len=256)
    assert float(np.abs(gen.prompt_logits(PROMPT) - ref_prompt).max()) < 1e-4
    assert gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8)).token_ids == ref_tokens


def test_the_gather_gemv_reads_only_the_chosen_experts():
    """The scheduled CPU kernel over weights whose unchosen experts are NaN: the exact result."""
    import tvm

    from vtool.models.moe import gather_gemv
    from vtool.schedules.cpu.moe import schedule_moe_gemv

    experts, top_k, n_out, k_in, tokens = 8, 2, 36, 48, 3
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, 1, k_in)).astype(np.float32)
    w = rng.standard_normal((experts, n_out, k_in)).astype(np.float32)
    idx = np.array([[5, 1], [1, 6], [6, 5]], np.int32)
    poisoned = w.copy()
    poisoned[[e for e in range(experts) if e not in idx]] = np.nan
    func = schedule_moe_gemv(gather_gemv(1, top_k, n_out, k_in, experts, "float32", "float32"), 8)
    assert func is not None and func.attrs["tirx.is_scheduled"]
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    out = tvm.runtime.tensor(np.zeros((tokens, top_k, n_out), np.float32))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(poisoned), tvm.runtime.tensor(idx), out)
    want = np.einsum("tk,tjnk->tjn", x[:, 0], w[idx])
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)


def test_quantized_stacked_experts_are_expanded_at_load(tmp_path):
    """A Q8_0 ffn_*_exps tensor reads as per-expert float tensors, gguf-py's dequantization of each slice."""
    experts, rows, cols, hidden = 4, 32, 64, 64
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "qwen3moe")
    for key, value in (("block_count", 1), ("embedding_length", hidden), ("feed_forward_length", 96),
                       ("attention.head_count", 4), ("expert_count", experts), ("expert_used_count", 2),
                       ("expert_feed_forward_length", rows)):
        w.add_uint32(f"qwen3moe.{key}", value)
    stacked = rng.standard_normal((experts, rows, cols)).astype(np.float32)
    blocks = gguf.quants.quantize(stacked, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_gate_exps.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = open_checkpoint(tmp_path / "q.gguf")
    cfg = ckpt.config()
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], cfg["norm_topk_prob"]) \
        == (experts, 2, rows, True)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    for e in range(experts):
        name = f"model.layers.0.mlp.experts.{e}.gate_proj.weight"
        assert ckpt.tensors()[name].shape == (rows, cols) and ckpt.tensors()[name].dtype == "Q8_0"
        np.testing.assert_array_equal(ckpt.load(name), want[e])


def test_unsupported_moe_configs_are_refused_by_name(reference):
    folder, _ = reference("qwen3moe-experts")
    raw = json.loads((folder / "config.json").read_text())
    for change, name in (({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
                         ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
                         ({"num_local_experts": None}, "num_experts"),
                         ({"num_experts": 4}, "num_local_experts"),
                         ({"mlp_only_layers": [5]}, "mlp_only_layers"),
                         ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
                         ({"moe_intermediate_size": None}, "moe_intermediate_size"),
                         ({"norm_topk_prob": "yes"}, "norm_topk_prob")):
        with pytest.raises(ConfigError, match=name):
            parse_hf_config({**raw, **change})
    c = parse_hf_config(raw)
    shapes = {n: t.shape for n, t in open_checkpoint(folder).tensors().items()}
    check_checkpoint_shapes(c, shapes, "tiny")
    del shapes["model.layers.1.mlp.experts.7.down_proj.weight"]
    with pytest.raises(WeightPlanError, match=r"experts\.7\.down_proj"):
        check_checkpoint_shapes(c, shapes, "tiny")


@pytest.mark.slow
def test_a_tiny_moe_compiles_for_sm_90a(reference, tmp_path):
    """CUDA: the hand-scheduled gather-GEMV and router (schedules/cuda/moe.py) compile into the
    fatbin (the GPU parity tests run them against transformers and numpy)."""
    from vtool.toolchain.cuda import CudaBuildError, find_nvcc

    folder, _ = reference("qwen3moe-experts")
    try:
        find_nvcc()
    except CudaBuildError as err:
        pytest.skip(f"!!! CUDA BUILDS ARE NOT TESTED HERE: {err} !!!")
    artifact = build_artifact(folder, "sm_90a", "bfloat16")
    library = (artifact / "model.so").read_bytes()
    assert b"moe_gemv" in library and b"moe_route" in library
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["target"]["name"] if isinstance(manifest["target"], dict) else manifest["target"]
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("shape", [(1, 2, 72, 48, 8), (2, 2, 48, 36, 8), (8, 8, 2048, 768, 16)],
                         ids=["gate-up-36", "down-36", "down-768"])
def test_the_cuda_gather_gemv_lowers_to_a_cross_thread_reduction(shape):
    """schedules/cuda/moe.py splits each output's reduction over 32 lanes; TVM's
    LowerCrossThreadReduction must turn that into a warp reduction, or the lanes race on one
    output. It silently skipped the kernel while its loops mixed int32 and int64 (every CUDA
    MoE model was wrong on the H200). No GPU needed: this checks the lowered TIR."""
    import tvm
    from tvm import s_tir

    from vtool.models.moe import gather_gemv
    from vtool.schedules.cuda.moe import schedule_moe
    from vtool.targets import lookup

    func = gather_gemv(*shape, "bfloat16", "bfloat16").with_attr("global_symbol", "moe_gemv")
    scheduled = schedule_moe(func)
    assert scheduled is not None
    with tvm.target.Target(lookup("sm_90a").tvm):
        lowered = s_tir.transform.LowerCrossThreadReduction()(tvm.IRModule({"moe_gemv": scheduled}))
    assert "tvm_thread_allreduce" in lowered.script()


def test_the_cuda_moe_schedule_refuses_mixed_loop_types():
    import tvm
    from tvm import te, tirx

    from vtool.schedules.cuda.moe import GEMV_BLOCK, schedule_moe

    n = tirx.Var("n", "int64")
    x, w = te.placeholder((n, 36), "float32", name="x"), te.placeholder((8, 48, 36), "float32", name="w")
    idx = te.placeholder((n,), "int32", name="idx")
    c = te.reduce_axis((0, 36), name="c")
    out = te.compute((n, 1, 48), lambda t, j, o: te.sum(x[t, c] * w[idx[t], o, c], axis=c), name=GEMV_BLOCK)
    with pytest.raises(ValueError, match="cross-thread"):
        schedule_moe(te.create_prim_func([x, w, idx, out]))
    del tvm
