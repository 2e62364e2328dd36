"""CUDA artifacts against transformers on the same GPU.

(a) The tiny random shapes of tiny_models.py (Llama, Llama-3 rope, Qwen2 bias, Qwen3
    q/k norm, Mistral) built for this GPU's arch: float32 logits within 1e-4 of
    transformers (torch CUDA, TF32 off) at every prompt position and decode step, and the
    same 32 greedy tokens. bfloat16: see half_oracle.check_half (logits against the float32 truth,
    bounded by transformers' own bfloat16 error; greedy tokens equal up to a near-tie).
(b) SmolLM2-135M-Instruct (the embedded Q4_1 GGUF, dequantized) in bfloat16, through the
    single-sequence generator and through the batching engine, against transformers
    bfloat16 on the GPU: the same 32 greedy tokens for 3 prompts, or a first divergence
    that is a near-tie in the reference (SMOLLM2_NEAR_TIE).

Every GPU test skips, with the reason, when no CUDA GPU is usable (no libcuda.so.1, no
device, torch without CUDA). Artifacts come from VTOOL_GPU_ARTIFACTS (a folder written by
tests/support/gpu_prebuild.py on a machine with the compiler; the GPU machine then needs only the
TVM runtime) or, when it is unset and apache-tvm is installed, are built here for the GPU's
arch. Run with -s for the per-model numbers (max |dlogit|, first divergences).

On the runtime-only GPU machine, after tests/support/gpu_prebuild.py's carried parts are joined
(it prints the calls), from the repository root:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .devcarry/rt/*.whl ~/gpu-tests/wheels/*.whl
    mkdir -p /tmp/pkgs && ln -sfn "$PWD" /tmp/pkgs/vtool
    PYTHONPATH=/tmp/site:/tmp/pkgs VTOOL_TVM_LIBRARY_DIR=$PWD/.devcarry/rt VTOOL_GPU_ARTIFACTS=~/gpu-tests \
        python3 -m pytest -q -s -n 0 -p no:cacheprovider tests/test_gpu_parity.py
"""
from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from half_oracle import (SMOLLM2_NEAR_TIE, STEPS, TINY_NEAR_TIE_REF_ERRS, check_greedy, check_half,
                         first_divergence, half_reference, hf_greedy, max_abs, run_engine)
from hf_oracle import load_gguf_model, load_gguf_tokenizer
from tiny_models import GPU_DIAGNOSTIC_SHAPES, TINY_SHAPES, make_tiny_model
from vtool import VtoolError
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.runtime.artifact.cuda import GpuInfo, arch_runs_on, artifact_archs, target_for_compute_capability
from vtool.runtime.engine.generate import Generator
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.artifact.tvm_runtime import DRIVER, RuntimeLoadError, cuda_runtime

ARTIFACTS_ENV = "VTOOL_GPU_ARTIFACTS"
INDEX_NAME = "index.json"
PROMPT = [1, 5, 17, 42, 99, 7, 3, 250, 11, 300, 64]  # as test_parity_tiny
FP32_TOLERANCE = 1e-4
# Decode bounds above FP32_TOLERANCE, each measured against transformers in float64 on the H200:
# qwen2-yarn (yarn's attention factor 1.14 makes every attention logit 1.30x sharper) decodes 1.1e-4
# from transformers' cached float32 steps at step 26 of 32, but one float64 pass over the same tokens
# puts vtool's steps 6.1e-5 off and transformers' own float32 pass 7.1e-5 off
# (docs/results/h200-rope-scaling-session18.txt)
FP32_DECODE_TOLERANCE = {"qwen2-yarn": 2e-4}
# bfloat16 bounds: tests/support/half_oracle.py.
# bf16 gaps measured on the H200 and not yet understood (strict: a pass says the mark can go).
# (tiny shape -> why) bfloat16 gaps marked xfail (strict): none since the (1 + w) norm weights stay
# float32 (models/decoder.py PlusOneRMSNorm; gemma2-nocap's bf16 logits had been 1.99 from float32
# against a bound of 1.41, the same 2.07 on the CPU build)
KNOWN_BF16_GAPS: dict[str, str] = {}
SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


# -- the GPU, and where the artifacts come from ----------------------------------------------

@functools.lru_cache(maxsize=1)
def probe_gpu() -> tuple[GpuInfo | None, str]:
    """(the GPU, "") or (None, why no GPU test can run here). torch is imported first (above),
    so the vtool runtime shares torch's libcudart."""
    try:
        info = cuda_runtime().gpu(0)
    except VtoolError as e:
        return None, f"no CUDA GPU usable by the vtool runtime: {e}"
    if not torch.cuda.is_available():
        return None, f"vtool sees {info.describe()} but torch {torch.__version__} has no CUDA (the oracle runs there)"
    return info, ""


@pytest.fixture(scope="session")
def gpu() -> GpuInfo:
    info, reason = probe_gpu()
    if info is None:
        pytest.skip(reason)
    print(f"\n[gpu] {info.describe()}, {info.total_memory / 2**30:.1f} GiB; torch {torch.__version__} "
          f"({torch.cuda.get_device_name(0)})")
    return info


