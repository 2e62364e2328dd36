"""`--attention flashinfer`: the choice, the KV-cache hook and the link checks, without flashinfer.

Building the FlashInfer objects needs flashinfer-python and minutes of nvcc, so it is not
run here; the model side is: exporting a tiny Llama with the FlashInfer KV cache needs
neither flashinfer nor a compiler (flashinfer_kv_cache keeps TVM from compiling it).
"""
from __future__ import annotations

import pytest

from vtool.models.config import parse_hf_config
from vtool.toolchain import flashinfer_attention as fa

RAW = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128,
       "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
       "tie_word_embeddings": False}


def test_arch_list():
    assert fa.arch_list(["sm_90a"]) == "9.0a"
    assert fa.arch_list(["sm_80", "sm_90a"]) == "8.0 9.0a"
    assert fa.arch_list(["sm_120f"]) == "12.0f"


def test_resolve_attention():
    cfg = parse_hf_config(RAW)
    assert fa.resolve_attention("tir", "x86", "float32", cfg) == "tir"
    assert fa.resolve_attention("flashinfer", "cuda", "bfloat16", cfg) == "flashinfer"
    with pytest.raises(fa.FlashInferError, match="CUDA target"):
        fa.resolve_attention("flashinfer", "x86", "bfloat16", cfg)
    with pytest.raises(fa.FlashInferError, match="float32"):
        fa.resolve_attention("flashinfer", "cuda", "float32", cfg)
    with pytest.raises(fa.FlashInferError, match="head_dim"):
        fa.resolve_attention("flashinfer", "cuda", "bfloat16", parse_hf_config({**RAW, "head_dim": 32}))
    with pytest.raises(fa.FlashInferError, match="query heads per"):
        fa.resolve_attention("flashinfer", "cuda", "bfloat16",
                             parse_hf_config({**RAW, "num_attention_heads": 5, "num_key_value_heads": 1}))
    with pytest.raises(fa.FlashInferError, match="not one of"):
        fa.resolve_attention("flash", "cuda", "bfloat16", cfg)


def test_binding_signature_check(tmp_path):
    fits = ("Array<int64_t> BatchPrefillWithKVCachePlan(\n    TensorView a, int64_t b,\n"
            "    bool disable_split_kv, int64_t num_colocated_ctas);\n")
    (tmp_path / "batch_prefill_jit_binding.cu").write_text(fits)
    assert fa._binding_fits(tmp_path) is None
    newer = fits.replace("num_colocated_ctas)", "num_colocated_ctas, int64_t uniform_q_len)")
    (tmp_path / "batch_prefill_jit_binding.cu").write_text(newer)
    assert "uniform_q_len" in fa._binding_fits(tmp_path)


def test_rename_exports(tmp_path):
    src = tmp_path / "batch_decode_jit_binding.cu"
    src.write_text("TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan, Plan);\nTVM_FFI_DLL_EXPORT_TYPED_FUNC(run, Run);\n")
    fa._rename_exports([src, tmp_path / "other.cu"], "batch_decode")
    assert src.read_text() == ("TVM_FFI_DLL_EXPORT_TYPED_FUNC(batch_decode_plan, Plan);\n"
                               "TVM_FFI_DLL_EXPORT_TYPED_FUNC(batch_decode_run, Run);\n")


def test_flashinfer_kv_cache_export():
    """The hook swaps the cache class; the exported module calls FlashInfer's functions by
    name, and TVM's FlashInfer module generators are restored afterwards."""
    import tvm
    from tvm.relax.backend.cuda import flashinfer as tvm_flashinfer

    from vtool.models.decoder import DecoderForCausalLM
    from vtool.targets import lookup

    before = tvm_flashinfer.gen_flashinfer_prefill_module
    model = DecoderForCausalLM(parse_hf_config(RAW), "bfloat16", tvm.target.Target(lookup("sm_90a").tvm))
    fa.use_attention(model, "flashinfer")
    mod, _ = model.export_tvm(spec=model.get_default_spec())
    text = mod["create_tir_paged_kv_cache"].script()
    for symbol in fa.PREFILL_SYMBOLS + fa.DECODE_SYMBOLS:
        assert f'"{symbol}"' in text
    assert "tir_attention_decode\"" not in text  # the TIR decode kernel is not what the cache calls
    assert tvm_flashinfer.gen_flashinfer_prefill_module is before


