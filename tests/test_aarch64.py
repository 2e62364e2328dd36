"""`vtool build --target aarch64-neon` on this x86-64 machine: LLVM writes the aarch64 code,
zig cc (the `cross` extra, in the test extra) links it. No Arm CPU is here, so what is
checked is what can be read: the library's ELF header (by the gABI's constants, not vtool's
reader), the decode GEMV's assembly (NEON fused multiply-adds on 4 float32 lanes, a parallel
launch), the runtime's refusal to load it here, and the same link recipe aimed at x86-64,
loaded and run here against transformers."""
from __future__ import annotations

import functools
import importlib.util
import json
import platform
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.runtime.artifact.manifest import ManifestError
from vtool.targets import lookup
from vtool.toolchain import cross_link

HAVE_ZIG = importlib.util.find_spec("ziglang") is not None
needs_zig = pytest.mark.skipif(not HAVE_ZIG, reason="the cross linker (ziglang, `pip install 'vtool[cross]'`) "
                                                     "is not installed")
pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="these tests cross-build for aarch64 from an x86-64 host")

EM_AARCH64, EM_X86_64, ET_DYN = 183, 62, 3


def elf_header(path: Path) -> dict[str, int]:
    """(class, byte order, type, machine) from an ELF header, per the System V gABI."""
    head = path.read_bytes()[:20]
    assert head[:4] == b"\x7fELF", f"{path} is not ELF"
    order = "<" if head[5] == 1 else ">"
    e_type, e_machine = struct.unpack_from(order + "HH", head, 16)
    return {"class": head[4], "data": head[5], "type": e_type, "machine": e_machine}


def vtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vtool.toolchain.cli", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def tiny(tiny_shape_dir) -> Path:  # tests/conftest.py; read only
    return tiny_shape_dir("llama-gqa")


@pytest.fixture(scope="module")
def neon_artifact(tiny, tmp_path_factory) -> Path:
    """Built the way a user does it: the CLI, on this x86-64 machine."""
    if not HAVE_ZIG:
        pytest.skip("the cross linker (ziglang, `pip install 'vtool[cross]'`) is not installed")
    out = tmp_path_factory.mktemp("neon") / "artifact"
    done = vtool("build", "--model", str(tiny), "--target", "aarch64-neon", "--output", str(out))
    assert done.returncode == 0, done.stderr
    return out


@needs_zig
def test_library_is_an_aarch64_shared_object(neon_artifact):
    header = elf_header(neon_artifact / "model.so")
    assert header == {"class": 2, "data": 1, "type": ET_DYN, "machine": EM_AARCH64}  # ELF64, LE, ET_DYN
    manifest = json.loads((neon_artifact / "manifest.json").read_text())
    assert manifest["target"]["name"] == "aarch64-neon"
    assert manifest["target"]["requires_cpu"] == ["asimd"]
    link = manifest["build"]["pipeline"]["link"]
    assert link["link_target"].startswith("aarch64-linux-gnu") and link["linker"].startswith("zig cc ")


@functools.lru_cache(maxsize=4)  # the pipeline takes seconds; two tests read the aarch64 kernels
def _decode_gemvs(model_dir: Path, target_name: str) -> dict:
    """The model's decode GEMVs (NT matmuls with one static input row) after vtool's own
    pipeline for the target, i.e. as the build schedules them."""
    import tvm
    from tvm import tirx

    from vtool.models.config import parse_hf_config
    from vtool.models.decoder import DecoderForCausalLM
    from vtool.toolchain.pipeline import build_pipeline

    spec = lookup(target_name)
    target = tvm.target.Target(spec.tvm)
    cfg = parse_hf_config(json.loads((model_dir / "config.json").read_text()))
    model = DecoderForCausalLM(cfg, "float32", target)
    mod, _ = model.export_tvm(spec=model.get_default_spec())
    with target:
        lowered = build_pipeline(target, spec.family)(mod)
    found = {}
    for gv, func in lowered.functions_items():
        if not isinstance(func, tirx.PrimFunc) or "NT_matmul" not in gv.name_hint:
            continue
        dims = list(getattr(func.params[0], "shape", None) or [])  # buffer parameters carry their shape
        if dims and all(isinstance(d, tirx.IntImm) for d in dims) and int(np.prod([int(d) for d in dims[:-1]])) == 1:
            found[gv.name_hint] = func
    return found