class Artifacts:
    """Prebuilt artifacts + checkpoints from VTOOL_GPU_ARTIFACTS, or builds made here."""

    def __init__(self, gpu: GpuInfo, tmp: Path):
        self.tmp = tmp
        root = os.environ.get(ARTIFACTS_ENV)
        if root:
            self.root: Path | None = Path(root)
            index_path = self.root / INDEX_NAME
            if not index_path.exists():
                pytest.fail(f"{ARTIFACTS_ENV}={root} has no {INDEX_NAME}; make it with tests/support/gpu_prebuild.py")
            self.index = json.loads(index_path.read_text())
            self.target = self.index["target"]
        else:
            if importlib.util.find_spec("tvm") is None:
                pytest.skip(f"no prebuilt artifacts ({ARTIFACTS_ENV} is unset) and no TVM compiler here to build "
                            "them; run tests/support/gpu_prebuild.py where apache-tvm is installed and point "
                            f"{ARTIFACTS_ENV} at its output")
            self.root, self.index = None, {}
            self.target = target_for_compute_capability(gpu.major, gpu.minor)
        print(f"[gpu] artifacts: {self.root or 'built here'} (target {self.target})")

    def _missing(self, key: str) -> None:
        error = self.index.get("errors", {}).get(key)
        if error and "is not supported on CUDA" in error:  # a shape the build refuses by name (toolchain/cuda.py)
            pytest.skip(f"the {self.target} build refuses {key} by name: {error}")
        pytest.fail(f"the {self.target} build of {key} failed in tests/support/gpu_prebuild.py: {error}" if error else
                    f"{self.root / INDEX_NAME} has no {key} artifact; rerun tests/support/gpu_prebuild.py")

    def tiny(self, name: str, dtype: str) -> tuple[Path, Path]:
        """(checkpoint folder, artifact folder) for a tiny shape at dtype."""
        if self.root is not None:
            if dtype not in self.index.get("dtypes", [dtype]):
                pytest.skip(f"{self.root / INDEX_NAME} was prebuilt without {dtype} (--dtypes)")
            entry = self.index["tiny"].get(name)
            if entry is None or dtype not in entry["artifacts"]:
                self._missing(f"{name}-{dtype}")
            return self.root / entry["checkpoint"], self.root / entry["artifacts"][dtype]
        from vtool.toolchain.build import build_artifact

        folder = self.tmp / "tiny" / name
        if not (folder / "config.json").exists():
            make_tiny_model(name, folder)
        return folder, build_artifact(folder, self.target, dtype)

    def embed(self, name: str, dtype: str) -> tuple[Path, Path]:
        """(checkpoint folder, artifact folder) for a tiny embedding model (gpu_prebuild's `embed`)."""
        if self.root is None:
            pytest.skip("the tiny embedding models come prebuilt only (tests/support/gpu_prebuild.py)")
        entry = self.index.get("embed", {}).get(name)
        if entry is None:
            pytest.skip(f"{self.root / INDEX_NAME} has no tiny {name} (its donor checkpoint was not at hand)")
        if dtype not in entry["artifacts"]:
            self._missing(f"{name}-{dtype}")
        return self.root / entry["checkpoint"], self.root / entry["artifacts"][dtype]

    def kernel_library(self, name: str) -> Path:
        """A kernel library gpu_prebuild made (index "kernels"), or one built here."""
        if self.root is not None:
            rel = self.index.get("kernels", {}).get(name)
            if rel is None:
                self._missing(f"{name}-probe" if name == "moe" else name)
            return self.root / rel
        import moe_probe

        lib = self.tmp / "kernels" / f"{name}_probe.so"
        if not lib.exists():
            moe_probe.build(lib, self.target)
        return lib

    def smollm2(self) -> tuple[Path, Path]:
        """(GGUF path, bfloat16 artifact folder)."""
        from vtool.runtime.weights.default_model import SHA256, default_model_path, sha256_of

        if self.root is not None:
            entry = self.index.get("smollm2")
            if entry is None:
                pytest.skip(f"{self.root / INDEX_NAME} has no SmolLM2 artifact (prebuilt with --no-smollm2)")
            if not entry.get("artifact"):
                self._missing("smollm2-bfloat16")
            gguf = self.root / entry["gguf"]
            if not gguf.exists():
                gguf = default_model_path(fetch=False)  # VtoolError names the cache when it is not there
            if sha256_of(gguf) != SHA256:
                pytest.fail(f"{gguf} is not the SmolLM2 GGUF vtool embeds (sha256 differs): badly reassembled?")
            return gguf, self.root / entry["artifact"]
        from vtool.toolchain.build import build_artifact

        gguf = default_model_path()
        return gguf, build_artifact(gguf, self.target, "bfloat16", checkpoint=open_checkpoint(gguf))


@pytest.fixture(scope="session")
def artifacts(gpu, tmp_path_factory) -> Artifacts:
    return Artifacts(gpu, tmp_path_factory.mktemp("gpu-artifacts"))