def test_auto_falls_back_to_tir_saying_why(monkeypatch, tmp_path):
    """auto never fails a build: without a fitting flashinfer it is tir, with the reason."""
    cfg = parse_hf_config(RAW)
    notices: list[str] = []
    assert fa.resolve_attention("auto", "x86", "float32", cfg, notices.append) == "tir"
    assert notices == []  # nothing to explain on a CPU
    monkeypatch.setattr(fa, "_PROBE", None)
    # a flashinfer that cannot be imported: an empty folder first on the path, none installed
    monkeypatch.setenv(fa.FLASHINFER_PATH_ENV, str(tmp_path))
    monkeypatch.setattr(fa, "_run_helper", lambda *_a, **_k: (_ for _ in ()).throw(
        fa.FlashInferError("flashinfer-python is not importable")))
    assert fa.resolve_attention("auto", "cuda", "bfloat16", cfg, notices.append) == "tir"
    assert len(notices) == 1 and "flashinfer-python is not importable" in notices[0]
    # a shape FlashInfer has no kernels for falls back too, before any probe
    odd = parse_hf_config({**RAW, "head_dim": 96, "hidden_size": 384})
    assert fa.resolve_attention("auto", "cuda", "bfloat16", odd, notices.append) == "tir"
    assert "head_dim" in notices[-1]
    # and an explicit flashinfer still refuses, by name
    with pytest.raises(fa.FlashInferError, match="not importable"):
        fa.resolve_attention("flashinfer", "cuda", "bfloat16", cfg) and fa.probe()


def test_a_softcapped_model_is_refused_and_auto_falls_back_to_tir(monkeypatch):
    """Gemma-2's attention logit soft-cap: vtool's FlashInfer kernels have none (TVM's runtime
    passes them no cap), so flashinfer is refused by name and auto takes TIR, saying why,
    before any probe of flashinfer."""
    gemma2 = parse_hf_config({**RAW, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                              "hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": 128,
                              "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    assert gemma2.attn_logit_softcap == 50.0
    with pytest.raises(fa.FlashInferError, match="attn_logit_softcapping=50"):
        fa.resolve_attention("flashinfer", "cuda", "bfloat16", gemma2)
    monkeypatch.setattr(fa, "probe", lambda: pytest.fail("auto probed flashinfer for a model it cannot serve"))
    notices: list[str] = []
    assert fa.resolve_attention("auto", "cuda", "bfloat16", gemma2, notices.append) == "tir"
    assert len(notices) == 1 and "attn_logit_softcapping" in notices[0]


def test_the_cuda_build_extra_pins_the_flashinfer_the_build_checks_against():
    """`pip install 'vtool[cuda-build]'` is how a CUDA build gets FlashInfer's attention by
    default (`--attention auto`); the extra must install the one version whose plan TVM 0.27's
    runtime calls, which is what the build's own check names."""
    import configparser
    from pathlib import Path

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    extra = [line.strip() for line in cfg["options.extras_require"]["cuda-build"].splitlines()
             if line.strip() and not line.strip().startswith("#")]
    assert extra == [f"flashinfer-python=={fa.TESTED_FLASHINFER}"]


def test_the_helper_finds_console_scripts_of_an_unactivated_venv(monkeypatch):
    """ninja comes with the cuda-build extra as a console script beside the venv's python; a
    build run as .venv/bin/vtool (venv not activated) must still find it."""
    import os
    import sys
    from pathlib import Path

    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.delenv(fa.FLASHINFER_PATH_ENV, raising=False)
    path = fa._flashinfer_env()["PATH"].split(os.pathsep)
    assert path[0] == "/usr/bin" and str(Path(sys.executable).parent) in path


def test_the_helper_hides_the_cute_dsl_that_probes_the_gpu(tmp_path):
    """flashinfer-python pulls nvidia-cutlass-dsl, whose kernels query the GPU when imported and
    fail on a build machine without one (an AssertionError flashinfer does not catch). The
    helper hides the package, so flashinfer's guarded `import cutlass` takes its ImportError
    branch. A stand-in that fails the same way on import shows it."""
    import subprocess
    import sys

    (tmp_path / "cutlass").mkdir()
    (tmp_path / "cutlass" / "__init__.py").write_text("raise AssertionError('Torch not compiled with CUDA enabled')\n")
    probe = ("import sys\n"
             f"sys.path.insert(0, {str(tmp_path)!r})\n"
             "from vtool.toolchain.flashinfer_attention import hide_gpu_probing_modules\n"
             "hide_gpu_probing_modules()\n"
             "try:\n    import cutlass\nexcept ImportError:\n    print('hidden')\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.strip() == "hidden", done.stderr
    unhidden = subprocess.run([sys.executable, "-c", probe.replace("hide_gpu_probing_modules()\n", "")],
                              capture_output=True, text=True)
    assert "AssertionError" in unhidden.stderr  # without the helper's step the import fails as on a real machine
