"""The register-tiled K-quant GEMMs with Q8_K activation rows (schedules/cpu/kquant_gemm.py: prompts under
`--activations q8_0`, batched decode, speculative verification) against an oracle nobody here wrote:
random weights encoded to K-quant blocks (tests/support/quant_gguf.py, as gguf-py has no K-quant
encoder) and dequantized by gguf-py (`gguf.quants.dequantize`), times the activation rows put
through llama.cpp's Q8_K quantizer (quantize_row_q8_K_ref in numpy, tests/support/hf_oracle.py)
and dequantized; up to float32 summation order. Each row must also equal the decode GEMV of that
row (schedules/cpu/kquant_gemv.py) bit for bit: prompts, verification and decode share numerics.

Row counts 1, 5, 7, 33: below, at and past a pass of rows, and not multiples of it. Each ISA
runs where this CPU can execute it and is skipped, saying why, elsewhere.

And a tiny Q4_K_M-mix model (Q4_K q|k, gate|up, o; Q6_K v, down and output) built with
`--activations q8_0`: its prompt logits against transformers with the same Q8_K activations,
its greedy tokens against transformers' with those activations (and its first against
`--activations none`'s). The real Q4_K_M files are checked by hand (docs/BENCHMARKS.md).
"""
from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import tvm
from hf_oracle import q8_k_blocks
from quant_gguf import quantize
from vtool.models.int8_activations import Q8_K_FORMATS
from vtool.runtime.weights import quant_blocks
from vtool.schedules.cpu import kquant_gemm, kquant_gemv
from vtool.schedules.cpu.int8_gemv import Int8GemvKernels
from vtool.targets.host import host_cpu_features

Q = gguf.GGMLQuantizationType
MCPU = {"avx512vnni": "cascadelake", "avx2": "haswell"}
NEEDS = {"avx512vnni": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "avx2": {"avx2", "fma", "f16c"}}
N, K = 8, 512  # two tiles, two super-blocks
ROW_COUNTS = (1, 5, 7, 33)


def _runnable(isa: str) -> None:
    missing = NEEDS[isa] - set(host_cpu_features())
    if missing:
        pytest.skip(f"this CPU cannot execute {isa} code (missing {', '.join(sorted(missing))})")


def _compile(func: tvm.tirx.PrimFunc, isa: str):
    target = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": MCPU[isa]})
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]


@functools.lru_cache(maxsize=None)
def _gemm(fmt: str, isa: str, n: int, k: int, rows: int | None = None, panel_bytes: int = kquant_gemm.PANEL_BYTES):
    return _compile(kquant_gemm.gemm_func(fmt, isa, n, k, (1, tvm.tirx.Var("m", "int64")), rows, panel_bytes), isa)


@functools.lru_cache(maxsize=None)
def _gemv(fmt: str, isa: str, n: int, k: int):
    return _compile(kquant_gemv.gemv_func(fmt, isa, n, k, 2), isa)


@functools.lru_cache(maxsize=None)
def _weights(fmt: str, n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 0.2, (n, 1))).astype(np.float32)
    w[:, :32] += 0.3  # a sub-block with a large positive offset: the min terms matter
    raw = quantize(w, getattr(Q, fmt))
    parts = quant_blocks.repack(fmt, raw, k)
    return raw, [tvm.runtime.tensor(parts[p]) for p in quant_blocks.FORMATS[fmt].parts]


