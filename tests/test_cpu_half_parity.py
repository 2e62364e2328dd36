"""bfloat16 and float16 CPU builds against transformers on the CPU (tests/support/half_oracle.py):
logits within 2.5x transformers' own error in that dtype from the float32 truth, teacher-forced
and along the decode path, greedy tokens equal up to a near-tie of the reference.

(a) Tiny random shapes that reach different CPU kernels: GQA, q/k norms, a sliding window
    (the window-freeing cache's inline-rope attention), Gemma-3 (GELU-tanh, soft-capping, mixed
    window and global layers), Gemma-2 without its attention cap at head_dim 256 (tiny_models.py's
    GPU_DIAGNOSTIC_SHAPES: its sharp attention showed the (1 + w) norm weights rounded to
    bfloat16, 2.07 from float32 at one position against transformers' own 0.56, until they
    stayed float32: models/decoder.py PlusOneRMSNorm), experts.
(b) The default model (SmolLM2-135M-Instruct, its Q4_1 GGUF dequantized) in bfloat16 through the
    generator and through the batching engine.

The bfloat16 builds need TIR's CSE pass off (toolchain/families.py, _CPU_DTYPE_PASS_CONFIG):
with it, every CPU bfloat16 build failed in fused_rope."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from half_oracle import (SMOLLM2_NEAR_TIE, STEPS, TINY_NEAR_TIE_REF_ERRS, check_greedy, check_half, half_reference,
                         run_engine)
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.engine.generate import Generator
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.toolchain.build import build_artifact

PROMPT = [1, 5, 17, 42, 99, 7, 3, 250, 11, 300, 64]  # as test_parity_tiny
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
CASES = [("llama-gqa", "bfloat16"), ("llama-gqa", "float16"), ("qwen3-qknorm", "bfloat16"),
         ("mistral-window", "bfloat16"), ("mistral-window", "float16"), ("gemma3-window", "bfloat16"),
         ("gemma2-nocap", "bfloat16"), ("qwen3moe-experts", "bfloat16")]
SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
                   "Once upon a time, in a small village by the sea,"]


def load_hf(folder: Path, dtype: torch.dtype) -> Any:
    """transformers on its plain paths (eager attention keeps Gemma's soft-cap; eager experts)."""
    from transformers import AutoModelForCausalLM

    config = json.loads((folder / "config.json").read_text())
    moe = {"experts_implementation": "eager"} if config.get("num_experts") or config.get("num_local_experts") else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager", **moe).eval()


@pytest.mark.parametrize("shape, dtype", CASES)
def test_tiny_half_precision_matches_transformers(tiny_shape_dir, shape, dtype):
    folder = tiny_shape_dir(shape)
    artifact = build_artifact(folder, "host", dtype)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["dtype"] == dtype
    gen = Generator(CompiledModel(artifact, open_checkpoint(folder)), max_model_len=256)
    ref = half_reference(load_hf(folder, torch.float32), load_hf(folder, TORCH_DTYPES[dtype]), PROMPT)
    check_half(f"{shape} {dtype}", gen, PROMPT, ref, near_tie=TINY_NEAR_TIE_REF_ERRS * ref["ref_err"])


# -- (b) the default model in bfloat16 ----------------------------------------------------------

# "dense": dequantized to bfloat16 (--quantization none), as the GPU suite's SmolLM2 case;
# "blocks": the default build, Q4_1/Q8_0 blocks kept and activation rows quantized to Q8_0 for
# the integer-dot kernels (widened from bfloat16 first), both transformers runs quantizing their
# Linear inputs the same way (hf_oracle.q8_0_activations).
SMOLLM2_BUILDS = {"dense": "none", "blocks": "auto"}


@pytest.fixture(scope="module", params=sorted(SMOLLM2_BUILDS))
def smollm2_bf16(request):
    import contextlib
    import copy

    from hf_oracle import load_gguf_model, load_gguf_tokenizer, q8_0_activations
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.default_model import default_model_path

    gguf = default_model_path()
    artifact = build_artifact(gguf, "host", "bfloat16", checkpoint=open_checkpoint(gguf),
                              quantization=SMOLLM2_BUILDS[request.param])
    activations = json.loads((artifact / "manifest.json").read_text())["activations"]
    assert activations == ("none" if request.param == "dense" else "q8_0"), activations
    session = open_session(artifact, open_checkpoint(gguf), max_model_len=512)
    hf32 = load_gguf_model(gguf)  # cached for the session and shared: never converted in place
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    tokenizer = load_gguf_tokenizer(gguf)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in SMOLLM2_PROMPTS]
    with contextlib.ExitStack() as stack:
        if activations == "q8_0":
            stack.enter_context(q8_0_activations(hf32))
            stack.enter_context(q8_0_activations(hf16))
        refs = [half_reference(hf32, hf16, ids) for ids in prompts]
    return f"smollm2 bf16 {request.param}", session, tokenizer, prompts, refs


@pytest.mark.slow
def test_smollm2_bfloat16_generator_matches_transformers(smollm2_bf16):
    label, session, tokenizer, prompts, refs = smollm2_bf16
    for i, (ids, ref) in enumerate(zip(prompts, refs)):
        check_half(f"{label} #{i}", session.generator, ids, ref, near_tie=SMOLLM2_NEAR_TIE, decode=tokenizer.decode)


@pytest.mark.slow
def test_smollm2_bfloat16_engine_batch_matches_transformers(smollm2_bf16):
    """The three prompts at once (batch_prefill, batch_decode over three sequences): each
    sequence's greedy tokens against transformers bf16 for it alone, up to a near-tie."""
    from vtool.runtime.engine.engine import Engine, EngineConfig

    label, session, tokenizer, prompts, refs = smollm2_bf16
    engine = Engine(session, EngineConfig(max_num_seqs=4, enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    done = run_engine(engine, prompts, lambda _i: params)
    for i, ref in enumerate(refs):
        check_greedy(f"{label} engine #{i}", done[f"r{i}"], ref["tokens"], ref["logits"],
                     near_tie=SMOLLM2_NEAR_TIE, decode=tokenizer.decode)


def test_a_bfloat16_build_over_blocks_takes_the_integer_dot_kernels(tmp_path):
    """A bfloat16 library over GGUF blocks runs the Q8_0-activation kernels its manifest names
    (they read float32 rows, so the build widens bfloat16 ones first): before, the matmuls took
    the float path while the manifest said q8_0."""
    from gguf import GGMLQuantizationType as Q
    from quant_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny-q8_0.gguf", lambda _name: Q.Q8_0)
    artifact = build_artifact(gguf, "host", "bfloat16", checkpoint=open_checkpoint(gguf))
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["activations"] == "q8_0" and manifest["quantized_weights"]["kept"]
    library = (artifact / "model.so").read_bytes()
    assert b"q8_0_int8_matmul" in library