@pytest.fixture(autouse=True, scope="module")
def _exact_torch_float32():
    """transformers' float32 reference without TF32 (torch's default, made explicit)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# -- transformers on the GPU --------------------------------------------------------------

def load_hf_tiny(folder: Path, dtype: torch.dtype) -> Any:
    """transformers' model on the GPU, on its plain (eager) paths, as the CPU oracles run it:
    the default SDPA attention drops Gemma-2's attention soft-cap (the capped tiny model's
    "reference" was off by the cap's whole effect), and the default grouped expert GEMM on
    CUDA refuses bf16 experts whose rows are not 16-byte aligned (the tiny experts of 36)."""
    from transformers import AutoModelForCausalLM

    config = json.loads((folder / "config.json").read_text())
    moe = {"experts_implementation": "eager"} if config.get("num_experts") or config.get("num_local_experts") else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager",
                                                **moe).to("cuda").eval()


# -- tests that run anywhere: the arch rule and the refusal without a driver ----------------

@pytest.mark.parametrize("arch, cc, runs", [
    ("sm_80", (8, 0), True), ("sm_80", (8, 6), True), ("sm_80", (8, 9), True), ("sm_80", (9, 0), False),
    ("sm_86", (8, 0), False), ("sm_90a", (9, 0), True), ("sm_90a", (10, 0), False), ("sm_90", (9, 0), True),
    ("compute_80", (9, 0), True), ("compute_90", (12, 0), True), ("compute_90", (8, 9), False),
    ("compute_90a", (10, 0), False), ("sm_100f", (10, 3), True), ("sm_100a", (10, 3), False),
    ("sm_120a", (12, 0), True), ("sm_120", (12, 1), True), ("sm_120a", (12, 1), False),
])
def test_arch_coverage_rule(arch, cc, runs):
    assert arch_runs_on(arch, *cc) is runs


def test_artifact_archs_take_sass_and_ptx():
    assert artifact_archs({"archs": ["sm_80", "sm_90a"], "ptx": "compute_90"}) == ["sm_80", "sm_90a", "compute_90"]
    assert artifact_archs({"tvm": {"kind": "cuda", "arch": "sm_90"}}) == ["sm_90"]


@pytest.mark.parametrize("cc, name", [((9, 0), "sm_90a"), ((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 9), "sm_89"),
                                      ((10, 0), "sm_100a"), ((12, 0), "sm_120a")])
def test_target_for_compute_capability(cc, name):
    assert target_for_compute_capability(*cc) == name


def _fake_cuda_artifact(folder: Path, archs: list[str]) -> Path:
    """A manifest-only CUDA artifact: every refusal below happens before model.so is read."""
    from vtool.runtime.artifact.library import installed_versions
    from vtool.runtime.artifact.manifest import FORMAT_VERSION, write_manifest

    folder.mkdir(parents=True, exist_ok=True)
    write_manifest(folder, {
        "format_version": FORMAT_VERSION, "arch": "LlamaForCausalLM", "config": {}, "config_digest": "",
        "source_config": {}, "dtype": "float32", "quantization": "none", "versions": installed_versions(),
        "entry_points": [], "params": [], "library": "model.so",
        "target": {"name": ",".join(archs), "family": "cuda", "archs": archs, "tvm": {"kind": "cuda"}}})
    return folder


def test_cuda_artifact_without_a_driver_is_refused_by_name(tmp_path):
    try:
        import ctypes

        ctypes.CDLL(DRIVER)
    except OSError:
        pass
    else:
        pytest.skip(f"{DRIVER} loads here: this checks a machine without an NVIDIA driver")
    # The driver is what such a machine lacks; one without the CUDA runtime either is told that first.
    with pytest.raises(RuntimeLoadError, match=r"NVIDIA driver library libcuda\.so\.1|CUDA runtime libcudart"):
        CompiledModel(_fake_cuda_artifact(tmp_path / "art", ["sm_90a"]), None)


@pytest.mark.gpu
def test_cuda_artifact_for_another_gpu_is_refused_by_name(gpu, tmp_path):
    other = "sm_90a" if gpu.major == 8 else "sm_80"  # SASS that cannot run on this GPU
    with pytest.raises(VtoolError, match=f"code for {other}.*cannot run on GPU 0.*"
                                         f"build for --target {target_for_compute_capability(gpu.major, gpu.minor)}"):
        CompiledModel(_fake_cuda_artifact(tmp_path / "art", [other]), None)


# -- (a) tiny shapes -------------------------------------------------------------------------

class TinyCase:
    """One tiny shape: its checkpoint and, loaded on first use, a generator per dtype."""

    def __init__(self, name: str, artifacts: Artifacts):
        self.name, self._artifacts, self._generators = name, artifacts, {}

    def load(self, dtype: str) -> tuple[Path, Generator]:
        if dtype not in self._generators:
            folder, artifact = self._artifacts.tiny(self.name, dtype)
            gen = Generator(CompiledModel(artifact, open_checkpoint(folder)), max_model_len=256)
            assert gen.model.on_gpu, "a CUDA artifact must run on the GPU"
            self._generators[dtype] = folder, gen
        return self._generators[dtype]


@pytest.fixture(scope="module", params=[*sorted(TINY_SHAPES), *sorted(GPU_DIAGNOSTIC_SHAPES)])
def tiny(request, artifacts):
    return TinyCase(request.param, artifacts)


@pytest.mark.gpu
@pytest.mark.slow
def test_tiny_float32_matches_transformers(tiny):
    name = tiny.name
    folder, gen = tiny.load("float32")
    hf = load_hf_tiny(folder, torch.float32)
    ref_prompt, ref_tokens, ref_logits = hf_greedy(hf, PROMPT, STEPS)
    assert len(set(ref_tokens)) > 8, f"{name}: the reference is degenerate, the check would be weak"

    prompt_err = max_abs(gen.prompt_logits(PROMPT), ref_prompt)
    seen: list[np.ndarray] = []
    result = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=STEPS), on_logits=seen.append)
    errs = [max_abs(a, b) for a, b in zip(seen, ref_logits)]
    print(f"[{name} float32] max|dlogit| prompt {prompt_err:.2e}, decode {max(errs):.2e}; "
          f"tokens {'identical' if result.token_ids == ref_tokens else 'DIFFER'}")
    assert prompt_err < FP32_TOLERANCE, f"{name}: prompt logits differ by {prompt_err}"
    assert result.token_ids == ref_tokens, (
        f"{name}: greedy tokens diverge at step {first_divergence(result.token_ids, ref_tokens)}")
    worst = int(np.argmax(errs))
    bound = FP32_DECODE_TOLERANCE.get(name, FP32_TOLERANCE)
    assert errs[worst] < bound, f"{name}: logits at decode step {worst} differ by {errs[worst]}"


@pytest.mark.gpu
@pytest.mark.slow
def test_tiny_bfloat16_matches_transformers(tiny, request):
    if tiny.name in KNOWN_BF16_GAPS:
        request.node.add_marker(pytest.mark.xfail(reason=KNOWN_BF16_GAPS[tiny.name], strict=True))
    folder, gen = tiny.load("bfloat16")
    ref = half_reference(load_hf_tiny(folder, torch.float32), load_hf_tiny(folder, torch.bfloat16), PROMPT)
    check_half(f"{tiny.name} bfloat16", gen, PROMPT, ref, near_tie=TINY_NEAR_TIE_REF_ERRS * ref["ref_err"])


# -- (b) SmolLM2 in bfloat16 -----------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(artifacts):
    from vtool.runtime.session import open_session

    gguf, artifact = artifacts.smollm2()
    session = open_session(artifact, open_checkpoint(gguf), max_model_len=1024)
    assert session.model.on_gpu
    base = load_gguf_model(gguf)  # float32 on the CPU, cached per session; copies go to the GPU
    hf32 = copy.deepcopy(base).to("cuda")
    hf16 = copy.deepcopy(base).to("cuda", torch.bfloat16)
    tokenizer = load_gguf_tokenizer(gguf)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in SMOLLM2_PROMPTS]
    refs = [half_reference(hf32, hf16, ids) for ids in prompts]
    del hf32, hf16
    torch.cuda.empty_cache()
    return session, tokenizer, prompts, refs


@pytest.mark.parametrize("index", range(len(SMOLLM2_PROMPTS)))
@pytest.mark.gpu
@pytest.mark.slow
def test_smollm2_bfloat16_generator_matches_transformers(smollm2, index):
    session, tokenizer, prompts, refs = smollm2
    check_half(f"smollm2 bf16 #{index}", session.generator, prompts[index], refs[index],
                   near_tie=SMOLLM2_NEAR_TIE, decode=tokenizer.decode)


@pytest.mark.gpu
@pytest.mark.slow
def test_smollm2_bfloat16_engine_batch_matches_transformers(smollm2):
    """The three prompts at once through the continuous-batching engine (batch_prefill,
    batch_decode, KV sized by gpu_memory_utilization): each against transformers."""
    from vtool.runtime.engine.engine import Engine, EngineConfig, kv_bytes_per_block

    session, tokenizer, prompts, refs = smollm2
    free_before, total = session.model.device_memory()
    config = EngineConfig(max_num_seqs=4, enable_prefix_caching=False, gpu_memory_utilization=0.5)
    engine = Engine(session, config)
    per_block = kv_bytes_per_block(session.model.manifest, config.block_size)
    cap = -(-engine.max_model_len * config.max_num_seqs // config.block_size)
    print(f"[smollm2 engine] {engine.kv.blocks.num_blocks} KV blocks (budget {free_before * 0.5 / 2**30:.1f} GiB "
          f"= {int(free_before * 0.5) // per_block} blocks, capped at {cap}); GPU {free_before / 2**30:.1f} GiB free "
          f"of {total / 2**30:.1f}")
    assert engine.kv.blocks.num_blocks >= min(cap, int(free_before * 0.5) // per_block)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    done = run_engine(engine, prompts, lambda _i: params)
    assert engine.kv.in_sync(), "block mirror and TVM disagree"
    for i, ref in enumerate(refs):
        check_greedy(f"smollm2 engine #{i}", done[f"r{i}"], ref["tokens"], ref["logits"],
                     near_tie=SMOLLM2_NEAR_TIE, decode=tokenizer.decode)


def _engine_tokens(session, prompts, params_for, device_sampling: bool) -> tuple[dict, Any]:
    from vtool.runtime.engine.engine import Engine, EngineConfig

    engine = Engine(session, EngineConfig(max_num_seqs=4, enable_prefix_caching=False,
                                          gpu_memory_utilization=0.3, device_sampling=device_sampling))
    return run_engine(engine, prompts, params_for), engine


@pytest.mark.gpu
@pytest.mark.slow
def test_smollm2_engine_samples_on_the_gpu_like_the_host(smollm2):
    """Seeded random sampling through the engine: the compiled device sampler (logits never
    leave the GPU) draws the same tokens as the host sampler from the same seeds, for plain
    temperature, top-p and top-k + min-p requests batched together, and with a greedy one."""
    session, tokenizer, prompts, _ = smollm2
    kinds = [dict(temperature=0.8), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=20, min_p=0.05),
             dict(temperature=0.0)]
    batch = (prompts * 2)[: len(kinds)]

    def params_for(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=STEPS, ignore_eos=True, seed=1234 + i, **kinds[i])

    on_device, engine = _engine_tokens(session, batch, params_for, device_sampling=True)
    assert engine.device_sampler is not None, "the library has no device sampler"
    on_host, host_engine = _engine_tokens(session, batch, params_for, device_sampling=False)
    assert host_engine.device_sampler is None
    for i, kind in enumerate(kinds):
        ours, theirs = on_device[f"r{i}"], on_host[f"r{i}"]
        print(f"[smollm2 device sampling {kind}] {tokenizer.decode(ours)!r}")
        assert len(ours) == STEPS
        assert ours == theirs, f"{kind}: device {ours} vs host {theirs}"


def _scripted_engine_run(session, chain: bool | None, script: dict[int, list[tuple[str, Any]]],
                         max_num_seqs: int = 8, overlap: bool = True) -> tuple[dict[str, list[int]], dict[str, str], Any]:
    """Step an engine, doing script[k] (("add", (rid, ids, params)) or ("abort", rid)) before call k;
    the tokens and finish reason of each request, and the engine (its blocks checked after).
    overlap: model calls on the model thread beside the host work (engine/model_thread.py)."""
    from vtool.runtime.engine.engine import Engine, EngineConfig

    engine = Engine(session, EngineConfig(max_num_seqs=max_num_seqs, enable_prefix_caching=False,
                                          gpu_memory_utilization=0.3, chain_steps=chain,
                                          overlap_model_calls=overlap))
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for call in range(20 * STEPS):
        for action, arg in script.get(call, ()):
            if action == "add":
                rid, ids, params = arg
                engine.add_request(rid, ids, params, with_text=False)
                tokens[rid] = []
            else:
                engine.abort(arg)
                reasons[arg] = "abort"
        if not engine.has_unfinished() and call > max(script):
            break
        for out in engine.step_core():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    assert not engine.has_unfinished(), "the engine stopped making progress"
    blocks = engine.kv.blocks
    assert blocks.num_free_blocks == blocks.num_blocks, "blocks still held after every request ended"
    assert engine.kv.in_sync(), "block mirror and TVM disagree"
    return tokens, reasons, engine


@pytest.mark.gpu
@pytest.mark.slow
def test_smollm2_chained_steps_change_no_token(smollm2):
    """Steps queued before the previous step's tokens are back, their input tokens gathered on the
    device (engine/chained_steps.py), give exactly the tokens of steps that wait for them: greedy
    and seeded requests of different lengths, two arriving while others decode, one aborted halfway.
    Length-limited requests keep both runs' batches identical step for step (a request at its
    limit ends the chain), so the tokens must match bit for bit."""
    session, tokenizer, prompts, _ = smollm2

    def params(i: int, max_tokens: int) -> SamplingParams:
        kind = [dict(temperature=0.0), dict(temperature=0.8, seed=7 + i), dict(temperature=1.0, top_p=0.9, seed=i),
                dict(temperature=0.7, top_k=20, min_p=0.05, seed=3 * i)][i % 4]
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kind)

    lengths = [STEPS, STEPS // 2, STEPS + 9, 5, STEPS, 12]
    script = {0: [("add", (f"r{i}", prompts[i % len(prompts)], params(i, lengths[i]))) for i in range(4)],
              7: [("add", ("r4", prompts[1][:9], params(4, lengths[4])))],
              11: [("abort", "r2")],
              19: [("add", ("r5", prompts[2], params(5, lengths[5])))]}
    waited, waited_reasons, plain = _scripted_engine_run(session, False, script, overlap=False)
    chained, chained_reasons, engine = _scripted_engine_run(session, True, script, overlap=False)
    print(f"[chained steps] {engine.counters.chained_steps} of {engine.counters.steps} steps chained; "
          f"{plain.counters.steps} steps without")
    assert plain.counters.chained_steps == 0 and plain.model_thread is None
    assert engine.counters.chained_steps >= STEPS // 2, "hardly any step was chained"
    # and chained with the model thread (engine/model_thread.py), step N collected while step N+1's
    # call queues it: the default (chain_steps None: steps of 2+ sequences) and every step (True)
    for chain in (None, True):
        threaded, threaded_reasons, beside = _scripted_engine_run(session, chain, script)
        calls = beside.model_thread.overlapped_calls
        print(f"[model thread, chain_steps={chain}] {calls} of {beside.counters.steps} steps' model calls beside "
              f"host work, {beside.counters.chained_steps} chained")
        assert calls >= STEPS // 2, "hardly any model call ran beside the host work"
        assert threaded_reasons == waited_reasons
        assert threaded == waited, f"model thread (chain={chain}): {threaded} vs waiting {waited}"
    assert chained_reasons == waited_reasons
    for rid in waited:
        assert chained[rid] == waited[rid], f"{rid}: chained {chained[rid]} vs waiting {waited[rid]}"
        if rid != "r2":
            assert len(chained[rid]) == lengths[int(rid[1:])]
    assert 0 < len(chained["r2"]) < lengths[2]


@pytest.mark.gpu
@pytest.mark.slow
def test_smollm2_steps_whose_draw_reports_logprobs_do_not_chain(smollm2):
    """A draw that reports logprobs leaves its step's logits rows for the host to copy when the step
    is collected; a chained next step (captured at the same size: the same logits buffer) would
    write them first. So while such a request runs, steps wait: its logprobs and everyone's tokens
    equal the run that never chains, and steps chain again once it has ended."""
    from vtool.runtime.engine.engine import Engine, EngineConfig

    session, _, prompts, _ = smollm2

    def run(chain: bool | None) -> tuple[dict[str, list], Any]:
        engine = Engine(session, EngineConfig(max_num_seqs=4, enable_prefix_caching=False,
                                              gpu_memory_utilization=0.3, chain_steps=chain))
        engine.add_request("plain", prompts[0], SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=0.0),
                           with_text=False)
        engine.add_request("logprobs", prompts[1], SamplingParams(max_tokens=STEPS // 2, ignore_eos=True,
                                                                  temperature=0.8, seed=5, logprobs=3),
                           with_text=False)
        got: dict[str, list] = {"plain": [], "logprobs": []}
        while engine.has_unfinished():
            for out in engine.step_core():
                got[out.request_id].extend(zip(out.new_token_ids, out.new_logprobs or [None] * len(out.new_token_ids)))
        return got, engine

    waited, _ = run(False)
    chained, engine = run(None)
    assert chained == waited
    assert all(lp is not None and len(lp) >= 3 for _, lp in chained["logprobs"])
    # chained only after the logprobs request ended: the plain one then runs alone (one sequence does
    # not chain by default), so no step chains at all here; with two plain requests some would
    print(f"[logprobs and chaining] {engine.counters.chained_steps} of {engine.counters.steps} steps chained")
    assert engine.counters.chained_steps == 0


@pytest.mark.gpu
@pytest.mark.slow
def test_smollm2_a_stop_token_ends_a_chained_request_where_it_should(smollm2):
    """A request that a stop token ends has one more step queued behind it when its chain runs: that
    step's token is dropped and its blocks are freed; the output ends at the stop token, as
    without chaining."""
    session, tokenizer, prompts, _ = smollm2
    greedy = SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=0.0)
    free, _, _ = _scripted_engine_run(session, False, {0: [("add", ("r0", prompts[0], greedy))]})
    stop = free["r0"][STEPS // 2]
    first = free["r0"].index(stop)
    stopping = SamplingParams(max_tokens=STEPS, temperature=0.0, stop_token_ids=[stop])
    for chain in (False, True, None):  # None, the default: one sequence alone does not chain
        tokens, reasons, engine = _scripted_engine_run(session, chain,
                                                       {0: [("add", ("r0", prompts[0], stopping))]})
        assert tokens["r0"] == free["r0"][: first + 1], f"chain={chain}"
        assert reasons == {"r0": "stop"}
        assert (engine.counters.chained_steps > 0) == (chain is True)


# -- (c) FlashInfer attention (`vtool build --attention flashinfer`) ----------------------------
# Libraries built elsewhere with FlashInfer's kernels (they need flashinfer-python and minutes
# of nvcc at build time, so they are prebuilt): VTOOL_GPU_FLASHINFER_ARTIFACTS names a folder
# whose index.json maps a case name to {"checkpoint": dir, "artifact": dir} (relative paths).
FLASHINFER_ENV = "VTOOL_GPU_FLASHINFER_ARTIFACTS"


def _flashinfer_cases() -> list[str]:
    root = os.environ.get(FLASHINFER_ENV)
    if not root or not (Path(root) / "index.json").exists():
        return ["(none)"]
    return sorted(json.loads((Path(root) / "index.json").read_text()))


@pytest.mark.parametrize("case", _flashinfer_cases())
@pytest.mark.gpu
def test_flashinfer_bfloat16_matches_transformers(gpu, case):
    """Prefill and decode through FlashInfer's kernels against transformers, with the same
    bf16 bounds as the TIR-attention libraries."""
    root = os.environ.get(FLASHINFER_ENV)
    if case == "(none)":
        pytest.skip(f"no FlashInfer artifacts ({FLASHINFER_ENV} unset or without index.json)")
    entry = json.loads((Path(root) / "index.json").read_text())[case]
    folder, artifact = Path(root) / entry["checkpoint"], Path(root) / entry["artifact"]
    model = CompiledModel(artifact, open_checkpoint(folder))
    assert model.manifest.get("attention") == "flashinfer"
    gen = Generator(model, max_model_len=256)
    ref = half_reference(load_hf_tiny(folder, torch.float32), load_hf_tiny(folder, torch.bfloat16), PROMPT)
    check_half(f"{case} flashinfer bfloat16", gen, PROMPT, ref, near_tie=TINY_NEAR_TIE_REF_ERRS * ref["ref_err"])


@pytest.mark.gpu
@pytest.mark.slow
def test_smollm2_as_its_own_draft_changes_no_greedy_token_on_the_gpu(smollm2, artifacts):
    """Speculation on the GPU with SmolLM2 drafting for itself: a greedy request's
    verification takes the argmax of its rows on the device (only token ids come to the host);
    its tokens are those of the engine without speculation and every KV block is back at the
    end. A greedy request batched with a sampling one verifies on the host, same tokens."""
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.engine.spec_config import parse_speculative_config

    session, tokenizer, prompts, _ = smollm2
    gguf, artifact = artifacts.smollm2()
    greedy = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    plain, _ = _engine_tokens(session, prompts[:1], lambda _i: greedy, device_sampling=True)
    config = parse_speculative_config({"model": str(gguf), "num_speculative_tokens": 3})
    engine = Engine(session, EngineConfig(max_num_seqs=4, enable_prefix_caching=False, gpu_memory_utilization=0.3,
                                          speculative=config.resolved(str(artifact), str(gguf))))
    calls = {"device_verifies": 0}
    rows = engine.runner._finish_greedy_rows

    def counted_rows(*args):
        calls["device_verifies"] += 1
        return rows(*args)

    engine.runner._finish_greedy_rows = counted_rows
    got = run_engine(engine, prompts[:1], lambda _i: greedy)
    stats = engine.stats()
    print(f"[smollm2 self-draft] {calls}, {stats['spec_num_accepted_tokens']}/{stats['spec_num_draft_tokens']} kept")
    assert got == plain
    assert calls["device_verifies"] > 0
    assert stats["spec_num_accepted_tokens"] >= 0.9 * stats["spec_num_draft_tokens"] > 0
    assert engine.kv.in_sync() and engine.kv_usage() == 0.0
    mixed = [greedy, SamplingParams(temperature=0.8, seed=5, max_tokens=STEPS, ignore_eos=True)]
    calls["device_verifies"] = 0
    both = run_engine(engine, prompts[:2], lambda i: mixed[i])
    assert both["r0"] == plain["r0"] and calls["device_verifies"] == 0
    assert engine.kv.in_sync() and engine.kv_usage() == 0.0


@pytest.mark.gpu
@pytest.mark.slow
def _with_word_tokenizer(folder: Path, out: Path) -> Path:
    """A copy of a tiny checkpoint with a word-level tokenizer.json over its vocabulary ("t0",
    "t1", ...): the engine needs a tokenizer, the tiny shapes have none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    shutil.copytree(folder, out)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(out / "tokenizer.json"))
    return out


