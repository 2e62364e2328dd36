"""Gemma-2 (Gemma2ForCausalLM) and Gemma-3 text (Gemma3ForCausalLM), from safetensors and from
llama.cpp's "gemma2"/"gemma3" GGUF, against transformers at float32.

The tiny shapes (tests/support/tiny_models.py) have a sliding window of 8 and prompts of 40
tokens, so the windowed layers (TVM's per-layer "mha_sliding" KV cache) differ from global
attention in the prompt and in all 32 decode steps; Gemma-3's local and global rope bases and
its linear scaling are applied by the model (ModelConfig.model_rope). Gemma-2's attention logit
soft-cap (2.0 on the tiny model, where it changes every logit) is applied inside every attention
kernel (models/softcap.py): vtool's parallel CPU kernels at head_dim 256, TVM's serial ones at
head_dim 12. Refused by name: bidirectional attention, other activations and rope types."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import tvm

from hf_oracle import float32_rounding, greedy
from vtool.models.config import ConfigError, parse_hf_config
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.engine.generate import Generator
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.toolchain.build import build_artifact

PROMPT = [1] + np.random.default_rng(1).integers(3, 500, 39).tolist()  # 40 tokens: 5 windows of 8
STEPS = 32
TOL = 1e-4
SHAPES = {"gemma3": "gemma3-window", "gemma2": "gemma2-softcap"}


def oracle(folder: Path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return greedy(hf, PROMPT, STEPS)


def tolerance(folder: Path, ref) -> float:
    """TOL plus transformers' own float32 rounding on the run `ref` of the model in `folder`
    (hf_oracle.float32_rounding): what a correct float32 build may differ by."""
    return TOL + float32_rounding(folder, PROMPT, ref, attn_implementation="eager")


def compare(artifact: Path, checkpoint: Path, ref) -> dict[str, float]:
    """vtool's prompt logits (every position), greedy tokens and step logits against `ref`."""
    ref_prompt, ref_tokens, ref_logits = ref
    gen = Generator(CompiledModel(artifact, open_checkpoint(checkpoint)), max_model_len=256)
    prompt_err = float(np.abs(gen.prompt_logits(PROMPT) - ref_prompt).max())
    seen: list[np.ndarray] = []
    result = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=STEPS), on_logits=seen.append)
    assert result.token_ids == ref_tokens
    step_err = max(float(np.abs(a - b).max()) for a, b in zip(seen, ref_logits))
    return {"prompt": prompt_err, "steps": step_err}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def gemma(request, tiny_shape_dir):
    """(family, tiny HF folder, its host float32 artifact, transformers' greedy run)."""
    folder = tiny_shape_dir(SHAPES[request.param])
    return request.param, folder, build_artifact(folder, "host", "float32"), oracle(folder)


def test_safetensors_match_transformers(gemma):
    family, folder, artifact, ref = gemma
    errors = compare(artifact, folder, ref)
    print(family, "max |diff|", errors)
    assert max(errors.values()) < tolerance(folder, ref), errors


def test_the_window_matters(gemma):
    """The same weights with global attention everywhere give other logits: the window is real."""
    family, folder, _, (ref_prompt, _, _) = gemma
    from transformers import AutoModelForCausalLM

    cfg = json.loads((folder / "config.json").read_text())
    full = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                sliding_window=len(PROMPT) + STEPS).eval()
    with torch.no_grad():
        unwindowed = full(torch.tensor([PROMPT])).logits[0].numpy()
    assert cfg["sliding_window"] < len(PROMPT)
    assert float(np.abs(unwindowed - ref_prompt)[cfg["sliding_window"]:].max()) > 100 * TOL


def test_the_cap_matters(tiny_shape_dir):
    """Gemma-2's tiny model without its attention logit soft-cap gives other logits and tokens in
    transformers: the cap bites at every position, so a kernel that drops it fails the parity tests."""
    from transformers import AutoModelForCausalLM

    folder = tiny_shape_dir(SHAPES["gemma2"])
    ref_prompt, ref_tokens, _ = oracle(folder)
    uncapped = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                    attn_logit_softcapping=None).eval()
    prompt, tokens, _ = greedy(uncapped, PROMPT, STEPS)
    # at every position with more than one key to weigh (the first attends to itself alone)
    assert float(np.abs(prompt - ref_prompt)[1:].max(axis=-1).min()) > 100 * TOL
    assert tokens != ref_tokens


