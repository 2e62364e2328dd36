"""GGUF blocks kept on CUDA (issue 17): weights stay in their Q4_0/Q4_1/Q5_x/Q8_0/K-quant/IQ4
blocks on the GPU and the matmuls dequantize them in registers (schedules/cuda/quantized.py).

Without a GPU (CI, when nvcc is at hand): `vtool build --target sm_90a` of a tiny GGUF keeps its
blocks (the manifest's params and quantized_weights say so) and a safetensors checkpoint
quantized at build time (`--quantization q4_1`, `q4_k`, `q6_k`) builds; both embed sm_90a SASS.

On a GPU: tiny llama GGUF files of test_quant_gguf.py's variants (every kept format, mixed
files, a fused q|k|v of two formats) against transformers running the same file through its
GGUF loader (dequantized to float32) on the GPU: float32 logits within 1e-4 at every prompt
position and decode step, the same greedy tokens; bfloat16 within test_gpu_parity.py's bound
(transformers' own bf16 error times half_oracle.VS_TRUTH); and the batching engine with 3 and 12
sequences (batched decode through the GEMV and through the tiled matmul) giving each
sequence's greedy tokens alone.

Artifacts come from VTOOL_GPU_QUANT_ARTIFACTS (a folder written by
`python tests/test_gpu_quantized.py prebuild DIR` where the compiler is) or are built here.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from quant_gguf import VARIANTS, write_tiny_gguf  # noqa: E402

from gpu_fixtures import cuda_buildable, exact_float32, sm90_gpu  # noqa: E402,F401  (fixtures)

ARTIFACTS_ENV = "VTOOL_GPU_QUANT_ARTIFACTS"
TARGET = "sm_90a"
# (variant of test_quant_gguf.VARIANTS, dtype): every format kept at least once
CASES = [("q4_1", "float32"), ("q4_1", "bfloat16"), ("q8_0", "float32"), ("q4_0", "float32"),
         ("mixed", "float32"), ("q5_mix", "float32"), ("q4_k_m", "float32"), ("q4_k_m", "bfloat16"),
         ("q5_k", "float32"), ("q3_k", "float32"), ("q2_k", "float32"), ("iq4_nl", "float32"),
         ("iq4_xs", "float32")]
# (variant, sequences, formats on the tensor cores): bf16 batches against the prompt path
TENSOR_CORE_CASES = [("q4_1", 1, ["Q4_1", "Q8_0"]), ("q4_1", 5, ["Q4_1", "Q8_0"]), ("q4_1", 12, ["Q4_1", "Q8_0"]),
                     ("q4_1", 40, ["Q4_1", "Q8_0"]), ("mixed", 12, ["Q4_0", "Q4_1", "Q8_0"]),
                     ("q4_k_m", 5, ["Q4_K", "Q6_K"]), ("q4_k_m", 40, ["Q4_K", "Q6_K"])]
STEPS = 16
PROMPT = [1, 17, 42, 99, 7, 3, 250, 11, 64, 5, 200, 31]
TOLERANCE = 1e-4


def _build(name: str, dtype: str, folder: Path) -> tuple[Path, Path]:
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.toolchain.build import build_artifact

    qtype_of, tie, _kept, shape = VARIANTS[name]
    folder.mkdir(parents=True, exist_ok=True)
    path = write_tiny_gguf(folder / "m.gguf", qtype_of, tie=tie, shape=shape)
    # attention="tir": what these tests hold does not depend on it, and `auto` would take
    # FlashInfer wherever a test elsewhere made it look installed
    artifact = build_artifact(path, TARGET, dtype, checkpoint=open_checkpoint(path), quantization="gguf",
                              attention="tir", output=folder / f"artifact-{dtype}")
    return path, artifact


# -- without a GPU: the builds ---------------------------------------------------------------

def test_cuda_build_keeps_gguf_blocks(tmp_path):
    cuda_buildable()
    _path, artifact = _build("q4_k_m", "bfloat16", tmp_path / "q4_k_m")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"] == "gguf"
    assert manifest["quantized_weights"]["kept"] == VARIANTS["q4_k_m"][2]
    params = {p["name"]: p for p in manifest["params"]}
    assert params["model.layers.0.mlp.down_proj.qweight"]["dtype"] == "uint8"
    assert not [n for n, p in params.items() if n.endswith(".weight") and len(p["shape"]) == 2], \
        "a 2-D weight was dequantized"
    assert "sm_90a" in manifest["build"]["cuda"]["embedded"]["sass"]


@pytest.mark.parametrize("scheme, shape, kept", [("q4_1", "llama-gqa", {"Q4_1": 9, "Q8_0": 1}),
                                                  ("q4_k", "llama-k256", {"Q4_K": 7, "Q5_0": 2, "Q8_0": 1}),
                                                  ("q6_k", "llama-k256", {"Q6_K": 7, "Q8_0": 3})])
def test_cuda_build_quantizes_safetensors(tmp_path, scheme, shape, kept):
    cuda_buildable()
    from tiny_models import make_tiny_model
    from vtool.toolchain.build import build_artifact

    folder = make_tiny_model(shape, tmp_path / "st")
    artifact = build_artifact(folder, TARGET, "bfloat16", quantization=scheme, attention="tir",
                              output=tmp_path / "art")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"] == scheme
    assert manifest["quantized_weights"]["kept"] == kept
    assert (artifact / manifest["weights_file"]["file"]).exists()
    assert "sm_90a" in manifest["build"]["cuda"]["embedded"]["sass"]


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_block_gemv_arithmetic_on_the_host(fmt):
    """schedules/cuda/quantized_gemv.py's kernel built with serial loops for the host
    (cpu=True: the same per-block arithmetic, the lane sums through a scratch buffer instead
    of shuffles) against the unscheduled function on random blocks: one row with a residual
    epilogue, a symbolic batch of 11 rows in the 16-row bucket (groups of rows), 5 static rows."""
    pytest.importorskip("tvm", reason="the kernel is built with the compiler (apache-tvm)")
    import tvm
    from tvm import te, tirx

    from vtool.models.quantized_linear import matmul_te
    from vtool.runtime.weights.ggml_blocks import part_dtype, part_shape, parts
    from vtool.schedules.cuda import quantized_gemv

    rng = np.random.default_rng(0)
    batch = tirx.Var("b", "int64")
    for lead, concrete, bucket, n, k, epilogue in [((1, 1), (1, 1), 1, 64, 512, True),
                                                   ((batch, 1), (11, 1), 16, 32, 256, False),
                                                   ((5,), (5,), 5, 16, 256, True)]:
        x = te.placeholder((*lead, k), "float32", name="x")
        ws = [te.placeholder(part_shape(fmt, p, n, k), part_dtype(fmt, p), name=f"w_{p}") for p in parts(fmt)]
        y = matmul_te(fmt, x, *ws)
        args = [x, *ws]
        if epilogue:
            res = te.placeholder((*lead, n), "float32", name="res")
            args += [res, te.compute(y.shape, lambda *i: y(*i) * 0.5 + res(*i), name="T_add")]
        else:
            args.append(y)
        func = te.create_prim_func(args)
        kernel = func.with_body(quantized_gemv.gemv(func, bucket, cpu=True).body)
        data = [rng.standard_normal((*concrete, k)).astype(np.float32)]
        for p in parts(fmt):
            shape, dtype = part_shape(fmt, p, n, k), part_dtype(fmt, p)
            if dtype == "float16":
                data.append((rng.standard_normal(shape) * 0.05).astype(np.float16))
            elif p in ("sub_scale", "sub_min"):
                data.append(rng.integers(-32 if dtype == "int8" else 0, 32, shape).astype(dtype))
            else:
                data.append(rng.integers(0, 256, shape).astype(np.uint8).view(dtype))
        if epilogue:
            data.append(rng.standard_normal((*concrete, n)).astype(np.float32))
        outs = []
        for f in (func, kernel):
            lib = tvm.compile(tvm.IRModule({"main": f}), target="llvm")
            tensors = [tvm.runtime.tensor(a) for a in data] + [tvm.runtime.tensor(np.zeros((*concrete, n), np.float32))]
            lib["main"](*tensors)
            outs.append(tensors[-1].numpy())
        err = np.abs(outs[0] - outs[1]).max() / np.abs(outs[0]).max()
        assert err < 1e-5, (fmt, lead, err)


# -- on a GPU --------------------------------------------------------------------------------

def _case(sm90_gpu, name: str, dtype: str, tmp_path_factory) -> tuple[Path, Path]:
    root = os.environ.get(ARTIFACTS_ENV)
    if root:
        folder = Path(root) / name
        artifact = folder / f"artifact-{dtype}"
        if not (artifact / "manifest.json").exists():
            pytest.fail(f"{ARTIFACTS_ENV}={root} has no {name} {dtype} build; rerun the prebuild")
        return folder / "m.gguf", artifact
    import importlib.util

    if importlib.util.find_spec("tvm") is None:
        pytest.skip(f"{ARTIFACTS_ENV} is unset and there is no TVM compiler here")
    return _build(name, dtype, tmp_path_factory.mktemp(f"{name}-{dtype}"))


def _hf(path: Path, dtype: torch.dtype) -> Any:
    import transformers

    kwargs = {"gguf_file": path.name, "dtype": dtype, "attn_implementation": "eager"}
    if hasattr(transformers, "GgufConfig"):
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), **kwargs)
    return model.to("cuda").eval()


def _generator(path: Path, artifact: Path) -> Any:
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.engine.generate import Generator
    from vtool.runtime.weights.checkpoint import open_checkpoint

    return Generator(CompiledModel(artifact, open_checkpoint(path)), max_model_len=128)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("name, dtype", CASES)
def test_matches_transformers_on_the_same_file(sm90_gpu, exact_float32, name, dtype, tmp_path_factory):
    from half_oracle import (TINY_NEAR_TIE_REF_ERRS, check_half, half_reference, hf_greedy, hf_prompt_logits,
                             max_abs)
    from vtool.runtime.sampling.params import SamplingParams

    path, artifact = _case(sm90_gpu, name, dtype, tmp_path_factory)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantized_weights"]["kept"] == VARIANTS[name][2]
    gen = _generator(path, artifact)
    label = f"{name} {dtype}"
    if dtype == "bfloat16":
        ref = half_reference(_hf(path, torch.float32), _hf(path, torch.bfloat16), PROMPT)
        check_half(label, gen, PROMPT, ref, near_tie=TINY_NEAR_TIE_REF_ERRS * ref["ref_err"])
        return
    hf = _hf(path, torch.float32)
    _ref_prompt, ref_tokens, ref_logits = hf_greedy(hf, PROMPT, STEPS)
    seen: list[np.ndarray] = []
    result = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=STEPS), on_logits=seen.append)
    prompt_err = max_abs(gen.prompt_logits(PROMPT), hf_prompt_logits(hf, PROMPT))
    decode_err = max(max_abs(a, b) for a, b in zip(seen, ref_logits))
    print(f"[{label}] max|dlogit| prompt {prompt_err:.2e}, decode {decode_err:.2e}")
    assert prompt_err <= TOLERANCE and decode_err <= TOLERANCE
    assert result.token_ids == ref_tokens


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("batch, gemv_rows", [(3, ""), (12, ""), (40, ""), (12, "-1"), (40, "-1")])
def test_engine_batches_give_each_sequence_its_own_tokens(sm90_gpu, exact_float32, batch, gemv_rows, tmp_path_factory,
                                                          monkeypatch):
    """Batched decode through the block GEMV (3 rows), through batch_verify's prompt path (12
    and 40 rows, past runtime/engine/block_decode.py's GEMV_MAX_ROWS: weights dequantized, then
    the dense matmul) and, with that turned off (VTOOL_BLOCK_GEMV_ROWS=-1), through the GEMV's
    16-row bucket (12 rows, groups of rows) and the tiled matmul (40 rows, past
    quantized.LOW_BATCH): every sequence's greedy tokens equal transformers' for it alone."""
    from vtool.runtime.engine.block_decode import ROWS_ENV

    monkeypatch.setenv(ROWS_ENV, gemv_rows)
    from half_oracle import hf_greedy

    path, artifact = _case(sm90_gpu, "q4_k_m", "float32", tmp_path_factory)
    hf = _hf(path, torch.float32)
    prompts = _prompts(batch)
    got = _engine_greedy(path, artifact, prompts, tmp_path_factory)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf, prompt, STEPS)[1], f"sequence {i} of {batch}"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("name, batch, mma", TENSOR_CORE_CASES)
def test_bf16_batches_on_tensor_cores_equal_the_prompt_path(sm90_gpu, name, batch, mma, tmp_path_factory,
                                                            monkeypatch):
    """A bf16 library's batch_decode multiplies its Q4_0, Q4_1, Q4_K, Q6_K and Q8_0 blocks on the tensor cores
    (toolchain/native/block_mma.cu; with every kept format covered every decode step of several
    sequences stays on batch_decode, a lone sequence takes `decode`). Each sequence's greedy
    tokens equal those of the same engine sending every step through batch_verify's prompt path
    (VTOOL_BLOCK_GEMV_ROWS=0: the same bf16-rounded weights, dequantized into a temporary, on
    cuBLAS; that path is held to transformers in float32 by the test above), and the sequences
    are not one another's. The two sum in different orders, and a 1-ulp bf16 difference can flip
    a near-tied greedy pick: one sequence in ten may part, in the second half of its steps (seen:
    1 of 40, at its last step)."""
    from vtool.runtime.engine.block_decode import ROWS_ENV

    path, artifact = _case(sm90_gpu, name, "bfloat16", tmp_path_factory)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantized_weights"]["batched_decode_mma"] == mma
    prompts = _prompts(batch)
    monkeypatch.delenv(ROWS_ENV, raising=False)
    tensor_cores = _engine_greedy(path, artifact, prompts, tmp_path_factory)
    monkeypatch.setenv(ROWS_ENV, "0")
    prompt_path = _engine_greedy(path, artifact, prompts, tmp_path_factory)
    differ = {i: next(j for j, (a, b) in enumerate(zip(tensor_cores[f"r{i}"], prompt_path[f"r{i}"])) if a != b)
              for i in range(batch) if tensor_cores[f"r{i}"] != prompt_path[f"r{i}"]}
    print(f"[{name} x {batch}] sequences that part (sequence: first differing step): {differ}")
    assert len(differ) <= batch // 10 and all(step >= STEPS // 2 for step in differ.values()), \
        f"{len(differ)} of {batch} sequences differ (sequence: first differing step): {differ}"
    assert batch == 1 or len({tuple(t) for t in tensor_cores.values()}) > batch // 2, "the sequences came out alike"


def _prompts(batch: int) -> list[list[int]]:
    rng = np.random.default_rng(batch)
    return [[1, *rng.integers(3, 250, int(rng.integers(2, 20))).tolist()] for _ in range(batch)]


def _engine_greedy(path: Path, artifact: Path, prompts: list[list[int]], tmp_path_factory) -> dict[str, list[int]]:
    """Every prompt through one engine, greedy, STEPS tokens each: request r{i}'s tokens."""
    from half_oracle import run_engine
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.engine.generate import Generator
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.session import Session
    from vtool.runtime.text.tokenizer import Tokenizer
    from vtool.runtime.weights.checkpoint import open_checkpoint

    # open_session takes a GGUF file's tokenizer from the file; the tiny files have none
    ckpt = open_checkpoint(path)
    model = CompiledModel(artifact, ckpt)
    tokenizer = Tokenizer.from_dir(_word_tokenizer(tmp_path_factory.mktemp("tok")).parent, None)
    session = Session(ckpt, model, tokenizer, [], 128, Generator(model, 128))
    engine = Engine(session, EngineConfig(max_num_seqs=len(prompts), enable_prefix_caching=False,
                                          gpu_memory_utilization=0.3))
    return run_engine(engine, prompts, lambda i: SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))


def _word_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer.json over the tiny vocabulary ("t0", "t1", ...): the engine needs
    one, the tiny GGUF files carry none."""
    from word_tokenizer import write_word_tokenizer

    return write_word_tokenizer(VARIANTS["q4_k_m"][3]["vocab"], folder)


def prebuild(out: Path) -> None:
    """Every build a test here asks for (CASES, and the bf16 ones of TENSOR_CORE_CASES, which
    the prebuild had missed for `mixed`) for TARGET into `out` (<variant>/m.gguf,
    <variant>/artifact-<dtype>)."""
    builds = dict.fromkeys([*CASES, *((name, "bfloat16") for name, _, _ in TENSOR_CORE_CASES)])
    for name, dtype in builds:
        path, artifact = _build(name, dtype, out / name)
        print(f"built {name} {dtype}: {artifact}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "prebuild":
        sys.exit("usage: python tests/test_gpu_quantized.py prebuild DIR")
    prebuild(Path(sys.argv[2]))