def _assembly(name: str, func, target_name: str) -> str:
    import tvm

    target = tvm.target.Target(lookup(target_name).tvm)
    with target:
        executable = tvm.compile(tvm.IRModule({name: func}), target=target)
    return executable.mod.inspect_source("s")


@needs_zig
def test_decode_gemv_uses_neon_fma_and_runs_in_parallel(tiny):
    gemvs = _decode_gemvs(tiny, "aarch64-neon")
    # q|k|v, o, gate|up, down, lm_head: each a static 1-row GEMV in `decode`
    assert len(gemvs) >= 4, sorted(gemvs)
    for name, func in gemvs.items():
        asm = _assembly(name, func, "aarch64-neon")
        assert re.search(r"\bfmla\s+v\d+\.4s", asm), f"{name}: no NEON fmla on 4 float32 lanes"
        # TVM calls its thread pool through this function pointer, which the loader fills in
        assert "__TVMBackendParallelLaunch" in asm, f"{name}: not parallel"
        assert not re.search(r"%[xy]mm\d", asm), f"{name}: x86 registers in aarch64 code"


def test_x86_assembly_has_no_neon(tiny):
    """The control for the check above: the x86 build of one GEMV holds no NEON fmla."""
    name, func = sorted(_decode_gemvs(tiny, "x86-avx2").items())[0]
    asm = _assembly(name, func, "x86-avx2")
    assert not re.search(r"\bfmla\s+v\d+\.4s", asm) and re.search(r"vfmadd\w*ps", asm)


def _with_tokenizer(model_dir: Path, dest: Path) -> Path:
    """The tiny model plus a word-level tokenizer.json over its 512 ids (`vtool run` reads text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.copytree(model_dir, dest)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(dest / "tokenizer.json"))
    return dest


@needs_zig
def test_run_here_is_refused_by_name(tiny, neon_artifact, tmp_path):
    model = _with_tokenizer(tiny, tmp_path / "model")
    done = vtool("run", "--model", str(model), "--artifact", str(neon_artifact), "--prompt", "w5 w7",
                 "--max-tokens", "2")
    assert done.returncode == 2, done.stderr
    assert "aarch64-neon" in done.stderr and "aarch64 code" in done.stderr and "x86_64" in done.stderr
    assert "Traceback" not in done.stderr


@needs_zig
def test_library_whose_manifest_claims_x86_is_never_loaded(tiny, neon_artifact, tmp_path):
    """A manifest edited to claim x86: the library's own ELF header still stops the load."""
    from vtool.runtime.artifact.library import CompiledModel

    fake = tmp_path / "fake"
    shutil.copytree(neon_artifact, fake)
    manifest = json.loads((fake / "manifest.json").read_text())
    manifest["target"] = lookup("x86-portable").describe()
    (fake / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"model\.so holds aarch64 code and this machine is x86_64"):
        CompiledModel(fake, open_checkpoint(tiny))


def test_missing_cross_linker_is_refused_with_the_install_hint(tiny, monkeypatch, tmp_path):
    from vtool.toolchain.build import build_artifact

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ziglang" else real_find_spec(name, *a))
    cross_link.zig_executable.cache_clear()
    cross_link.zig_version.cache_clear()
    try:
        with pytest.raises(cross_link.CrossLinkError,
                           match=r"'aarch64-neon' is aarch64 code and this machine is x86_64.*vtool\[cross\]"):
            build_artifact(tiny, "aarch64-neon", output=tmp_path / "a")
    finally:
        cross_link.zig_executable.cache_clear()
        cross_link.zig_version.cache_clear()
    assert not (tmp_path / "a").exists()


