"""CUDA builds on a machine without a GPU: every CUDA row of the target table, and a
multi-arch target, produce a library that embeds an nvcc fatbin with SASS for exactly
the requested archs (plus the newest one's PTX) and no CUDA source.

The SM list is read back out of the .so by this file's own reader: it finds every
fatbin, walks its entries, and for each SASS entry checks the cubin's ELF header
(EM_CUDA, and the SM number in e_flags) against the fatbin entry header. If
`cuobjdump` is on PATH it must agree too.

The builds run a few at a time (two on two cores; each is a subprocess) and reuse the
build cache, so a second run takes seconds (cold: about 2.5 minutes on 2 cores). These
tests need nvcc and skip (loudly) without it.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tiny_models import make_tiny_model
from vtool.targets import ROWS, TargetError, buildable, lookup
from vtool.toolchain.build import build_artifact, cache_key
from vtool.toolchain.cuda import CudaBuildError, find_nvcc, gencode_flags

try:
    NVCC, NVCC_MISSING = find_nvcc(), ""
except CudaBuildError as err:
    NVCC, NVCC_MISSING = None, str(err)

_nvcc_here = pytest.mark.skipif(NVCC is None, reason=f"!!! CUDA BUILDS ARE NOT TESTED HERE: {NVCC_MISSING} !!!")


def needs_nvcc(test):  # and slow: a CUDA build is 20-60 s of nvcc and TVM per target on 2 cores
    return pytest.mark.slow(_nvcc_here(test))

CUDA_ROWS = [row.name for row in ROWS if row.family == "cuda"]
MULTI = "sm_90a,sm_80"  # given out of order on purpose: the target sorts it
# (target, dtype) -> what the module fixture builds.
BUILDS = [(name, "float32") for name in CUDA_ROWS] + [(MULTI, "float32"), ("sm_90a", "bfloat16"),
                                                      ("sm_80", "float16")]


# ---------------------------------------------------------------------------------------
# An independent reader of the GPU code in a library


def read_gpu_code(path: Path) -> dict:
    """{"sass": [...], "ptx": [...], "fatbins": [bytes], "cuda_source": bool} from the bytes
    of a built .so."""
    data = path.read_bytes()
    sass, ptx, fatbins = [], [], []
    magic = struct.pack("<I", 0xBA55ED50)
    pos = data.find(magic)
    while pos != -1:
        _, _, header, size = struct.unpack_from("<IHHQ", data, pos)
        end = pos + header + size
        if end > len(data):
            pos = data.find(magic, pos + 4)
            continue
        fatbins.append(data[pos:end])
        entry = pos + header
        while entry < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            sm = struct.unpack_from("<I", data, entry + 28)[0]
            flags = struct.unpack_from("<I", data, entry + 40)[0]
            suffix = "a" if flags & 0x100000 else ("f" if flags & 0x200000 else "")
            body = data[entry + entry_header:entry + entry_header + payload]
            if kind == 2:
                assert body[:4] == b"\x7fELF", "a SASS entry that is not an uncompressed cubin"
                e_machine = struct.unpack_from("<H", body, 18)[0]
                e_flags = struct.unpack_from("<I", body, 48)[0]
                assert e_machine == 190, f"cubin e_machine {e_machine}, expected EM_CUDA (190)"
                assert (e_flags >> 8) & 0xFF == sm, f"cubin e_flags {e_flags:#x} disagrees with sm_{sm}"
                sass.append(f"sm_{sm}{suffix}")
            elif kind == 1:
                ptx.append(f"compute_{sm}{suffix}")
            entry += entry_header + payload
        pos = data.find(magic, end)
    source = any(marker in data for marker in (b"__global__", b"extern \"C\" __device__", b"#include <cuda"))
    return {"sass": sass, "ptx": ptx, "fatbins": fatbins, "cuda_source": source}


def tvm_module_formats(path: Path) -> list[str]:
    """fmt of each serialized TVM CUDA module ("cuda" would be source, JIT-compiled at load)."""
    data = path.read_bytes()
    out, key = [], b"\x04\x00\x00\x00\x00\x00\x00\x00cuda"
    pos = data.find(key)
    while pos != -1:
        p = pos + len(key)
        _blob, n = struct.unpack_from("<QQ", data, p)
        if 0 < n < 16:
            out.append(data[p + 16:p + 16 + n].decode())
        pos = data.find(key, p)
    return out


# ---------------------------------------------------------------------------------------
# The builds


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_shape_dir) -> Path:  # tests/conftest.py; read only
    return tiny_shape_dir("qwen3-qknorm")


@pytest.fixture(scope="module")
def cuda_builds(tiny_qwen3) -> dict:
    """Every build in BUILDS, two at a time; a failure is kept and raised by its test."""
    def one(job):
        target, dtype = job
        try:
            return build_artifact(tiny_qwen3, target, dtype)
        except Exception as err:  # noqa: BLE001 - re-raised by the test that reads it
            return err

    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        return dict(zip(BUILDS, pool.map(one, BUILDS)))


def _artifact(cuda_builds, target: str, dtype: str) -> Path:
    result = cuda_builds[(target, dtype)]
    if isinstance(result, Exception):
        raise result
    return result


def _cuobjdump_listing(fatbin: bytes, tmp_path: Path) -> tuple[list[str], list[str]]:
    """(SASS archs, PTX archs) as cuobjdump lists them for one extracted fatbin."""
    path = tmp_path / "extracted.fatbin"
    path.write_bytes(fatbin)
    out = subprocess.run(["cuobjdump", "-lelf", "-lptx", str(path)], capture_output=True, text=True).stdout
    names = [line.split(":", 1)[1].strip().rsplit(".", 2) for line in out.splitlines() if ":" in line]
    elf = [n[-2] for n in names if n[-1] == "cubin"]
    ptx = [n[-2] for n in names if n[-1] == "ptx"]
    return elf, ptx


def _check(folder: Path, archs: list[str], ptx: str, tmp_path: Path) -> dict:
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "model.so"]  # no stub, no source
    lib = folder / "model.so"
    code = read_gpu_code(lib)
    assert code["sass"] == archs
    assert code["ptx"] == [ptx]
    assert not code["cuda_source"], "CUDA source is embedded in the library"
    assert tvm_module_formats(lib) == ["cubin"]
    assert len(code["fatbins"]) == 1
    if shutil.which("cuobjdump"):  # the toolkit's reader, where installed (it cannot read the .so itself)
        elf, ptx_listed = _cuobjdump_listing(code["fatbins"][0], tmp_path)
        assert sorted(elf) == sorted(archs)
        assert ptx_listed == [ptx.replace("compute_", "sm_")]  # cuobjdump names PTX by its sm
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["target"]["family"] == "cuda"
    assert manifest["target"]["archs"] == archs
    assert manifest["target"]["ptx"] == ptx
    cuda = manifest["build"]["cuda"]
    assert cuda["nvcc"][0] == "nvcc" and "--fatbin" in cuda["nvcc"] and "-O3" in cuda["nvcc"]
    assert cuda["embedded"] == {"module_formats": ["cubin"], "sass": archs, "ptx": [ptx]}
    assert manifest["build"]["pipeline"]["cuda_graph"] is True
    # decode in two calls beside decode (models/decoder.py; the runtime's chained one-sequence steps)
    assert {"decode", "decode_hidden", "decode_logits"} <= set(manifest["entry_points"])
    passes = manifest["build"]["pipeline"]["passes"]
    expected = ["VtoolSplitKVDecodeAttention", "VtoolShortPrefillAttention", "VtoolBlockMmaEpilogues",
                "VtoolBlockMmaNorms"] + (
        ["VtoolOffloadGemmToCublas"] if manifest["gemm"] == "cublas" else [])
    assert passes[:len(expected) + 1] == expected + ["FuseTransposeMatmul"]
    # a split-KV decode kernel (two kernels under TVM's symbol, the merge one named "_1")
    # replaces TVM's where the grouped kernel's layout takes the shapes or the lanes can split
    # the head, and TVM's (one kernel) stays elsewhere
    from vtool.schedules.cuda.grouped_decode_attention import layout

    config = manifest["config"]
    splits = config["head_dim"] % 32 == 0
    replaced = splits or layout(config["num_key_value_heads"], config["num_attention_heads"], config["head_dim"],
                                manifest["dtype"]) is not None
    library = (folder / "model.so").read_bytes()
    assert (b"batch_decode_paged_kv_kernel_1" in library) == replaced
    # and so does the short-step kernel in front of TVM's paged prefill attention
    assert (b"vtool_prefill_paged_kv_short" in library) == splits
    return manifest


def exported_symbols(path: Path) -> set[str]:
    """The dynamic symbols a library defines, read with nm when it is installed, else the
    symbol name's bytes (a weaker check: present, not necessarily exported)."""
    if shutil.which("nm"):
        out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True).stdout
        return {line.split()[-1] for line in out.splitlines() if line.strip()}
    data = path.read_bytes()
    return {name for name in ("__tvm_ffi_vtool_cublas_gemm_nt",) if name.encode() in data}