def _oracle(fmt: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x [m, k] -> [m, n]: Q8_K(x) dequantized times gguf-py's dequantized weights, in float64."""
    w = gguf.quants.dequantize(raw, getattr(Q, fmt)).astype(np.float64)
    d, q = q8_k_blocks(x)
    xq = (d[..., None].astype(np.float64) * q.reshape(*d.shape, -1)).reshape(x.shape)
    return (xq @ w.T).astype(np.float32)


def _inputs(k: int, m: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
    x += rng.uniform(-1, 1, (m, 1)).astype(np.float32)  # rows with a mean: the activation sums matter
    if m > 2:
        x[1, :256] = 0  # an all-zero super-block: d_x = 0 must not divide by zero
        x[2, k - 7] = -40.0  # a negative largest value: iscale > 0 there
    return x


def _run(fn, parts: list, x: np.ndarray, n: int) -> np.ndarray:
    y = tvm.runtime.tensor(np.full((1, x.shape[0], n), np.nan, np.float32))
    fn(tvm.runtime.tensor(x[None]), *parts, y)
    return y.numpy()[0]


def _gemv_rows(fmt: str, isa: str, parts: list, x: np.ndarray, n: int) -> np.ndarray:
    gemv = _gemv(fmt, isa, n, x.shape[1])
    out = []
    for row in x:
        y = tvm.runtime.tensor(np.full((1, 1, n), np.nan, np.float32))
        gemv(tvm.runtime.tensor(row.reshape(1, 1, -1)), *parts, y)
        out.append(y.numpy()[0, 0])
    return np.stack(out)


@pytest.mark.parametrize("m", ROW_COUNTS)
@pytest.mark.parametrize("isa", kquant_gemm.ISAS)
@pytest.mark.parametrize("fmt", kquant_gemm.FORMATS)
def test_gemm_equals_q8_k_activations_times_dequantized_weights(fmt, isa, m):
    _runnable(isa)
    raw, parts = _weights(fmt, N, K, seed=7)
    x = _inputs(K, m, seed=m)
    got, want = _run(_gemm(fmt, isa, N, K), parts, x, N), _oracle(fmt, raw, x)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(np.abs(want).max()))
    # and every row is the decode GEMV's, bit for bit
    np.testing.assert_array_equal(got, _gemv_rows(fmt, isa, parts, x, N))


@pytest.mark.parametrize("isa", kquant_gemm.ISAS)
@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_panels_and_pass_sizes(fmt, isa):
    """Passes of 8 rows with every remainder 1..7 (each its own unrolled code), and panels of 6
    rows (5 whole ones and a last of 3 for 33 rows) in passes of 4 (a pass of 2 ends each
    panel): all give the GEMV's rows."""
    _runnable(isa)
    n, k = 12, 256
    _, parts = _weights(fmt, n, k, seed=11)
    x = _inputs(k, 33, seed=12)
    want = _gemv_rows(fmt, isa, parts, x, n)
    np.testing.assert_array_equal(_run(_gemm(fmt, isa, n, k, 4, 6 * k), parts, x, n), want)
    for m in range(1, 17):
        np.testing.assert_array_equal(_run(_gemm(fmt, isa, n, k, kquant_gemm.MAX_ROWS), parts, x[:m], n), want[:m],
                                      err_msg=f"{m} rows")


def test_wiring_formats_and_refusals():
    """The toolchain's kernels (Int8GemvKernels) hand out this GEMM for several rows, the GEMV for one."""
    assert kquant_gemm.FORMATS == kquant_gemv.FORMATS == Q8_K_FORMATS
    kernels = Int8GemvKernels("avx2")
    m = tvm.tirx.Var("m0", "int64")
    tvm.ir.assert_structural_equal(kernels.matmul("Q4_K", 8, 512, (1, None)),
                                   kquant_gemm.gemm_func("Q4_K", "avx2", 8, 512, (1, m)), map_free_vars=True)
    tvm.ir.assert_structural_equal(kernels.matmul("Q6_K", 8, 512, (1, 1)),
                                   kquant_gemv.gemv_func("Q6_K", "avx2", 8, 512, 2))
    with pytest.raises(ValueError, match="k % 256"):
        kquant_gemm.gemm_func("Q4_K", "avx2", 8, 128, (1, m))
    with pytest.raises(ValueError, match="no Q8_K-activation GEMM"):
        kquant_gemm.gemm_func("Q4_1", "avx2", 8, 256, (1, m))
    with pytest.raises(ValueError, match="rows must be"):
        kquant_gemm.gemm_func("Q4_K", "avx2", 8, 256, (1, m), rows=9)


@pytest.mark.slow
def test_tiny_q4_k_m_model_with_q8_0_activations(tmp_path):
    """`--activations q8_0` on a Q4_K/Q6_K model: every prompt matmul goes through these GEMMs. Its
    prompt logits are transformers' with the same Q8_K activations in every Linear (no further than
    that oracle is from float32), and so are its greedy tokens."""
    import torch
    from hf_oracle import greedy, q8_k_activations
    from quant_gguf import K_SHAPE, write_tiny_gguf
    from vtool.models.int8_activations import isa_for_target
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.engine.generate import Generator
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.targets import buildable
    from vtool.toolchain.build import build_artifact
    import transformers

    if isa_for_target(tvm.target.Target(buildable("host").tvm)) is None:
        pytest.skip("this CPU has no integer-dot tier: --activations q8_0 is refused here")
    qtype_of = (lambda name: Q.Q6_K if ".attn_v." in name or ".ffn_down." in name or name == "output.weight"
                else Q.Q4_K)  # llama.cpp's Q4_K_M mix
    path = write_tiny_gguf(tmp_path / "m.gguf", qtype_of, tie=False, shape=K_SHAPE)
    prompt = [1, 17, 42, 99, 7, 3, 250, 11, 64, 5, 200, 31, 8, 120, 77, 19, 2, 240, 33, 90, 4, 150]  # 22 rows
    steps = 16
    ckpt = open_checkpoint(path)
    gens = {a: Generator(CompiledModel(build_artifact(path, "host", "float32", checkpoint=ckpt, quantization="gguf",
                                                      activations=a), ckpt), max_model_len=128)
            for a in ("q8_0", "none")}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        **({"quantization_config": transformers.GgufConfig(dequantize=True)}
           if hasattr(transformers, "GgufConfig") else {})).eval()
    plain, _, _ = greedy(model, prompt, 1)
    with q8_k_activations(model, rows="all"):  # every Linear is a kept K-quant here
        ref, ref_tokens, _ = greedy(model, prompt, steps)
    noise = float(np.abs(ref - plain).max())
    assert noise > 1e-4, "the Q8_K oracle changed nothing: the check would be weak"
    got = gens["q8_0"].prompt_logits(prompt)
    worst = float(np.abs(got - ref).max())
    assert worst < noise, f"prompt logits {worst} from the Q8_K oracle (it is {noise} from float32)"
    assert float(np.abs(got - gens["none"].prompt_logits(prompt)).max()) > 1e-4  # the prompt was quantized
    # greedy tokens: transformers' with the same activations (a random tiny model's logits are
    # nearly flat, so `--activations none` may part from them after a few tokens: its first agrees)
    params = SamplingParams(temperature=0, max_tokens=steps)
    tokens = {a: gen.generate(prompt, params).token_ids for a, gen in gens.items()}
    assert len(set(ref_tokens)) > 4, "degenerate greedy tokens: the check would be weak"
    assert tokens["q8_0"] == ref_tokens
    assert tokens["q8_0"][0] == tokens["none"][0]