def test_the_config(gemma):
    family, folder, artifact, _ = gemma
    c = parse_hf_config(json.loads((folder / "config.json").read_text()))
    assert c.family == family and c.sandwich_norms and c.embed_scale and c.mlp_act == "gelu_tanh" and c.model_rope
    assert c.sliding_window == 8
    if family == "gemma3":
        assert c.sliding_layers == (0, 2) and c.qk_norm and c.rope_local_theta == 10000.0
        assert c.rope_theta == 1e6 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
        assert c.attn_scale == pytest.approx(24**-0.5)
        assert c.attn_logit_softcap == 0.0
    else:
        assert c.sliding_layers == (0,) and not c.qk_norm and c.final_logit_softcap == 10.0
        assert c.attn_logit_softcap == 2.0
        assert c.attn_scale == pytest.approx(20**-0.5)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["config"].get("attn_logit_softcap", 0.0) == c.attn_logit_softcap  # in the compiled config
    norms = [p for p in manifest["params"] if p["name"].endswith("norm.weight")]
    assert norms and all(p["transform"] == "plus_one" for p in norms)
    raw = json.loads((folder / "config.json").read_text())
    assert manifest["source_config"]["query_pre_attn_scalar"] == raw["query_pre_attn_scalar"]  # in the build key


def write_gemma_gguf(folder: Path, path: Path, arch: str, pattern: list[bool] | None = None,
                     matrices: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    """`folder`'s tiny HF Gemma as llama.cpp's converter writes it: gguf-py's tensor names, norms
    as 1 + w, no lm_head for gemma2, key/value lengths, the window, soft-capping, linear rope
    scaling (gemma3); `pattern`: the per-layer sliding flags (gguf-py's sliding_window_pattern);
    2-D tensors in `matrices` (gguf-py's quantizer)."""
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_vocab_size(cfg["vocab_size"])
    rope = cfg["rope_parameters"]
    if arch == "gemma2":
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if cfg.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    else:
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    for hf, arr in load_file(str(folder / "model.safetensors")).items():
        if hf == "lm_head.weight" and arch == "gemma2":
            continue
        module, leaf = hf.rsplit(".", 1)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        name = names.get_name(module) + "." + leaf
        if arr.ndim == 2 and matrices != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(arr, matrices), raw_dtype=matrices)
        else:
            w.add_tensor(name, arr + 1 if hf.endswith("norm.weight") else arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_view(folder: Path, out: Path, tie: bool) -> Path:
    """The tiny model as llama.cpp sees its GGUF: attention scaled by 1/sqrt(head_dim) (its files
    carry no query_pre_attn_scalar), and tied (`tie`: gemma2 files have no output tensor)."""
    from safetensors.numpy import load_file, save_file

    cfg = json.loads((folder / "config.json").read_text())
    shutil.copytree(folder, out)
    (out / "config.json").write_text(json.dumps(cfg | {"query_pre_attn_scalar": cfg["head_dim"]}
                                                | ({"tie_word_embeddings": True} if tie else {})))
    if tie:
        tensors = load_file(str(folder / "model.safetensors"))
        tensors.pop("lm_head.weight", None)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_gguf_gives_transformers_logits_and_tokens(gemma, tmp_path):
    """The layer pattern is written as gguf-py's sliding_window_pattern (gemma3); the oracle is
    the model as llama.cpp reads it (llama_cpp_view)."""
    family, folder, _, _ = gemma
    cfg = json.loads((folder / "config.json").read_text())
    as_llama_cpp = llama_cpp_view(folder, tmp_path / "hf", tie=family == "gemma2")
    pattern = [t == "sliding_attention" for t in cfg["layer_types"]]
    path = write_gemma_gguf(as_llama_cpp, tmp_path / f"{family}.gguf", family,
                            pattern if family == "gemma3" else None)
    ckpt = open_checkpoint(path)
    got = ckpt.config()
    assert got["architectures"] == cfg["architectures"] and got["layer_types"] == cfg["layer_types"]
    c = parse_hf_config(got)
    assert c.sliding_window == 8 and c.attn_scale == pytest.approx(cfg["head_dim"] ** -0.5)
    assert c.attn_logit_softcap == (cfg["attn_logit_softcapping"] or 0.0)  # gemma2: 2.0, from the file
    norm = "model.layers.0.pre_feedforward_layernorm.weight"
    from safetensors.numpy import load_file

    np.testing.assert_array_equal(ckpt.load(norm), load_file(str(folder / "model.safetensors"))[norm])
    assert got["tie_word_embeddings"] == (family == "gemma2")
    ref = oracle(as_llama_cpp)
    errors = compare(build_artifact(path, "host", "float32"), path, ref)
    print(family, "gguf max |diff|", errors)
    assert max(errors.values()) < tolerance(as_llama_cpp, ref), errors


def test_q8_0_blocks_stay_in_blocks(tmp_path, tiny_shape_dir):
    """A Gemma-3 GGUF with Q8_0 matrices: kept in blocks (Q8_0 weights and activations), so
    near transformers, not equal."""
    folder = tiny_shape_dir("gemma3-window")
    cfg = json.loads((folder / "config.json").read_text())
    as_llama_cpp = llama_cpp_view(folder, tmp_path / "hf", tie=False)
    pattern = [t == "sliding_attention" for t in cfg["layer_types"]]
    path = write_gemma_gguf(folder, tmp_path / "q8.gguf", "gemma3", pattern, gguf.GGMLQuantizationType.Q8_0)
    artifact = build_artifact(path, "host", "float32", quantization="gguf")
    kept = json.loads((artifact / "manifest.json").read_text())["quantized_weights"]["kept"]
    assert kept.get("Q8_0", 0) >= 4 * 3
    ref_prompt, ref_tokens, _ = oracle(as_llama_cpp)
    gen = Generator(CompiledModel(artifact, open_checkpoint(path)), max_model_len=256)
    err = float(np.abs(gen.prompt_logits(PROMPT) - ref_prompt).max())
    print("gemma3 q8_0 max |diff|", err)
    assert err < 0.1 * float(np.abs(ref_prompt).max()), err
    assert gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4)).token_ids[:2] == ref_tokens[:2]