@needs_nvcc
@pytest.mark.parametrize("row", CUDA_ROWS)
def test_every_cuda_row_builds_a_fatbin_for_its_arch(cuda_builds, row, tmp_path):
    spec = lookup(row)
    manifest = _check(_artifact(cuda_builds, row, "float32"), [row], spec.ptx, tmp_path)
    assert manifest["target"]["name"] == row
    assert manifest["target"]["features"] == list(spec.features)
    assert manifest["build"]["cuda"]["codegen_process"].startswith(("subprocess", "in-process"))


@needs_nvcc
def test_multi_arch_target_is_one_library_with_sass_for_each(cuda_builds, tmp_path):
    manifest = _check(_artifact(cuda_builds, MULTI, "float32"), ["sm_80", "sm_90a"], "compute_90", tmp_path)
    assert manifest["target"]["name"] == "sm_80,sm_90a"
    # kernels are generated for the oldest arch and may use only what both have
    assert manifest["target"]["tvm"]["arch"] == "sm_80"
    assert "wgmma" not in manifest["target"]["features"] and "cp.async" in manifest["target"]["features"]
    nvcc = manifest["build"]["cuda"]["nvcc"]
    assert "arch=compute_80,code=sm_80" in nvcc and "arch=compute_90,code=[sm_90a,compute_90]" in nvcc