def test_tiny_model_as_its_own_draft_takes_its_argmax_on_the_gpu(artifacts, tmp_path):
    """A tiny float32 model drafting for itself on the GPU: the draft's greedy rounds take their
    argmax on the device (ModelRunner.argmax_rows: only token ids come back), it proposes what
    the target decodes, the tokens are those of the engine without speculation, and every KV
    block is back at the end."""
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.engine.spec_config import parse_speculative_config
    from vtool.runtime.session import open_session

    folder, artifact = artifacts.tiny("llama-gqa", "float32")
    folder = _with_word_tokenizer(folder, tmp_path / "llama-gqa")
    session = open_session(artifact, open_checkpoint(folder), max_model_len=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:5]]
    plain, _ = _engine_tokens(session, prompts, lambda _i: greedy, device_sampling=True)
    config = parse_speculative_config({"model": str(folder), "num_speculative_tokens": 3})
    engine = Engine(session, EngineConfig(max_num_seqs=4, enable_prefix_caching=False, gpu_memory_utilization=0.3,
                                          speculative=config.resolved(str(artifact), str(folder))))
    engine.speculator.proposer.argmax_on_device = True
    runner = engine.speculator.proposer.runner
    calls = {"draft_argmax": 0}
    argmax_rows = runner.argmax_rows

    def counted(*args):
        calls["draft_argmax"] += 1
        return argmax_rows(*args)

    runner.argmax_rows = counted
    got = run_engine(engine, prompts, lambda _i: greedy)
    stats = engine.stats()
    print(f"[tiny self-draft] {calls}, {stats['spec_num_accepted_tokens']}/{stats['spec_num_draft_tokens']} kept")
    assert got == plain
    assert calls["draft_argmax"] > 0
    assert stats["spec_num_accepted_tokens"] >= 0.9 * stats["spec_num_draft_tokens"] > 0
    assert engine.kv.in_sync() and engine.kv_usage() == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, min_cosine, max_abs", [("float32", 1 - 1e-6, 1e-4), ("bfloat16", 0.999, None)])