def test_llama_cpp_layer_defaults_without_a_pattern(tmp_path, tiny_shape_dir):
    """No sliding_window_pattern in the file: gemma3 has one global layer in 6, gemma2 alternates."""
    ckpt = open_checkpoint(write_gemma_gguf(tiny_shape_dir("gemma3-window"), tmp_path / "g3.gguf", "gemma3"))
    assert ckpt.config()["layer_types"] == ["sliding_attention"] * 3
    assert ckpt.config()["rope_local_base_freq"] == 10000.0
    ckpt = open_checkpoint(write_gemma_gguf(tiny_shape_dir("gemma2-softcap"), tmp_path / "g2.gguf", "gemma2"))
    assert ckpt.config()["layer_types"] == ["sliding_attention", "full_attention"]
    assert ckpt.config()["final_logit_softcapping"] == 10.0
    assert ckpt.config()["attn_logit_softcapping"] == 2.0


@pytest.mark.parametrize("change, field", [
    ({"attn_logit_softcapping": "50"}, "attn_logit_softcapping"),  # a cap builds (below); a non-number does not
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "yarn"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
])
def test_refusals_name_the_field(change, field, tiny_shape_dir):
    cfg = json.loads((tiny_shape_dir("gemma3-window") / "config.json").read_text())
    with pytest.raises(ConfigError, match=field):
        parse_hf_config(cfg | change)


def test_other_families_configs_are_unchanged():
    """The Gemma hooks stay out of other families' ModelConfig dicts (so their digests hold)."""
    from vtool.models.config import _GEMMA_FIELDS, source_config

    llama = parse_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
                             "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2})
    assert not set(_GEMMA_FIELDS) & set(llama.to_dict())
    assert "query_pre_attn_scalar" not in source_config({"architectures": ["LlamaForCausalLM"]})


def test_qwen2_sliding_window_layers_match_transformers(tiny_shape_dir):
    """Qwen2's use_sliding_window on the same per-layer mechanism (its layers from max_window_layers)."""
    folder = tiny_shape_dir("qwen2-window")
    c = parse_hf_config(json.loads((folder / "config.json").read_text()))
    assert (c.sliding_window, c.sliding_layers, c.model_rope) == (8, (1,), False)
    ref = oracle(folder)
    errors = compare(build_artifact(folder, "host", "float32"), folder, ref)
    print("qwen2-window max |diff|", errors)
    assert max(errors.values()) < tolerance(folder, ref), errors


