"""vtool's tensor-core prefill attention (toolchain/native/prefill_attention.cu), which bf16/f16
CUDA builds with TIR attention call in place of TVM's ragged and paged prefill kernels.

Here (CI, no GPU): the source compiles for sm_90a and exports both functions under the names the
TIR dispatchers call; the dispatchers replace exactly the kernels `fits` covers, keep TVM's own
beside them for RoPE inside attention, and leave soft-capped, float32 and other head dims alone;
the short-step path of schedules/cuda/short_prefill_attention.py still goes in front of the paged
one.

On the GPU: both kernels, bf16 and f16, head_dim 64 and 128, grouped and plain heads, causal or
not, sequences of 1 to 300 rows (tile edges at 64) with K/V contiguous or in shuffled 16-slot
pages (a sequence with no page included), against float64 attention over the same rounded inputs
in numpy: output within 2^-6 (bf16) / 2^-9 (f16) of max |V| (the kernel multiplies P in the
compute dtype, as FlashInfer does, and rounds the output to it) and lse (base 2) within 1e-3. Its library comes from the GPU-less build machine:
`python tests/test_gpu_prefill_attention.py prebuild OUT.so`, then
VTOOL_GPU_PREFILL_ATTENTION_LIB=OUT.so on the GPU machine.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_fixtures import NativeLibrary, native_library_path  # noqa: E402

LIB_ENV = "VTOOL_GPU_PREFILL_ATTENTION_LIB"
ARCHS, PTX = ("sm_90a",), "compute_90"
RAGGED, PAGED = "vtool_prefill_ragged", "vtool_prefill_paged"  # held equal to schedules/cuda/prefill_attention.py
PAGE = 16
EMPTY_LSE = -5e4  # TVM's value for a row that sees no key


def build_library(out: Path) -> Path:
    """The kernel's object linked on its own into a shared library (with libcudart)."""
    from vtool.toolchain import cuda, prefill_attention

    obj = prefill_attention.compile_object(ARCHS, PTX)
    subprocess.run(["g++", "-shared", "-o", str(out), str(obj), str(cuda.cuda_toolkit_library("cudart"))], check=True)
    return out


# -- the reference (numpy, float64 over the kernel's rounded inputs) -----------------------------

