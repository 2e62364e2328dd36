"""Whole models with weights kept in GGUF blocks (`--quantization gguf`), on tiny llama
GGUF files quantized by gguf-py: greedy tokens and logits against transformers running
the same file through its own GGUF loader (which dequantizes to float32), the manifest's
record of what stayed quantized, and the refusals. The K-quant files (Q2_K..Q6_K blocks
from tests/support/quant_gguf.py's encoders) have hidden and intermediate sizes that are multiples
of 256, the K-quants' block.

Tolerance: logits within 1e-4 of transformers (as the float32 parity tests): the weights
are dequantized exactly in both, only summation order differs. Where vtool's decode GEMVs
quantize the activation row (schedules/cpu/int8_gemv.py), the oracle quantizes the same inputs
with gguf-py's Q8_0 quantizer.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
import tvm

from hf_oracle import greedy, q8_0_activations, q8_k_activations
from quant_gguf import K_SHAPE, SHAPE, Q, gguf_name, write_tiny_gguf
from vtool import VtoolError
from vtool.models.int8_activations import INT8_FORMATS, Q8_K_FORMATS
from vtool.models.int8_activations import isa_for_target as int8_isa_for
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.weights.ggml_blocks import FORMATS
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.runtime.engine.generate import Generator
from vtool.runtime.artifact.manifest import ManifestError
from vtool.runtime.sampling.params import SamplingParams
from vtool.targets import buildable
from vtool.toolchain.build import build_artifact

TOLERANCE = 1e-4
STEPS = 16
PROMPT = [1, 17, 42, 99, 7, 3, 250, 11, 64, 5, 200, 31]

# name -> (type of each 2-D tensor by GGUF name, tied embedding, what the manifest must keep, shape)
VARIANTS = {
    "q8_0": (lambda name: Q.Q8_0, True, {"Q8_0": 9}, SHAPE),
    "q4_0": (lambda name: Q.Q8_0 if name == "token_embd.weight" else Q.Q4_0, False, {"Q4_0": 9, "Q8_0": 1}, SHAPE),
    # SmolLM2's mix: Q4_1 layers, Q8_0 tied embedding
    "q4_1": (lambda name: Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1, True, {"Q4_1": 8, "Q8_0": 1}, SHAPE),
    # v and up in another format than q/k and gate: the fused q|k|v and gate|up keep each part in
    # its own blocks (Q4_1 matmuls for q|k and gate, Q8_0 ones for v and up: SplitQuantizedLinear)
    "mixed": (lambda name: Q.Q8_0 if ".attn_v." in name or ".ffn_up." in name
              else Q.Q4_1 if name != "output.weight" else Q.Q4_0,
              False, {"Q4_1": 9, "Q8_0": 4, "Q4_0": 1}, SHAPE),
    # several formats, as real Q4_K_M files mix them: a Q5_0 tied embedding (Qwen2.5-Coder's;
    # its gather and the lm_head's integer GEMV), Q5_1 feed-forward, Q4_1 attention
    "q5_mix": (lambda name: Q.Q5_0 if name == "token_embd.weight" else Q.Q5_1 if ".ffn_" in name else Q.Q4_1,
               True, {"Q4_1": 4, "Q5_1": 4, "Q5_0": 1}, SHAPE),
    # Q5_1 everywhere, the tied embedding included
    "q5_1": (lambda name: Q.Q5_1, True, {"Q5_1": 9}, SHAPE),
    # Q4_K layers, Q6_K tied embedding (its gather and the lm_head GEMV)
    "q4_k": (lambda name: Q.Q6_K if name == "token_embd.weight" else Q.Q4_K, True, {"Q4_K": 8, "Q6_K": 1}, K_SHAPE),
    # Q5_K everywhere, the tied embedding included (and Q3_K, Q2_K)
    "q5_k": (lambda name: Q.Q5_K, True, {"Q5_K": 9}, K_SHAPE),
    "q3_k": (lambda name: Q.Q3_K, True, {"Q3_K": 9}, K_SHAPE),
    "q2_k": (lambda name: Q.Q2_K, True, {"Q2_K": 9}, K_SHAPE),
    # the non-linear 4-bit types: IQ4_NL (Q8_0 activations), IQ4_XS (Q8_K), the output matrix Q8_0 / Q6_K
    "iq4_nl": (lambda name: Q.Q8_0 if name == "output.weight" else Q.IQ4_NL, False, {"IQ4_NL": 9, "Q8_0": 1}, SHAPE),
    "iq4_xs": (lambda name: Q.Q6_K if name == "output.weight" else Q.IQ4_XS, False, {"IQ4_XS": 9, "Q6_K": 1},
               K_SHAPE),
    # llama.cpp's Q4_K_M mix: v, down and the output in Q6_K, the rest Q4_K (q|k and v: two matmuls)
    "q4_k_m": (lambda name: Q.Q6_K if ".attn_v." in name or ".ffn_down." in name or name == "output.weight"
               else Q.Q4_K,
               False, {"Q4_K": 7, "Q6_K": 5}, K_SHAPE),
}
SPLIT_QKV = {"mixed": ("Q4_1", "Q8_0"), "q4_k_m": ("Q4_K", "Q6_K")}  # fused q|k|v: (q and k, v) formats


def _hf_model(path: Path):
    import transformers

    kwargs = {"gguf_file": path.name, "dtype": torch.float32}
    if hasattr(transformers, "GgufConfig"):
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), **kwargs).eval()


QUICK = {"q4_1"}  # the default model's formats; the others are slow (test_quant_kernels.py covers each kernel)


@pytest.fixture(scope="module", params=[pytest.param(v, marks=() if v in QUICK else pytest.mark.slow)
                                        for v in sorted(VARIANTS)])
def variant(request, tmp_path_factory):
    qtype_of, tie, kept, shape = VARIANTS[request.param]
    path = write_tiny_gguf(tmp_path_factory.mktemp(request.param) / "m.gguf", qtype_of, tie=tie, shape=shape)
    ckpt = open_checkpoint(path)
    artifact = build_artifact(path, "host", "float32", checkpoint=ckpt, quantization="gguf")
    return request.param, path, artifact, Generator(CompiledModel(artifact, ckpt), max_model_len=128), kept


def test_manifest_records_the_kept_formats(variant):
    name, path, artifact, _, kept = variant
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"] == "gguf"
    assert manifest["quantized_weights"]["kept"] == kept
    quant_bytes = sum(int(np.prod(e["shape"])) * np.dtype(e["dtype"]).itemsize
                      for e in manifest["params"] if "quant" in e)
    assert quant_bytes > 0
    # every 2-D weight stays in blocks: about the file's size, never a float copy
    assert manifest["quantized_weights"]["dequantized"] == {}
    assert quant_bytes < 1.3 * path.stat().st_size
    if name in SPLIT_QKV:  # q|k one matmul, v another, each over its own source's blocks
        runs = {e["name"]: (e["quant"]["format"], e["sources"]) for e in manifest["params"]
                if ".qkv_proj.runs." in e["name"] and e["name"].endswith(".qweight")}
        qk, v = SPLIT_QKV[name]
        assert runs == {f"model.layers.{i}.self_attn.qkv_proj.runs.{r}.qweight": (
            (qk, [f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.self_attn.k_proj.weight"]) if r == 0
            else (v, [f"model.layers.{i}.self_attn.v_proj.weight"])) for i in range(2) for r in range(2)}
    if name == "mixed":  # gate|up too: a Q4_1 gate, a Q8_0 up
        runs = {e["name"]: (e["quant"]["format"], e["sources"]) for e in manifest["params"]
                if ".gate_up_proj.runs." in e["name"] and e["name"].endswith(".qweight")}
        assert runs == {f"model.layers.{i}.mlp.gate_up_proj.runs.{r}.qweight": (
            ("Q4_1", "Q8_0")[r], [f"model.layers.{i}.mlp.{('gate', 'up')[r]}_proj.weight"]) for i in range(2)
            for r in range(2)}


def _int8_gemv_modules(name: str, formats: tuple[str, ...] = INT8_FORMATS) -> Callable[[str], bool]:
    """Which of transformers' Linear modules vtool runs through its Q8_0-activation matmuls
    on this host (schedules/cpu/int8_gemv.py), for the oracle to quantize their inputs as those
    kernels do: a weight kept in Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 (a part of the fused q|k|v and gate|up
    by its own format, when every part's format is kept), on a CPU with an integer-dot tier.
    formats=Q8_K_FORMATS: those through the Q8_K-activation matmuls over Q4_K/Q5_K/Q6_K
    (schedules/cpu/kquant_gemv.py)."""
    if int8_isa_for(tvm.target.Target(buildable("host").tvm)) is None:
        return lambda module: False
    qtype_of, tie = VARIANTS[name][0], VARIANTS[name][1]
    int8 = {getattr(Q, f) for f in formats}

    def kept_int8(module: str) -> bool:
        if module == "lm_head":
            return qtype_of("token_embd.weight" if tie else "output.weight") in int8
        layer = module.split(".")[2]
        group = next((g for g in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")) if module.endswith(g)),
                     (module.rsplit(".", 1)[1],))
        kinds = {qtype_of(gguf_name(f"model.layers.{layer}.{module.split('.')[3]}.{part}.weight")) for part in group}
        own = qtype_of(gguf_name(f"model.layers.{layer}.{module.split('.', 3)[3]}.weight"))
        return {k.name for k in kinds} <= set(FORMATS) and own in int8

    return kept_int8


def _bound(name: str, only: Callable[[str], bool], q8: list[np.ndarray], plain: list[np.ndarray]) -> float:
    """1e-4 where vtool quantizes no activation; else the Q8_0 quantization's own effect on
    these logits, |Q8 oracle - plain transformers|. A last-bit difference upstream (the
    summation order) can move one element across a rounding step, so vtool is held to
    being no further from the Q8_0 oracle than that oracle is from float: a wrong kernel
    lands far outside it, and tests/test_int8_gemv.py holds each kernel to 2e-5."""
    if not any(only(f"model.layers.0.{m}") for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")) \
            and not only("lm_head"):
        return TOLERANCE
    noise = max(float(np.abs(a - b).max()) for a, b in zip(q8, plain))
    assert noise > TOLERANCE, f"{name}: the Q8_0 oracle changed nothing, the check would be weak"
    return noise


def test_greedy_and_logits_match_transformers(variant):
    """Decode against transformers computing what vtool computes: where vtool's decode
    matmuls quantize activation rows to Q8_0 (`--activations auto`), the oracle's Linear
    inputs in its decode steps go through gguf-py's Q8_0 quantizer
    (hf_oracle.q8_0_activations); where they quantize to Q8_K (kept Q4_K/Q6_K), through
    llama.cpp's Q8_K quantizer (hf_oracle.q8_k_activations)."""
    name, path, _, gen, _ = variant
    model = _hf_model(path)
    only_q8_0, only_q8_k = _int8_gemv_modules(name), _int8_gemv_modules(name, Q8_K_FORMATS)

    def only(module: str) -> bool:
        return only_q8_0(module) or only_q8_k(module)

    _, _, plain_logits = greedy(model, PROMPT, STEPS)
    with q8_0_activations(model, only=only_q8_0, rows="decode"), q8_k_activations(model, only=only_q8_k,
                                                                                   rows="decode"):
        _, ref_tokens, ref_logits = greedy(model, PROMPT, STEPS)
    assert len(set(ref_tokens)) > 4, f"{name}: the reference is degenerate, the check would be weak"
    seen: list[np.ndarray] = []
    result = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=STEPS), on_logits=seen.append)
    assert result.token_ids == ref_tokens, f"{name}: greedy tokens diverge"
    worst = max(float(np.abs(a - b).max()) for a, b in zip(seen, ref_logits))
    bound = _bound(name, only, ref_logits[1:], plain_logits[1:])  # the first comes from the float prompt
    assert worst < bound, f"{name}: decode logits differ by {worst} (bound {bound})"