@needs_nvcc
@pytest.mark.parametrize("target,dtype", [("sm_90a", "bfloat16"), ("sm_80", "float16")])
def test_half_precision_builds(cuda_builds, target, dtype, tmp_path):
    folder = _artifact(cuda_builds, target, dtype)
    manifest = _check(folder, [target], lookup(target).ptx, tmp_path)
    assert manifest["dtype"] == dtype
    # half precision defaults to cuBLAS for the many-row matmuls: the wrapper is linked in
    # and exported under the name the Relax VM looks up among the library's functions
    assert manifest["gemm"] == "cublas" and manifest["build"]["pipeline"]["gemm"] == "cublas"
    assert "__tvm_ffi_vtool_cublas_gemm_nt" in exported_symbols(folder / "model.so")


@needs_nvcc
def test_float32_builds_keep_their_own_matmuls(cuda_builds):
    folder = _artifact(cuda_builds, "sm_90a", "float32")
    assert json.loads((folder / "manifest.json").read_text())["gemm"] == "tir"
    assert "__tvm_ffi_vtool_cublas_gemm_nt" not in exported_symbols(folder / "model.so")


@needs_nvcc
def test_cache_key_follows_the_arch_list(tiny_qwen3):
    raw = json.loads((tiny_qwen3 / "config.json").read_text())
    key = lambda name: cache_key(raw, buildable(name), "float32", "none")  # noqa: E731
    assert key("sm_80,sm_90a") == key("sm_90a,sm_80") == key("sm_80,sm_90,sm_80")
    assert len({key("sm_80"), key("sm_90a"), key("sm_80,sm_90a"), key("sm_80,sm_86")}) == 4


def test_gencode_groups_each_arch_with_its_portable_virtual_arch():
    assert gencode_flags(("sm_90a",), "compute_90") == ["-gencode", "arch=compute_90,code=[sm_90a,compute_90]"]
    assert gencode_flags(("sm_80", "sm_86", "sm_120a"), "compute_120") == [
        "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_86,code=sm_86",
        "-gencode", "arch=compute_120,code=[sm_120a,compute_120]"]


def test_cuda_target_names():
    assert lookup("sm_90").name == "sm_90a"
    assert lookup("sm_110").name == lookup("sm_101").name == "sm_110a"  # Thor: CUDA 13 renamed sm_101
    multi = lookup("sm_121a, sm_86 ,sm_120")
    assert multi.name == "sm_86,sm_120a,sm_121a" and multi.archs == ("sm_86", "sm_120a", "sm_121a")
    assert multi.ptx == "compute_121" and multi.family == "cuda"
    assert lookup("sm_90a,sm_90").name == "sm_90a"  # one arch after aliases: the plain row
    with pytest.raises(TargetError, match="a multi-arch target combines CUDA rows only; 'x86-avx2' is a x86 target"):
        lookup("sm_80,x86-avx2")
    with pytest.raises(TargetError, match="unknown target 'sm_75'"):
        lookup("sm_80,sm_75")
    with pytest.raises(TargetError, match="'rocm' cannot be built yet"):
        buildable("rocm")