def reference(q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray], q_lens: list[int], causal: bool,
              sm_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Output [tokens, heads, d] and base-2 lse [tokens, heads] of TVM's contract: key col of a
    sequence visible to its row r when col < kv_len and (causal) col < kv_len - q_len + r + 1."""
    tokens, heads, d = q.shape
    out = np.zeros((tokens, heads, d))
    lse = np.full((tokens, heads), EMPTY_LSE)
    start = 0
    for k, v, q_len in zip(keys, values, q_lens):
        kv_len, kv_heads = k.shape[0], k.shape[1]
        group = heads // kv_heads
        for r in range(q_len):
            visible = min(kv_len, kv_len - q_len + r + 1) if causal else kv_len
            if visible <= 0:
                continue
            for h in range(heads):
                s = (k[:visible, h // group] @ q[start + r, h]) * sm_scale * math.log2(math.e)
                m = s.max()
                p = np.exp2(s - m)
                out[start + r, h] = p @ v[:visible, h // group] / p.sum()
                lse[start + r, h] = m + math.log2(p.sum())
        start += q_len
    return out, lse


def rounded(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:  # noqa: ANN001
    """Normal values rounded to dtype (bf16: float32 with the low 16 bits cleared), as float64."""
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    return (x.view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64)


# -- here: the build ------------------------------------------------------------------------------

def test_the_kernel_compiles_and_exports_both_functions_for_the_dispatchers(tmp_path) -> None:
    from gpu_fixtures import cuda_buildable

    cuda_buildable()
    from vtool.schedules.cuda.prefill_attention import NATIVE_PAGED, NATIVE_RAGGED

    assert (NATIVE_RAGGED, NATIVE_PAGED) == (RAGGED, PAGED)
    lib = build_library(tmp_path / "prefill.so")
    exported = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                              check=True).stdout.split()
    for name in (RAGGED, PAGED):
        assert name in exported and f"__tvm_ffi_{name}" in exported, name
    from vtool.toolchain.cuda import inspect_library

    info = inspect_library(lib)
    assert info["sass"] == list(ARCHS) and info["ptx"] == [PTX]


def _smollm2_module(dtype: str, **overrides):  # noqa: ANN202
    from vtool.models.config import parse_hf_config
    from vtool.targets import lookup
    from vtool.toolchain.build import model_module

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
              "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 2, "vocab_size": 512,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
              "tie_word_embeddings": True, "hidden_act": "silu", "model_type": "llama", **overrides}
    return model_module(parse_hf_config(config), lookup("sm_90a"), dtype, lambda _msg: None)[1]


def _symbols(mod) -> dict[str, str]:  # noqa: ANN001
    from tvm import tirx

    return {str(f.attrs["global_symbol"]): f.script() for _gv, f in mod.functions.items()
            if isinstance(f, tirx.PrimFunc) and f.attrs is not None and "global_symbol" in f.attrs}


def test_the_dispatchers_replace_tvms_prefill_kernels_and_keep_them_for_rope_inside_attention() -> None:
    pytest.importorskip("tvm")
    from vtool.schedules.cuda.short_prefill_attention import short_prefill_attention_pass
    from vtool.schedules.cuda.prefill_attention import replace_prefill_attention

    mod, replaced = replace_prefill_attention(_smollm2_module("bfloat16"))
    assert replaced == 2
    funcs = _symbols(mod)
    for symbol, native in (("batch_prefill_ragged_kv", RAGGED), ("batch_prefill_paged_kv", PAGED)):
        host = funcs[symbol]
        assert "blockIdx" not in host and f'T.call_cpacked("{native}"' in host
        assert f'T.call_cpacked("{symbol}_tvm"' in host and "rotary_mode == 0" in host
        assert "blockIdx" in funcs[f"{symbol}_tvm"]  # TVM's kernel, kept for rotary_mode 1
    assert "vtool_prefill" not in funcs["batch_prefill_paged_kv_sliding_window"]
    # the short-step path still goes in front of the paged kernel, now the dispatcher

    funcs = _symbols(short_prefill_attention_pass()(mod))
    assert 'T.call_cpacked("vtool_prefill_paged_kv_short"' in funcs["batch_prefill_paged_kv"]
    assert f'T.call_cpacked("{PAGED}"' in funcs["vtool_prefill_paged_kv_tiled"]


@pytest.mark.parametrize("dtype, overrides", [("float32", {}), ("bfloat16", {"hidden_size": 288}),
                                              ("bfloat16", {"hidden_size": 2304})])
def test_float32_and_head_dims_without_a_kernel_keep_tvms(dtype: str, overrides: dict) -> None:
    pytest.importorskip("tvm")
    from vtool.schedules.cuda.prefill_attention import replace_prefill_attention

    # head_dim 32 (288 / 9) and 256 (2304 / 9): no instantiation
    mod, replaced = replace_prefill_attention(_smollm2_module(dtype, **overrides))
    assert replaced == 0 and "batch_prefill_ragged_kv_tvm" not in _symbols(mod)


def test_fits_only_what_the_kernel_instantiates() -> None:
    pytest.importorskip("tvm")
    from vtool.schedules.cuda.prefill_attention import fits

    assert fits(64, "bfloat16") and fits(128, "float16")
    assert not fits(128, "float32") and not fits(96, "bfloat16") and not fits(256, "bfloat16")
    assert not fits(128, "bfloat16", page_size=32) and not fits(128, "bfloat16", softcap=50.0)


# -- on the GPU ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernels():
    return _Kernels(native_library_path(LIB_ENV, "test_gpu_prefill_attention.py"))


class _Kernels(NativeLibrary):
    """The library, with its two functions."""

    def __init__(self, lib: str):
        super().__init__(lib)
        self.ragged, self.paged = self.module[RAGGED], self.module[PAGED]


def _gpu(x: np.ndarray, dtype: str):  # noqa: ANN202
    import torch

    return torch.from_numpy(x.astype(np.float32)).to(getattr(torch, dtype)).cuda().contiguous()


def _int32(x: list[int]):  # noqa: ANN202
    import torch

    return torch.tensor(x, dtype=torch.int32, device="cuda")


def _check(out, lse, ref_out: np.ndarray, ref_lse: np.ndarray, v_max: float, dtype: str, what: str) -> None:  # noqa: ANN001
    got = out.float().cpu().numpy().astype(np.float64)
    got_lse = lse.cpu().numpy().astype(np.float64)
    # P and the output are rounded to the compute dtype (2^-8 relative for bf16, 2^-11 for f16): four such roundings
    bound = (2.0 ** -6 if dtype == "bfloat16" else 2.0 ** -9) * v_max
    err = np.abs(got - ref_out).max()
    assert err <= bound, f"{what}: output off by {err:.3g} (bound {bound:.3g})"
    lse_err = np.abs(got_lse - ref_lse).max()
    assert lse_err <= 1e-3, f"{what}: lse off by {lse_err:.3g}"


CASES = [  # (head_dim, qo_heads, kv_heads, q_lens, causal)
    (64, 9, 3, [1, 17, 64, 65, 130, 300], True),
    (128, 8, 2, [5, 64, 200], True),
    (128, 4, 4, [33, 129], False),
    (64, 6, 2, [300], False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_ragged_prefill_equals_attention(kernels, dtype: str, case: int) -> None:
    import torch

    d, heads, kv_heads, q_lens, causal = CASES[case]
    rng = np.random.default_rng(case)
    tokens = sum(q_lens)
    q = rounded(rng, (tokens, heads, d), dtype)
    k, v = rounded(rng, (tokens, kv_heads, d), dtype), rounded(rng, (tokens, kv_heads, d), dtype)
    indptr = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    sm_scale = 1 / math.sqrt(d)
    out = torch.full((tokens, heads, d), float("nan"), dtype=getattr(torch, dtype), device="cuda")
    lse = torch.full((tokens, heads), float("nan"), device="cuda")
    kernels.ragged(kernels.tensor(_gpu(q, dtype), dtype), kernels.tensor(_int32(indptr), "int32"),
                   kernels.tensor(_gpu(k, dtype), dtype), kernels.tensor(_gpu(v, dtype), dtype),
                   kernels.tensor(_int32(indptr), "int32"), kernels.tensor(out, dtype), kernels.tensor(lse, "float32"),
                   int(causal), sm_scale)
    torch.cuda.synchronize()
    keys = [k[a:b] for a, b in zip(indptr, indptr[1:])]
    values = [v[a:b] for a, b in zip(indptr, indptr[1:])]
    ref_out, ref_lse = reference(q, keys, values, q_lens, causal, sm_scale)
    _check(out, lse, ref_out, ref_lse, np.abs(v).max(), dtype, f"ragged {CASES[case]} {dtype}")


PAGED_CASES = [  # (head_dim, qo_heads, kv_heads, [(q_len, kv_len)], causal)
    (64, 9, 3, [(1, 17), (64, 64), (3, 0), (128, 200), (1, 300)], False),
    (128, 8, 2, [(16, 16), (65, 130), (1, 1)], True),
    (128, 32, 8, [(1, 250), (1, 31), (130, 130)], False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", range(len(PAGED_CASES)))
def test_paged_prefill_equals_attention(kernels, dtype: str, case: int) -> None:
    import torch

    d, heads, kv_heads, seqs, causal = PAGED_CASES[case]
    rng = np.random.default_rng(100 + case)
    q_lens = [q for q, _ in seqs]
    tokens = sum(q_lens)
    pages_per_seq = [-(-kv // PAGE) for _, kv in seqs]
    num_pages = sum(pages_per_seq) + 3  # some pages belong to nobody
    pages = rounded(rng, (num_pages, 2, kv_heads, PAGE, d), dtype)
    order = rng.permutation(num_pages).tolist()  # each sequence's pages scattered over the pool
    page_indptr, page_values, last_len = [0], [], []
    for (_, kv_len), n in zip(seqs, pages_per_seq):
        page_values += [order.pop() for _ in range(n)]
        page_indptr.append(len(page_values))
        last_len.append(kv_len - (n - 1) * PAGE if n else 0)

    def gathered(kind: int) -> list[np.ndarray]:  # a sequence's keys (0) or values (1): [kv_len, kv_heads, d]
        return [np.concatenate([pages[p, kind].transpose(1, 0, 2) for p in page_values[a:b]])[:kv] if b > a
                else np.zeros((0, kv_heads, d)) for a, b, (_, kv) in zip(page_indptr, page_indptr[1:], seqs)]

    keys, values = gathered(0), gathered(1)
    q = rounded(rng, (tokens, heads, d), dtype)
    q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    sm_scale = 1 / math.sqrt(d)
    out = torch.full((tokens, heads, d), float("nan"), dtype=getattr(torch, dtype), device="cuda")
    lse = torch.full((tokens, heads), float("nan"), device="cuda")
    kernels.paged(kernels.tensor(_gpu(q, dtype), dtype), kernels.tensor(_int32(q_indptr), "int32"),
                  kernels.tensor(_gpu(pages, dtype), dtype), kernels.tensor(_int32(page_indptr), "int32"),
                  kernels.tensor(_int32(page_values or [0]), "int32"), kernels.tensor(_int32(last_len), "int32"),
                  kernels.tensor(out, dtype), kernels.tensor(lse, "float32"), int(causal), sm_scale)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference(q, keys, values, q_lens, causal, sm_scale)
    _check(out, lse, ref_out, ref_lse, np.abs(pages).max(), dtype, f"paged {PAGED_CASES[case]} {dtype}")


@pytest.mark.gpu
def test_the_kernel_refuses_what_it_has_no_instantiation_for(kernels) -> None:
    import torch

    q = torch.zeros(4, 2, 96, dtype=torch.bfloat16, device="cuda")
    out, lse = torch.zeros_like(q), torch.zeros(4, 2, device="cuda")
    indptr = _int32([0, 4])
    with pytest.raises(Exception, match="vtool_prefill_ragged: head_dim 96"):
        kernels.ragged(kernels.tensor(q, "bfloat16"), kernels.tensor(indptr, "int32"), kernels.tensor(q, "bfloat16"),
                       kernels.tensor(q, "bfloat16"), kernels.tensor(indptr, "int32"), kernels.tensor(out, "bfloat16"),
                       kernels.tensor(lse, "float32"), 1, 0.1)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "prebuild":
        print(json.dumps({"library": str(build_library(Path(sys.argv[2])))}))
    else:
        raise SystemExit(__doc__)