def test_prompt_logits_match_transformers(variant):
    """Every prompt position at once: the GEMM (prefill) kernels, float activations by default."""
    name, path, _, gen, _ = variant
    ref, _, _ = greedy(_hf_model(path), PROMPT, 1)
    worst = float(np.abs(gen.prompt_logits(PROMPT) - ref).max())
    assert worst < TOLERANCE, f"{name}: prompt logits differ by {worst}"


@pytest.mark.slow
def test_q8_0_activations_everywhere_match_the_q8_0_oracle(tmp_path):
    """`--activations q8_0` (llama.cpp's numerics): the prompt GEMMs quantize their rows too."""
    if int8_isa_for(tvm.target.Target(buildable("host").tvm)) is None:
        pytest.skip("this CPU has no integer-dot tier: --activations q8_0 is refused here")
    qtype_of, tie, _, shape = VARIANTS["q4_1"]
    path = write_tiny_gguf(tmp_path / "m.gguf", qtype_of, tie=tie, shape=shape)
    ckpt = open_checkpoint(path)
    artifact = build_artifact(path, "host", "float32", checkpoint=ckpt, quantization="gguf", activations="q8_0")
    assert json.loads((artifact / "manifest.json").read_text())["activations"] == "q8_0"
    gen = Generator(CompiledModel(artifact, ckpt), max_model_len=128)
    model = _hf_model(path)
    only = _int8_gemv_modules("q4_1")
    plain, _, plain_steps = greedy(model, PROMPT, STEPS)
    with q8_0_activations(model, only=only, rows="all"):
        ref, ref_tokens, ref_steps = greedy(model, PROMPT, STEPS)
    bound = _bound("q4_1", only, [ref, *ref_steps], [plain, *plain_steps])
    worst = float(np.abs(gen.prompt_logits(PROMPT) - ref).max())
    assert worst < bound, f"prompt logits differ by {worst} (bound {bound})"
    result = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=STEPS))
    assert result.token_ids == ref_tokens