def test_attention_shapes_tvm_cannot_launch_on_cuda_are_refused_by_name(tmp_path):
    """head_dim 16 with one query head per KV head: TVM's decode kernel would ask for 128
    threads in z; the build refuses it instead of shipping a library that fails at launch."""
    import safetensors.numpy as st

    from vtool import VtoolError
    from vtool.toolchain.build import build_artifact

    folder = make_tiny_model("qwen3-untied", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["head_dim"] = 16
    (folder / "config.json").write_text(json.dumps(config))
    tensors = st.load_file(folder / "model.safetensors")
    tensors = {k: (v[: v.shape[0] // 2] if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) else
                   v[:, : v.shape[1] // 2] if k.endswith("o_proj.weight") else
                   v[:16] if k.endswith(("q_norm.weight", "k_norm.weight")) else v) for k, v in tensors.items()}
    st.save_file(tensors, folder / "model.safetensors")
    with pytest.raises(VtoolError, match="head_dim=16 with 1 query head.*not supported on CUDA.*128 threads in z"):
        build_artifact(folder, "sm_90a")
    build_artifact(folder, "host")  # the CPU kernels have no such limit


@pytest.mark.parametrize("shape, head_dim", [("qwen2-window", 12), ("mixtral-experts", 20)])
def test_prefill_tilings_tvm_cannot_generate_are_refused_by_name(shape, head_dim, tmp_path, monkeypatch):
    """float32 with head_dim 12 or 20: TVM's prefill-attention generator finds no legal tiling
    and raised deep inside the module build (seen on both tiny shapes); the plan refuses it by
    name first, while bfloat16 (another tiling) and the CPU build of the same model plan."""
    from vtool import VtoolError
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.toolchain.plan import BuildOptions, resolve_plan

    ckpt = open_checkpoint(make_tiny_model(shape, tmp_path / "m"))
    with pytest.raises(VtoolError, match=f"head_dim={head_dim} in float32 is not supported on CUDA: TVM's "
                                         "prefill-attention kernel has no legal tiling.*build in bfloat16"):
        resolve_plan(ckpt, "sm_90a", BuildOptions(dtype="float32"), tools=False)
    assert resolve_plan(ckpt, "sm_90a", BuildOptions(dtype="bfloat16"), tools=False).dtype == "bfloat16"
    assert resolve_plan(ckpt, "host", BuildOptions(dtype="float32"), tools=False).dtype == "float32"


@needs_nvcc
def test_a_splittable_head_gets_the_split_kv_decode_and_the_sampler(tmp_path_factory):
    """qwen2-bias has head_dim 32: its library carries the split-KV decode kernels (and the
    GPU sampling functions every CUDA library has)."""
    model = make_tiny_model("qwen2-bias", tmp_path_factory.mktemp("qwen2"))
    folder = build_artifact(model, "sm_90a", "bfloat16")
    manifest = _check(folder, ["sm_90a"], lookup("sm_90a").ptx, tmp_path_factory.mktemp("chk"))
    assert manifest["config"]["head_dim"] == 32
    data = (folder / "model.so").read_bytes()
    assert b"batch_decode_paged_kv_kernel_1" in data
    assert manifest["build"]["sampler"] == ["sample_argmax", "sample_temperature", "sample_top_p_top_k",
                                            "apply_token_bitmask", "token_logprob", "sample_argmax_masked",
                                            "apply_logit_edits"]
    for name in manifest["build"]["sampler"]:
        assert name.encode() in data


@needs_nvcc
def test_an_all_window_model_gets_the_freeing_cache_on_cuda(tiny_shape_dir, tmp_path):
    """A Mistral windowed on every layer builds for CUDA with the cache that frees what its
    window passed (models/window_cache.py): the entry point, its kernels under their own names,
    and a manifest that says they are TVM's GPU kernels, which the runtime uses only when asked
    (slower than the per-layer cache's; the device run: tests/test_gpu_parity.py)."""
    from vtool.models.window_cache import ENTRY, FREEING_SUFFIX

    folder = build_artifact(tiny_shape_dir("mistral-window"), "sm_90a", "float32")
    manifest = _check(folder, ["sm_90a"], lookup("sm_90a").ptx, tmp_path)
    assert ENTRY in manifest["entry_points"] and "create_tir_paged_kv_cache" in manifest["entry_points"]
    assert manifest["window_freeing_kernels"] == "tvm-gpu"
    data = (folder / "model.so").read_bytes()
    for kernel in ("batch_prefill_ragged_kv", "batch_prefill_paged_kv_sliding_window",
                   "batch_decode_paged_kv_sliding_window"):
        assert f"{kernel}{FREEING_SUFFIX}".encode() in data, kernel