def test_tvms_serial_cpu_kernels_cap_too(tmp_path, monkeypatch):
    """At a head_dim that is no multiple of 16 the CPU build keeps TVM's serial attention kernels
    (ragged, paged, decode, sliding-window prefill and decode: schedules/cpu/attention.py takes
    only the others), capped by models/softcap.py: Gemma-2's tiny model at head_dim 12 matches."""
    import tiny_models

    monkeypatch.setitem(tiny_models.TINY_SHAPES, "gemma2-softcap-d12",
                        dict(tiny_models.TINY_SHAPES["gemma2-softcap"], head_dim=12))
    folder = tiny_models.make_tiny_model("gemma2-softcap-d12", tmp_path / "d12")
    assert parse_hf_config(json.loads((folder / "config.json").read_text())).attn_logit_softcap == 2.0
    ref = oracle(folder)
    errors = compare(build_artifact(folder, "host", "float32"), folder, ref)
    print("gemma2-softcap head_dim 12 max |diff|", errors)
    assert max(errors.values()) < tolerance(folder, ref), errors


def _attention_kernels(shape: str, target: str, dtype: str, tiny_shape_dir) -> tvm.IRModule:
    """The tiny model's Relax module as a build exports it (before the pipeline)."""
    from vtool.targets import lookup
    from vtool.targets.host import best_host_target
    from vtool.toolchain.build import model_module

    cfg = parse_hf_config(json.loads((tiny_shape_dir(shape) / "config.json").read_text()))
    spec = lookup(best_host_target() if target == "host" else target)
    return model_module(cfg, spec, dtype, lambda _m: None)[1]


def _capped_kernels(mod: tvm.IRModule) -> dict[str, tuple[float, int]]:
    """name -> (the cap attribute, tanh calls in its text) of each attention kernel (an sm_scale parameter)."""
    from vtool.models.softcap import sm_scale_param
    from vtool.schedules.softcap import softcap_of

    return {gv.name_hint: (softcap_of(f), f.script().count("T.tanh("))
            for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc) and sm_scale_param(f) is not None}


def test_every_attention_kernel_caps_its_scores_once(tiny_shape_dir):
    """Each attention kernel of the KV cache (CPU and CUDA: prefill, decode, ragged prefill, their
    sliding-window variants, tree attention) caps its score exactly once, and vtool's kernels that
    replace TVM's take the cap over: the CPU rules, CUDA's split-KV decode and short prefill.
    A model without a cap has none anywhere."""
    from vtool.models import softcap as model_softcap
    from vtool.schedules import softcap as schedule_softcap
    from vtool.schedules.cpu import attention as cpu
    from vtool.schedules.cuda.decode_attention import replace_decode_attention
    from vtool.schedules.cuda.short_prefill_attention import (SHORT_SYMBOL, TILED_SYMBOL,
                                                              replace_prefill_paged_attention)

    assert model_softcap.ATTR == schedule_softcap.ATTR
    host = _capped_kernels(_attention_kernels("gemma2-softcap", "host", "float32", tiny_shape_dir))
    assert {"batch_prefill_ragged_kv", "batch_prefill_paged_kv_cpu", "batch_decode_paged_kv_cpu",
            "batch_prefill_paged_kv_cpu_sliding_window", "batch_decode_paged_kv_cpu_sliding_window"} <= set(host)
    assert set(host.values()) == {(2.0, 1)}, host
    mod = _attention_kernels("gemma2-softcap", "host", "float32", tiny_shape_dir)
    rules = (cpu.rewrite_prefill_ragged, cpu.rewrite_prefill_paged, cpu.rewrite_decode_paged,
             cpu.rewrite_prefill_paged_sliding, cpu.rewrite_decode_paged_sliding)
    rewritten = {gv.name_hint: new for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)
                 for new in [next((r(gv.name_hint, f) for r in rules if r(gv.name_hint, f) is not None), None)]
                 if new is not None}
    assert len(rewritten) == 5  # head_dim 256: all five of vtool's CPU kernels, each capped
    assert all(f.script().count("T.tanh(") >= 1 for f in rewritten.values())

    cuda = _attention_kernels("gemma2-softcap", "sm_90a", "bfloat16", tiny_shape_dir)
    assert {"batch_prefill_ragged_kv", "batch_prefill_paged_kv", "batch_decode_paged_kv",
            "batch_prefill_paged_kv_sliding_window",
            "batch_decode_paged_kv_sliding_window"} <= set(_capped_kernels(cuda))
    assert set(_capped_kernels(cuda).values()) == {(2.0, 1)}
    cuda, replaced = replace_decode_attention(cuda)
    assert replaced == 1 and "T.tanh(" in cuda["batch_decode_paged_kv"].script()
    cuda, replaced = replace_prefill_paged_attention(cuda)
    assert replaced == 1 and all("T.tanh(" in cuda[s].script() for s in (SHORT_SYMBOL, TILED_SYMBOL))

    for target, dtype in (("host", "float32"), ("sm_90a", "bfloat16")):  # Gemma-3: no cap, TVM's kernels as they are
        plain = _attention_kernels("gemma3-window", target, dtype, tiny_shape_dir)
        assert set(_capped_kernels(plain).values()) == {(0.0, 0)}