@needs_zig
@pytest.mark.slow
def test_zig_link_recipe_loads_and_matches_transformers_on_x86(tiny, monkeypatch, tmp_path):
    """The exact recipe used for aarch64 (zig cc, glibc 2.17 stubs, undefined TVM symbols left
    to the loader), aimed at x86-64 so the library can be loaded and run here."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_oracle import greedy
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.engine.generate import Generator
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.toolchain.build import build_artifact

    monkeypatch.setattr(cross_link, "host_isa", lambda: "aarch64")  # x86 code counts as foreign now
    assert cross_link.fcompile_for(lookup("x86-portable")) is not None
    artifact = build_artifact(tiny, "x86-portable", output=tmp_path / "x86")
    assert json.loads((artifact / "manifest.json").read_text())["build"]["pipeline"]["link"]["link_target"] \
        == "x86_64-linux-gnu.2.17"
    assert elf_header(artifact / "model.so")["machine"] == EM_X86_64
    prompt, steps = [1, 5, 17, 42, 99, 7, 3], 12
    _, ref_tokens, ref_logits = greedy(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval(),
                                       prompt, steps)
    seen: list[np.ndarray] = []
    gen = Generator(CompiledModel(artifact, open_checkpoint(tiny)), max_model_len=64)
    result = gen.generate(prompt, SamplingParams(temperature=0, max_tokens=steps), on_logits=seen.append)
    assert result.token_ids == ref_tokens
    assert max(float(np.abs(a - b).max()) for a, b in zip(seen, ref_logits)) < 1e-4


def _mixed_format(name: str):
    """One file, every kept format: Q8_0 attention, Q4_0 gate|up, Q4_1 down and embedding."""
    from quant_gguf import Q

    if ".attn_" in name:
        return Q.Q8_0
    return Q.Q4_0 if ".ffn_gate" in name or ".ffn_up" in name else Q.Q4_1


@needs_zig
@pytest.mark.slow
def test_gguf_quantized_build_for_aarch64(tmp_path):
    from quant_gguf import write_tiny_gguf
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.toolchain.build import build_artifact

    path = write_tiny_gguf(tmp_path / "m.gguf", _mixed_format, tie=True)
    artifact = build_artifact(path, "aarch64-neon", "float32", output=tmp_path / "a", quantization="gguf")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"] == "gguf"
    assert set(manifest["quantized_weights"]["kept"]) == {"Q8_0", "Q4_0", "Q4_1"}, manifest["quantized_weights"]
    assert elf_header(artifact / "model.so")["machine"] == EM_AARCH64
    with pytest.raises(ManifestError, match="aarch64 code"):
        CompiledModel(artifact, open_checkpoint(path))


QEMU = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")


@needs_zig
@pytest.mark.skipif(QEMU is None, reason="qemu-user is not installed (apt-get install qemu-user-static); "
                                         "the aarch64 code is then checked by inspection only")
def test_decode_gemv_computes_under_aarch64_emulation(tiny, tmp_path):
    """The lm_head decode GEMV as the aarch64 build schedules it, linked statically with a
    small C harness and run by qemu-user: the NEON code's result against numpy."""
    import tvm
    import tvm_ffi

    gemvs = {n: f for n, f in _decode_gemvs(tiny, "aarch64-neon").items() if len(f.params) == 3}
    name, func = max(gemvs.items(), key=lambda item: int(item[1].params[1].shape[0]))
    n, k = (int(d) for d in func.params[1].shape)
    target = tvm.target.Target(lookup("aarch64-neon").tvm)
    with target:
        tvm.compile(tvm.IRModule({name: func}), target=target).mod.write_to_file(str(tmp_path / "kernel.o"))
    harness, exe = Path(__file__).parent / "support" / "aarch64_gemv_harness.c", tmp_path / "gemv"
    include = Path(tvm_ffi.__file__).parent / "include"
    subprocess.run([str(cross_link.zig_executable()), "cc", "-target", "aarch64-linux-musl", "-static", "-O2",
                    f"-I{include}", f"-DKERNEL=__tvm_ffi_{name}", f"-DK={k}", f"-DN={n}", "-DNTASK=4",
                    str(harness), str(tmp_path / "kernel.o"), "-o", str(exe)], check=True, capture_output=True)
    assert elf_header(exe)["machine"] == EM_AARCH64
    rng = np.random.default_rng(0)
    a, w = rng.standard_normal(k).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    done = subprocess.run([QEMU, str(exe)], input=a.tobytes() + w.tobytes(), capture_output=True, timeout=120)
    assert done.returncode == 0 and b"tasks=4" in done.stderr, done.stderr
    got = np.frombuffer(done.stdout, np.float32)
    ref = w.astype(np.float64) @ a.astype(np.float64)
    assert got.shape == (n,) and float(np.abs(got - ref).max()) < 1e-4 * max(1.0, float(np.abs(ref).max()))