def test_tiny_bert_embeds_like_transformers_on_the_gpu(artifacts, dtype, min_cosine, max_abs):
    """A tiny random BertModel (all-MiniLM-L6-v2's tokenizer and mean pooling + Normalize):
    vectors from its CUDA library against transformers (float32, pooled as the checkpoint
    says), texts of different lengths in one padded batch, and each text alone as in the batch."""
    from embed_oracle import cosines, reference
    from vtool.runtime.engine.embed import Embedder
    from vtool.runtime.session import open_session

    folder, artifact = artifacts.embed("bert", dtype)
    session = open_session(artifact, open_checkpoint(folder))
    assert session.model.on_gpu
    embedder = Embedder(session)
    texts = ["hello world", "A somewhat longer sentence, with punctuation and more words in it.", "x",
             "Embeddings on the GPU should match the reference."]
    ids = [embedder.tokenize(t) for t in texts]
    got = embedder.embed(ids)
    want = reference(folder, texts)
    cos = cosines(got, want)
    print(f"[tiny bert {dtype}] cosine min {cos.min():.9f}, max|d| {np.abs(got - want).max():.2e}")
    assert cos.min() >= min_cosine, cos
    if max_abs is not None:
        assert np.abs(got - want).max() < max_abs
    alone = np.stack([embedder.embed([i])[0] for i in ids])
    np.testing.assert_allclose(alone, got, atol=2e-5 if dtype == "float32" else 2e-2)


