"""`--gemm cublas`: which matmuls go to cuBLAS, and how the choice is made and refused.

The rewrite is checked on the exported Relax module of a tiny Qwen2 (q/k/v bias, so the
bias add must stay outside the call) with no compiler run; the CUDA build that links the
cuBLAS wrapper into the library is checked in test_cuda_build.py, and its numbers on a GPU
in test_gpu_parity.py.
"""
from __future__ import annotations

import os
import re

import pytest

from vtool.models.config import parse_hf_config
from vtool.runtime.artifact.tvm_runtime import RuntimeLoadError, load_cublas
from vtool.toolchain.gemm_offload import (EXTERN_SYMBOL, OFFLOADED_FUNCTIONS, GemmChoiceError, count_offloaded,
                                          offload_pass, resolve_gemm)

RAW = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
       "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 200,
       "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def exported():
    import tvm

    from vtool.models.decoder import DecoderForCausalLM
    from vtool.targets import lookup

    def export(dtype: str, tied: bool = False):
        raw = {**RAW, "tie_word_embeddings": tied}
        model = DecoderForCausalLM(parse_hf_config(raw), dtype, tvm.target.Target(lookup("sm_90a").tvm))
        model.draft_cache_len = 64  # chain_verify (a target's rows over its own cache) is offloaded too
        mod, _ = model.export_tvm(spec=model.get_default_spec())
        return mod, offload_pass()(mod)

    return export


def _calls(func) -> list[str]:
    """The output type of every cuBLAS call in a function, in order."""
    text = str(func)
    return re.findall(rf'R\.call_dps_packed\("{EXTERN_SYMBOL}", \([^)]*\), out_ty=R\.Tensor\(([^)]*\)[^)]*)\)', text)


@pytest.mark.parametrize("tied", [False, True])
def test_every_projection_of_the_many_row_functions_goes_to_cublas(exported, tied):
    mod, offloaded = exported("bfloat16", tied)
    layers = RAW["num_hidden_layers"]
    per_function = 4 * layers + 1  # qkv, o, gate_up, down per layer, plus lm_head
    # draft_extend only writes the cache: no head, and past the last layer's qkv all is dead code
    extend_calls = 4 * (layers - 1) + 1
    for name in OFFLOADED_FUNCTIONS:
        calls = _calls(offloaded[name])
        if name == "draft_extend":
            assert len(calls) == extend_calls and all('"bfloat16"' in c for c in calls), calls
            continue
        assert len(calls) == per_function, (name, calls)
        # The projections write bf16 (their cast folded into the call). The tied head is a
        # float32-output matmul on the embedding table; an untied head is a bf16 Linear
        # (as in transformers) whose output the model then casts to float32.
        assert sum('"bfloat16"' in c for c in calls) == 4 * layers + (0 if tied else 1)
        assert sum('"float32"' in c for c in calls) == (1 if tied else 0)
        assert "R.matmul" not in str(offloaded[name])
        assert str(offloaded[name]).count("R.add(") == str(mod[name]).count("R.add("), "bias/residual adds kept"
    # batch-1 decode keeps vtool's GEMV kernels (and its CUDA graph)
    assert _calls(offloaded["decode"]) == []
    assert str(offloaded["decode"]).count("R.matmul(") == str(mod["decode"]).count("R.matmul(") == per_function
    assert count_offloaded(offloaded) == (len(OFFLOADED_FUNCTIONS) - 1) * per_function + extend_calls
    # the draft's step is batch-1 decode: captured whole, on the GEMV kernels
    assert _calls(offloaded["draft_step"]) == []


def test_float32_matmuls_rewrite_too_when_asked(exported):
    _, offloaded = exported("float32")
    calls = _calls(offloaded["batch_prefill"])
    assert len(calls) == 4 * RAW["num_hidden_layers"] + 1 and all('"float32"' in c for c in calls)


@pytest.mark.parametrize("choice,family,dtype,expected", [
    ("auto", "cuda", "bfloat16", "cublas"), ("auto", "cuda", "float16", "cublas"),
    ("auto", "cuda", "float32", "tir"), ("auto", "x86", "bfloat16", "tir"), ("auto", "x86", "float32", "tir"),
    ("tir", "cuda", "bfloat16", "tir"), ("cublas", "cuda", "float32", "cublas"), ("tir", "x86", "float32", "tir"),
])
def test_auto_picks_cublas_for_half_precision_cuda_only(choice, family, dtype, expected):
    assert resolve_gemm(choice, family, dtype) == expected


def test_impossible_choices_are_refused_by_name():
    with pytest.raises(GemmChoiceError, match="needs a CUDA target.*x86"):
        resolve_gemm("cublas", "x86", "float32")
    with pytest.raises(GemmChoiceError, match="'cutlass' is not one of auto, tir, cublas"):
        resolve_gemm("cutlass", "cuda", "bfloat16")


def test_a_missing_cublas_is_refused_with_the_way_out(monkeypatch, tmp_path):
    try:  # a machine with cuBLAS installed cannot show the refusal
        import ctypes

        ctypes.CDLL("libcublas.so.13", mode=os.RTLD_NOLOAD)
        pytest.skip("cuBLAS is loaded in this process")
    except OSError:
        pass
    monkeypatch.setenv("VTOOL_CUBLAS_LIBRARY", str(tmp_path / "libcublas.so.13"))
    try:
        found = load_cublas.__wrapped__()
    except RuntimeLoadError as err:
        message = str(err)
        assert "pip install nvidia-cublas" in message and "--gemm tir" in message
        assert str(tmp_path / "libcublas.so.13") in message
    else:
        pytest.skip(f"this machine has cuBLAS ({found})")