def test_embedding_gemma_refuses_an_attention_cap(tiny_shape_dir):
    """EmbeddingGemma's dense attention (models/gemma_encoder.py) applies no cap: a config with one is refused."""
    cfg = json.loads((tiny_shape_dir("gemma3-window") / "config.json").read_text())
    encoder = cfg | {"architectures": ["Gemma3TextModel"], "use_bidirectional_attention": True}
    assert parse_hf_config(encoder).attn_logit_softcap == 0.0
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        parse_hf_config(encoder | {"attn_logit_softcapping": 50.0})


def test_the_engine_chunks_prompts_by_the_window(gemma):
    """The batching engine feeds at most the window per sequence and step (TVM's cache masks
    the window over cached keys only) and keeps the prefix cache off: two requests batched give
    transformers' greedy tokens."""
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.session import Session

    family, folder, artifact, (_, ref_tokens, _) = gemma
    model = CompiledModel(artifact, open_checkpoint(folder))
    session = Session(open_checkpoint(folder), model, None, [], 256, Generator(model, 256))  # ids in, ids out
    engine = Engine(session, EngineConfig(max_num_batched_tokens=64))
    assert engine.scheduler.config.max_chunk == 8 and engine.prefix_cache is None
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    for rid, prompt in (("a", PROMPT), ("b", PROMPT[:13])):
        engine.add_request(rid, prompt, params, with_text=False)
    done: dict[str, list[int]] = {"a": [], "b": []}
    while engine.has_unfinished():
        for out in engine.step_core():  # token ids only: no tokenizer
            done[out.request_id].extend(out.new_token_ids)
    assert done["a"] == ref_tokens and len(done["b"]) == STEPS


@pytest.mark.slow
def test_a_tiny_gemma3_compiles_for_sm_90a(tiny_shape_dir):
    """CUDA (no GPU needed): the sliding-window attention kernels and the model's rope compile
    into the library (never run on a GPU here)."""
    from vtool.toolchain.cuda import CudaBuildError, find_nvcc

    try:
        find_nvcc()
    except CudaBuildError as err:
        pytest.skip(f"!!! CUDA BUILDS ARE NOT TESTED HERE: {err} !!!")
    artifact = build_artifact(tiny_shape_dir("gemma3-window"), "sm_90a", "bfloat16")
    library = (artifact / "model.so").read_bytes()
    assert b"batch_prefill_paged_kv_sliding_window" in library and b"model_rope" in library
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["config"]["sliding_layers"] == [0, 2] and manifest["config"]["model_rope"] is True


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tiny_gemma2_with_its_attention_cap_compiles_for_sm_90a(dtype, tiny_shape_dir):
    """CUDA (no GPU needed): TVM's attention kernels capped and vtool's split-KV decode and
    short prefill with the cap compile, SASS for sm_90a (the GPU parity tests run them)."""
    from vtool.toolchain.cuda import CudaBuildError, find_nvcc

    try:
        find_nvcc()
    except CudaBuildError as err:
        pytest.skip(f"!!! CUDA BUILDS ARE NOT TESTED HERE: {err} !!!")
    artifact = build_artifact(tiny_shape_dir("gemma2-softcap"), "sm_90a", dtype)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["config"]["attn_logit_softcap"] == 2.0 and manifest["attention"] == "tir"
    assert manifest["build"]["cuda"]["embedded"]["sass"] == ["sm_90a"]
    assert manifest["build"]["pipeline"]["passes"][:2] == ["VtoolSplitKVDecodeAttention", "VtoolShortPrefillAttention"]