@pytest.mark.gpu
def test_moe_kernels_match_numpy_on_the_gpu(artifacts):
    """models/moe.py's router and gather-GEMV, scheduled as a model build schedules them
    (schedules/cuda/moe.py), alone on the GPU against numpy (tests/support/moe_probe.py): the
    tiny models' expert sizes (36, 40), bf16 and float32, a prompt's tokens and one token."""
    import moe_probe

    results = moe_probe.check(artifacts.kernel_library("moe"))
    for name, r in results.items():
        print(f"[moe kernel] {name}: {r}")
    bad = {name: r for name, r in results.items() if not r["ok"]}
    assert not bad, f"MoE kernels wrong on the GPU: {bad}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, min_cosine, max_rel", [("float32", 1 - 1e-6, 1e-4), ("bfloat16", 0.999, None)])
def test_tiny_embeddinggemma_embeds_like_transformers_on_the_gpu(artifacts, dtype, min_cosine, max_rel):
    """A tiny random EmbeddingGemma (bidirectional Gemma-3, windows shorter than the inputs,
    head_dim 256 as the real one; models/gemma_encoder.py) on the GPU: hidden states of a
    right-padded batch against transformers' eager Gemma3TextModel on the GPU, and the vectors
    through the checkpoint's pooling head."""
    from transformers import Gemma3TextModel

    from embed_oracle import cosines, st_reference
    from vtool.runtime.engine.pooling import load_pooler

    folder, artifact = artifacts.embed("embeddinggemma", dtype)
    lengths = [23, 3, 17, 11]
    rng = np.random.default_rng(3)
    ids = np.zeros((len(lengths), max(lengths)), np.int32)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = [2] + rng.integers(3, 512, n - 1).tolist()
        mask[row, :n] = 1
    m = CompiledModel(artifact, open_checkpoint(folder))
    assert m.on_gpu
    got = m.to_numpy(m.function("encode")(m.upload(ids), m.upload(mask), m.params)).astype(np.float32)
    hf = Gemma3TextModel.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").to("cuda").eval()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids, dtype=torch.long, device="cuda"),
                  attention_mask=torch.tensor(mask, device="cuda")).last_hidden_state.cpu()
    err = max(float(np.abs(got[r, :n] - want[r, :n].numpy()).max()) for r, n in enumerate(lengths))
    scale = float(want.abs().max())
    manifest = json.loads((artifact / "manifest.json").read_text())
    pooler = load_pooler(folder, 64, manifest["default_pooling"])
    vec = pooler.finish(pooler.pool(got, lengths))
    cos = cosines(vec, st_reference(folder, want, torch.tensor(mask)))
    print(f"[tiny embeddinggemma {dtype}] hidden max|d| {err:.2e} (max|h| {scale:.1f}); cosine min {cos.min():.9f}")
    assert cos.min() >= min_cosine, cos
    if max_rel is not None:
        assert err < max_rel * max(1.0, scale), err