def test_artifact_refuses_a_file_in_other_formats(tmp_path):
    """Same config, other block formats: refused by tensor name before anything is read."""
    q41 = write_tiny_gguf(tmp_path / "a.gguf", VARIANTS["q4_1"][0], tie=True)
    q80 = write_tiny_gguf(tmp_path / "b.gguf", VARIANTS["q8_0"][0], tie=True)
    artifact = build_artifact(q41, "host", "float32", quantization="gguf")
    with pytest.raises(ManifestError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.* stored as Q8_0.*as Q4_1"):
        CompiledModel(artifact, open_checkpoint(q80))


def test_quantization_none_binds_any_file(tmp_path):
    """--quantization none dequantizes at load: one artifact serves both files."""
    q41 = write_tiny_gguf(tmp_path / "a.gguf", VARIANTS["q4_1"][0], tie=True)
    q80 = write_tiny_gguf(tmp_path / "b.gguf", VARIANTS["q8_0"][0], tie=True)
    artifact = build_artifact(q41, "host", "float32", quantization="none")
    assert json.loads((artifact / "manifest.json").read_text())["quantization"] == "none"
    CompiledModel(artifact, open_checkpoint(q80))


def test_refusals(tmp_path):
    from tiny_models import make_tiny_model

    gguf_file = write_tiny_gguf(tmp_path / "a.gguf", VARIANTS["q4_1"][0], tie=True)
    with pytest.raises(VtoolError, match="unknown quantization 'q3'.*auto, none, gguf"):
        build_artifact(gguf_file, "host", quantization="q3")
    folder = make_tiny_model("llama-gqa", tmp_path / "st")
    with pytest.raises(VtoolError, match="--quantization gguf keeps a GGUF file's quantized blocks.*safetensors"):
        build_artifact(folder, "host", quantization="gguf")
    f32 = write_tiny_gguf(tmp_path / "f32.gguf", lambda name: Q.F32)
    with pytest.raises(VtoolError, match="has no weight stored as Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, .*, Q6_K"):
        build_artifact(f32, "host", quantization="gguf")


def test_cuda_target_refused_by_name(tmp_path):
    from vtool.targets import buildable

    try:
        buildable("sm_90a")
    except VtoolError as e:
        pytest.skip(f"no CUDA build here: {e}")
    gguf_file = write_tiny_gguf(tmp_path / "a.gguf", VARIANTS["q4_1"][0], tie=True)
    with pytest.raises(VtoolError, match="kernels for x86 CPU targets only, not sm_90a"):
        build_artifact(gguf_file, "sm_90a", "bfloat16", quantization="gguf")


def test_old_manifest_format_refused(tmp_path):
    from vtool.runtime.artifact.manifest import read_manifest

    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 1}))
    with pytest.raises(ManifestError, match="manifest format 1; this vtool reads format 2"):
        read_manifest(tmp_path)