# -- (d) the KV cache that frees what a sliding window passed (issue 18) -----------------------------

@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("shape", ["mistral-window", "phi3-window"])
def test_window_freeing_on_the_gpu(artifacts, shape):
    """A model windowed on every layer (window 8) on the freeing cache, which a CUDA library has
    and uses when asked (TVM's GPU kernels, inline rope, the window masked per query:
    models/window_cache.py): a 40-token prompt and 60 greedy tokens as transformers gives them
    on this GPU, its logits within the CPU test's bounds, at most 2 pages held; through the
    engine (steps overlapped) the block mirror equals TVM's free-page count after every step, each sequence holds at most
    2 blocks where the per-layer cache grows to 7, the tokens equal that cache's, and the KV
    gauge is back at 0."""
    from hf_oracle import float32_rounding
    from window_oracle import (BOUND, KEPT, PROMPT, STEPS, TOL, TOL_LONG, generate_counting_pages, run_engine,
                               session_of)

    folder, artifact = artifacts.tiny(shape, "float32")
    model = CompiledModel(artifact, open_checkpoint(folder))
    assert model.on_gpu and model.manifest.get("window_freeing_kernels") == "tvm-gpu"
    ref_prompt, ref_tokens, ref_logits = hf_greedy(load_hf_tiny(folder, torch.float32), PROMPT, STEPS)
    rounding = float32_rounding(folder, PROMPT, (ref_prompt, ref_tokens, ref_logits), attn_implementation="eager")

    assert Generator(model, 256).kept == 0  # not by default: slower than the per-layer cache on CUDA
    gen = Generator(model, 256, free_window=True)
    assert gen.kept == KEPT
    prompt_err = max_abs(gen.prompt_logits(PROMPT), ref_prompt)
    tokens, seen, held = generate_counting_pages(gen)
    errs = [max_abs(a, b) for a, b in zip(seen, ref_logits)]
    print(f"[{shape} window freeing] prompt {prompt_err:.2e}, first 24 steps {max(errs[:24]):.2e}, all "
          f"{max(errs):.2e} (transformers' float32 rounding {rounding:.2e}); pages held {held}")
    assert tokens == ref_tokens, f"diverges at step {first_divergence(tokens, ref_tokens)}"
    assert prompt_err < TOL + rounding and max(errs[:24]) < TOL + rounding and max(errs) < TOL_LONG + rounding
    assert max(held) <= BOUND and held[-1] >= 1

    done, per_seq, most = run_engine(session_of(folder, model))
    kept, per_seq_kept, _ = run_engine(session_of(folder, model), frees=False)
    print(f"[{shape} window freeing] engine: {per_seq} blocks a sequence at most ({most} in all), "
          f"per-layer cache {per_seq_kept}")
    assert done["a"] == ref_tokens and done == kept
    assert per_seq <= BOUND and most <= 2 * BOUND and per_seq_kept == -(-(len(PROMPT) + STEPS) // 16)
