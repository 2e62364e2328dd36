"""The tensor-core matmul over GGUF blocks (toolchain/native/block_mma.cu) that bf16/f16 CUDA
builds call for batch_decode's matmuls over Q4_0, Q4_1, Q4_K, Q6_K and Q8_0 weights.

Here (CI, no GPU): the source compiles for the build's arch list and the library exports one
function per format; a bf16 CUDA build of a GGUF file records which formats take it, a float32
one none (its parity stays with the GEMV).

On the GPU: each format's kernel, for bf16 and f16 x, for row counts on both sides of every
launch shape (1..64 rows a launch, more in several), weights whose rows are not a multiple of a
warp's 16 and whose 32-weight blocks are not a multiple of a warp step's 4, against numpy: x
times the weight as the kernel forms it in x's dtype from the same blocks (Q8_0, Q6_K: the float32
dequantization, within one rounding of gguf-py's, rounded to x's dtype; Q4_0, Q4_1, Q4_K: d and c
rounded to x's dtype, then q d + c rounded once), summed in float64. The bound is float32
summation: 2e-6 of sum |x| |w|.
One row of x takes the SIMT GEMV instead, which multiplies the float32 weight unrounded (as the
model's generated GEMV does): its reference is the float32 dequantization.

Its library comes from the GPU-less build machine: `python tests/test_gpu_block_mma.py prebuild
OUT.so`, then VTOOL_GPU_BLOCK_MMA_LIB=OUT.so on the GPU machine. `python tests/test_gpu_block_mma.py
bench OUT.so` times the 8B shape's Q4_1 matrices (tests/bench in spirit; one JSON line a case).
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_fixtures import NativeLibrary, native_library_path  # noqa: E402

LIB_ENV = "VTOOL_GPU_BLOCK_MMA_LIB"
ARCHS, PTX = ("sm_90a",), "compute_90"
FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K")
# (rows n, cols k): n not a multiple of 16, k/32 blocks not a multiple of 4 (K-quants: k % 256)
SHAPES = {"Q4_0": [(52, 96), (64, 4096)], "Q4_1": [(52, 96), (64, 4096)], "Q8_0": [(52, 96), (36, 160)],
          "Q4_K": [(52, 256), (68, 768)], "Q6_K": [(52, 256), (68, 768)]}
ROWS = (1, 3, 8, 9, 16, 17, 32, 33, 64, 65, 130)
# the functions that finish the result in x's dtype (native/block_mma.cu's Epilogue)
EPILOGUES = ("_cast", "_cast_add", "_silu_mul")
# an RMSNorm shared by two one-row GEMVs: the residual add writing its statistics, the readers
NORM_PAIR = ("_cast_add_norm_stats", "_prenormed", "_prenormed_cast", "_prenormed_silu_mul")
# (n, k) for them: n / 2 a multiple of 4 (SiLU x up's halves), k / 32 blocks not a multiple of 4
EPILOGUE_SHAPES = {"Q4_0": (72, 160), "Q4_1": (72, 160), "Q8_0": (72, 160), "Q4_K": (72, 768), "Q6_K": (72, 768)}
SPLITS = (1, 2, 5)


def symbol(fmt: str) -> str:
    """models/quantized_linear.block_mma_symbol (held equal here; the GPU machine has no compiler)."""
    return f"vtool_block_mma_{fmt.lower()}"


def build_library(out: Path) -> Path:
    """The kernel's object linked on its own into a shared library (with libcudart)."""
    from vtool.toolchain import block_mma, cuda

    obj = block_mma.compile_object(ARCHS, PTX)
    subprocess.run(["g++", "-shared", "-o", str(out), str(obj), str(cuda.cuda_toolkit_library("cudart"))], check=True)
    return out


# -- the blocks and their dequantization (numpy) ---------------------------------------------

def random_parts(fmt: str, n: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Random parts of a [n, k] weight in ggml_blocks' layout, in ggml_blocks.parts order."""
    tiles, kb = n // 4, k // 32
    scale = lambda *shape: rng.uniform(0.002, 0.05, shape).astype(np.float16)  # noqa: E731
    if fmt == "Q8_0":
        return [rng.integers(-128, 128, (tiles, kb, 4, 32), dtype=np.int8), scale(tiles, kb, 4)]
    q = rng.integers(0, 256, (tiles, kb, 4, 16), dtype=np.uint8)
    if fmt == "Q6_K":  # low nibbles, high 2 bits per 64, d per 256, signed sc per 16
        return [q, rng.integers(0, 256, (tiles, k // 64, 4, 16), dtype=np.uint8), scale(tiles, k // 256, 4),
                rng.integers(-128, 128, (tiles, k // 16, 4), dtype=np.int8)]
    if fmt == "Q4_0":
        return [q, scale(tiles, kb, 4)]
    if fmt == "Q4_1":
        return [q, scale(tiles, kb, 4), (-scale(tiles, kb, 4) * 8).astype(np.float16)]
    sb = k // 256  # Q4_K: d, dmin per 256, 6-bit sc and m per 32
    return [q, scale(tiles, sb, 4), scale(tiles, sb, 4), rng.integers(0, 64, (tiles, kb, 4), dtype=np.uint8),
            rng.integers(0, 64, (tiles, kb, 4), dtype=np.uint8)]


def dequantize(fmt: str, parts: list[np.ndarray]) -> np.ndarray:
    """The [n, k] float32 weight, as gguf-py computes it (one rounding, in float32)."""
    q = parts[0]
    tiles, kb = q.shape[:2]
    if fmt == "Q8_0":
        quants = q.astype(np.float32)
    else:
        quants = np.concatenate([q & 15, q >> 4], axis=-1).astype(np.float32)  # byte j: elements j, j + 16
    f32 = lambda a: a.astype(np.float32)[..., None]  # noqa: E731
    if fmt == "Q6_K":
        w = q6k_quants(parts[0], parts[1]) - np.float32(32)
        d = np.repeat(parts[2], 8, axis=1).astype(np.float32)[..., None]  # per 256 -> per 32-block
        sc = parts[3].astype(np.float32).reshape(tiles, kb, 2, 4).transpose(0, 1, 3, 2)  # per 16 -> [.., row, half]
        w = w * (d * np.repeat(sc, 16, axis=-1))
        return w.astype(np.float32).transpose(0, 2, 1, 3).reshape(tiles * 4, kb * 32)
    if fmt in ("Q8_0", "Q4_0"):
        w = (quants - (8 if fmt == "Q4_0" else 0)) * f32(parts[1])
    elif fmt == "Q4_1":
        w = quants * f32(parts[1]) + f32(parts[2])
    else:
        d = np.repeat(parts[1], 8, axis=1).astype(np.float32) * parts[3].astype(np.float32)
        m = np.repeat(parts[2], 8, axis=1).astype(np.float32) * parts[4].astype(np.float32)
        w = quants * d[..., None] - m[..., None]
    # [tile, block, row, 32] -> [tile * 4 + row, block * 32 + e]
    return w.astype(np.float32).transpose(0, 2, 1, 3).reshape(tiles * 4, kb * 32)


def q6k_quants(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Q6_K's 6-bit quants [tile, block, row, 32] from the low nibbles (Q4_0's order) and the high
    2 bits (byte j of 64 weights holds element 16k + j at bits 2k)."""
    tiles, kb = low.shape[:2]
    nib = np.concatenate([low & 15, low >> 4], axis=-1)  # [t, b, r, 32]
    hb = high.reshape(tiles, kb // 2, 1, 4, 16)
    two = np.concatenate([(hb >> (2 * k)) & 3 for k in range(4)], axis=2)  # [t, group, k, r, 16]: element 16k + j
    two = two.transpose(0, 1, 3, 2, 4).reshape(tiles, kb // 2, 4, 64)  # [t, group, r, 64]
    two = two.reshape(tiles, kb // 2, 4, 2, 32).transpose(0, 1, 3, 2, 4).reshape(tiles, kb, 4, 32)
    return (nib | (two << 4)).astype(np.float32)


# bits of T's significand (its unit roundoff is 2^-bits)
SIGNIFICAND_BITS = {"bfloat16": 8, "float16": 11}


def round_to(values: np.ndarray, xdtype: str) -> np.ndarray:
    """float64 values rounded once, to nearest even, to x's dtype (returned in float64): numpy
    rounds float64 to float16 directly; bf16 keeps the top 8 bits of the significand (no bf16
    value here is subnormal or past its range)."""
    if xdtype == "float16":
        return values.astype(np.float16).astype(np.float64)
    mant, exp = np.frexp(values)  # values = mant 2^exp, 1/2 <= |mant| < 1
    return np.ldexp(np.rint(np.ldexp(mant, 8)), exp - 8)


def nibble_scales(fmt: str, parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A nibble format's d and c per (tile, block, row) as the kernel forms them in float32 before
    rounding to T (exact: Q4_K's d = dd sc and c = -(dmin m) are 11-bit by 6-bit products)."""
    if fmt == "Q4_K":
        d = np.repeat(parts[1], 8, axis=1).astype(np.float32) * parts[3].astype(np.float32)
        c = -(np.repeat(parts[2], 8, axis=1).astype(np.float32) * parts[4].astype(np.float32))
        return d, c
    d = parts[1].astype(np.float32)
    return d, parts[2].astype(np.float32) if fmt == "Q4_1" else np.zeros_like(d)


def as_matrix(blocks: np.ndarray) -> np.ndarray:
    """[tile, block, row, 32] -> [tile * 4 + row, block * 32 + e]."""
    tiles, kb = blocks.shape[:2]
    return blocks.transpose(0, 2, 1, 3).reshape(tiles * 4, kb * 32)


def kernel_weights(fmt: str, parts: list[np.ndarray], xdtype: str) -> np.ndarray:
    """The [n, k] weight (float64) as the mma kernel forms it in x's dtype T. Q8_0 and Q6_K: the
    float32 dequantization rounded to T. The nibble formats (NibblePair): the block's d and c
    rounded to T, then q d + c (q - 8 for Q4_0) rounded once to T; every product and sum here is
    exact in float64 (a 4-bit q times an 8- or 11-bit d, plus c)."""
    if fmt in ("Q8_0", "Q6_K"):  # Q6_K's f * 64D - 96D is exact: (q - 32) D rounded once
        return round_to(dequantize(fmt, parts).astype(np.float64), xdtype)
    q = parts[0]
    quants = np.concatenate([q & 15, q >> 4], axis=-1).astype(np.float64)  # byte j: elements j, j + 16
    if fmt == "Q4_0":
        quants -= 8
    d, c = nibble_scales(fmt, parts)
    d_t, c_t = round_to(d.astype(np.float64), xdtype), round_to(c.astype(np.float64), xdtype)
    return as_matrix(round_to(quants * d_t[..., None] + c_t[..., None], xdtype))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("xdtype", ["bfloat16", "float16"])
def test_the_kernels_weights_are_the_dequantization_within_its_roundings(fmt: str, xdtype: str) -> None:
    """What the mma multiplies is the float32 dequantization w but for roundings to T (unit
    roundoff u): Q8_0 and Q6_K one, of w; the nibble formats d's and c's, then q d + c's:
    |error| <= u (|q d| + |c|) + u |w| (+ float32's rounding of w), and none where the format's
    numbers fit T (Q4_0 and Q4_1 in f16: d and c are f16, q d + c rounded once, as the float32
    dequantization rounded to f16 is)."""
    parts = random_parts(fmt, 8, 256, np.random.default_rng(3))
    exact, kernel = dequantize(fmt, parts).astype(np.float64), kernel_weights(fmt, parts, xdtype)
    u = 2.0 ** -SIGNIFICAND_BITS[xdtype]
    bound = u * np.abs(exact)
    if fmt not in ("Q8_0", "Q6_K"):
        c = np.abs(as_matrix(np.repeat(nibble_scales(fmt, parts)[1].astype(np.float64)[..., None], 32, axis=-1)))
        bound += u * (np.abs(exact) + 2 * c)  # |q d| <= |w| + |c|
    err = np.abs(kernel - exact)
    assert (err <= bound + 2.0 ** -23 * np.abs(exact)).all(), \
        f"{fmt} {xdtype}: {(err / (bound + 1e-30)).max():.3g} of the bound"
    if xdtype == "float16" and fmt in ("Q4_0", "Q4_1"):
        assert np.array_equal(kernel, round_to(exact, xdtype)), f"{fmt}: f16 weights not the rounded dequantization"
    assert not np.array_equal(kernel, exact), "T held every weight: the check would not see a wrong rounding"


def test_dequantize_reference_matches_gguf_py() -> None:
    """The test's own dequantization against gguf-py's on the same blocks in GGUF's order."""
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(0)
    for fmt in ("Q4_0", "Q4_1", "Q8_0"):
        parts = random_parts(fmt, 4, 64, rng)
        q, d = parts[0][0], parts[1][0]  # tile 0: [block, row, ...]
        raw = bytearray()
        for row in range(4):
            for b in range(2):
                raw += d[b, row].tobytes()
                if fmt == "Q4_1":
                    raw += parts[2][0][b, row].tobytes()
                raw += q[b, row].tobytes()
        kind = getattr(GGMLQuantizationType, fmt)
        ref = gguf_quants.dequantize(np.frombuffer(bytes(raw), np.uint8).reshape(4, -1), kind)
        np.testing.assert_array_equal(dequantize(fmt, parts), ref)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_k_quant_reference_matches_gguf_py(fmt: str) -> None:
    """The K-quants' reference against gguf-py's dequantization of the same GGUF blocks, put in
    the kernel's layout by the runtime's own repacker (runtime/weights/quant_blocks.py)."""
    gguf = pytest.importorskip("gguf")
    from vtool.runtime.weights.ggml_blocks import parts as part_names
    from vtool.runtime.weights.quant_blocks import repack

    sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
    from shape_gguf import blocks  # valid random K-quant blocks (moderate scales)

    kind = getattr(gguf.GGMLQuantizationType, fmt)
    raw = blocks(np.random.default_rng(5), 8, 512, kind)
    ref = gguf.quants.dequantize(raw, kind).reshape(8, 512)
    got = repack(fmt, raw, 512)
    np.testing.assert_array_equal(dequantize(fmt, [got[name] for name in part_names(fmt)]), ref)


# -- here: the build ------------------------------------------------------------------------------

def test_the_kernel_compiles_and_exports_a_function_per_format(tmp_path) -> None:
    from gpu_fixtures import cuda_buildable

    cuda_buildable()
    from vtool.models.quantized_linear import block_mma_symbol
    from vtool.toolchain.block_mma import BLOCK_MMA_FORMATS

    assert BLOCK_MMA_FORMATS == FORMATS
    lib = build_library(tmp_path / "block_mma.so")
    exported = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                              check=True).stdout
    for fmt in FORMATS:
        assert symbol(fmt) == block_mma_symbol(fmt)
        for suffix in ("", *EPILOGUES):  # toolchain/block_mma_epilogues.py calls these
            assert f"__tvm_ffi_{symbol(fmt)}{suffix}" in exported, (fmt, suffix)
    from vtool.toolchain.cuda import inspect_library

    info = inspect_library(lib)
    assert info["sass"] == list(ARCHS) and info["ptx"] == [PTX]


HOST_GEMV_SOURCE = Path(__file__).resolve().parent / "support" / "block_gemv_host.cu"
FMT_INDEX = {"Q4_0": 0, "Q4_1": 1, "Q4_K": 2, "Q8_0": 3, "Q6_K": 4}  # native/block_mma.cu's Fmt


@pytest.fixture(scope="module")
def host_gemv(tmp_path_factory):
    """The one-row GEMV's per-block functions built for the host (tests/support/block_gemv_host.cu)."""
    import ctypes

    from gpu_fixtures import cuda_buildable

    cuda_buildable()
    from vtool.toolchain.cuda import find_nvcc

    out = tmp_path_factory.mktemp("host_gemv") / "block_gemv_host.so"
    # no kernel is instantiated without the FFI half, so the device pass has nothing to compile
    subprocess.run([find_nvcc(), "-shared", "-O2", "-std=c++17", "-Xcompiler", "-fPIC", "-arch=sm_90a",
                    str(HOST_GEMV_SOURCE), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.vtool_block_gemv_host.restype = ctypes.c_int
    return lib


def host_gemv_rows(lib, fmt: str, parts: list[np.ndarray], x: np.ndarray, x_bf16: bool) -> np.ndarray:  # noqa: ANN001
    """out[n] of the host build for x (raw 16-bit values) and the parts in ggml_blocks.parts order."""
    import ctypes

    named = dict(zip({"Q4_0": ("qweight", "scale"), "Q4_1": ("qweight", "scale", "min"), "Q8_0": ("qweight", "scale"),
                      "Q4_K": ("qweight", "scale", "min", "sub_scale", "sub_min"),
                      "Q6_K": ("qweight", "qhigh", "scale", "sub_scale")}[fmt], parts))
    keep = {name: np.ascontiguousarray(a) for name, a in named.items()}
    ptr = lambda name: keep[name].ctypes.data_as(ctypes.c_void_p) if name in keep else None  # noqa: E731
    n, k = parts[0].shape[0] * 4, parts[0].shape[1] * 32
    out = np.full(n, np.nan, np.float32)
    xs = np.ascontiguousarray(x)
    rc = lib.vtool_block_gemv_host(FMT_INDEX[fmt], int(x_bf16), xs.ctypes.data_as(ctypes.c_void_p), ptr("qweight"),
                                   ptr("scale"), ptr("min"), ptr("sub_scale"), ptr("qhigh"), ptr("sub_min"), n, k,
                                   out.ctypes.data_as(ctypes.c_void_p))
    assert rc == 0
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("xdtype", ["bfloat16", "float16"])
def test_the_one_row_gemv_reads_each_format_as_gguf_py_dequantizes_it(host_gemv, fmt: str, xdtype: str) -> None:
    """The GEMV's loads, x's floats and row sums (the kernel's own functions, built for the host)
    against x times the float32 dequantization (held to gguf-py's above), float32 summation's
    bound; several row tiles and blocks, so a layout index off by a tile, block or row shows."""
    import torch

    rng = np.random.default_rng(21 + FORMATS.index(fmt))
    for n, k in [*SHAPES[fmt], (8, 512)]:
        parts = random_parts(fmt, n, k, rng)
        x = torch.from_numpy(rng.standard_normal(k).astype(np.float32)).to(getattr(torch, xdtype))
        raw = x.view(torch.int16).numpy()
        w = dequantize(fmt, parts).astype(np.float64)
        xd = x.double().numpy()
        got = host_gemv_rows(host_gemv, fmt, parts, raw, xdtype == "bfloat16")
        err = (np.abs(got - w @ xd) / (np.abs(w) @ np.abs(xd) + 1e-30)).max()
        assert err <= 2e-6, f"{fmt} {xdtype} [{n}, {k}]: {err:.2e} of sum |x||w|"


@pytest.mark.parametrize("dtype, expected", [("bfloat16", ["Q4_1", "Q8_0"]), ("float32", None)])
def test_a_cuda_build_records_the_formats_batch_decode_multiplies_on_tensor_cores(tmp_path, dtype, expected):
    from gpu_fixtures import cuda_buildable

    cuda_buildable()
    from test_gpu_quantized import _build

    _path, artifact = _build("q4_1", dtype, tmp_path / "q4_1")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantized_weights"].get("batched_decode_mma") == expected
    exported = subprocess.run(["nm", "-D", "--defined-only", str(artifact / "model.so")], capture_output=True,
                              text=True, check=True).stdout
    assert ("vtool_block_mma_q4_1" in exported) == (expected is not None)


# -- on the GPU ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernels():
    return _Kernels(native_library_path(LIB_ENV, "test_gpu_block_mma.py"))


class _Kernels(NativeLibrary):
    """The library, with one function per format."""

    def __init__(self, lib: str):
        super().__init__(lib)
        self.funcs = {fmt: self.module[symbol(fmt)] for fmt in FORMATS}

    @functools.cached_property
    def finishing(self) -> dict:
        """The epilogue functions, looked up when a test first asks (a library built before
        them still runs the other tests)."""
        return {(fmt, e): self.module[symbol(fmt) + e] for fmt in FORMATS for e in EPILOGUES}

    @functools.cached_property
    def norm_pair(self) -> dict:
        return {(fmt, e): self.module[symbol(fmt) + e] for fmt in FORMATS for e in NORM_PAIR}

    def prenormed_args(self, fmt: str, x, stats, eps: float, parts, partial, out, xdtype: str) -> list:  # noqa: ANN001
        """The *_prenormed* functions' arguments: x (h * w), the statistics, epsilon, then as args'."""
        plain = self.args(fmt, x, parts, partial, out, xdtype)
        return [plain[0], self.tensor(stats, "float32"), eps, *plain[1:]]

    def args(self, fmt: str, x, parts, partial, out, xdtype: str, residual=None) -> list:  # noqa: ANN001
        import torch

        names = {torch.uint8: "uint8", torch.int8: "int8", torch.float16: "float16"}
        floats = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
        extra = [] if residual is None else [self.tensor(residual, xdtype)]
        return [self.tensor(x, xdtype), *[self.tensor(p, names[p.dtype]) for p in parts], *extra,
                self.tensor(partial, "float32"), self.tensor(out, floats[out.dtype])]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("xdtype", ["bfloat16", "float16"])
def test_kernel_equals_the_dequantized_matmul(kernels, fmt: str, xdtype: str) -> None:
    import torch

    tdtype = getattr(torch, xdtype)
    rng = np.random.default_rng(FORMATS.index(fmt))
    for n, k in SHAPES[fmt]:
        parts = random_parts(fmt, n, k, rng)
        w_mma = torch.from_numpy(kernel_weights(fmt, parts, xdtype))  # what the mma multiplies (float64)
        w_gemv = torch.from_numpy(dequantize(fmt, parts)).double()  # what the one-row GEMV multiplies
        gparts = [torch.from_numpy(p).cuda() for p in parts]
        for m in ROWS:
            w = w_gemv if m == 1 else w_mma  # one row: the SIMT GEMV, float32 weights unrounded
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(tdtype).cuda()
            xd = x.double().cpu()
            ref = xd @ w.T
            scale = xd.abs() @ w.abs().T
            for splits in SPLITS:  # more splits than k has steps leave some parts empty: zeros
                partial = torch.full((splits, m, n), float("nan"), device="cuda")
                out = torch.full((m, n), float("nan"), device="cuda")
                kernels.funcs[fmt](*kernels.args(fmt, x, gparts, partial, out, xdtype))
                torch.cuda.synchronize()
                err = ((out.double().cpu() - ref).abs() / (scale + 1e-30)).max().item()
                assert err <= 2e-6, f"{fmt} {xdtype} [{n}, {k}] x {m} rows, {splits} splits: {err:.2e} of sum |x||w|"


@pytest.mark.gpu
def test_kernel_refuses_parts_that_do_not_fit(kernels) -> None:
    import torch

    rng = np.random.default_rng(1)
    parts = [torch.from_numpy(p).cuda() for p in random_parts("Q4_1", 8, 64, rng)]
    x = torch.zeros(2, 96, dtype=torch.bfloat16, device="cuda")  # k 96 against blocks of k 64
    out = torch.zeros(2, 8, device="cuda")
    with pytest.raises(Exception, match="vtool_block_mma_q4_1: qweight"):
        kernels.funcs["Q4_1"](*kernels.args("Q4_1", x, parts, out[None], out, "bfloat16"))


def _ulp(xdtype: str) -> float:
    """The largest spacing of bf16 / f16 values relative to a value."""
    return 2.0 ** (-7 if xdtype == "bfloat16" else -10)


def _x_residual_and_sums(kernels, fmt: str, gparts, rng, m: int, n: int, k: int,  # noqa: ANN001, ANN202
                         splits: int, xdtype: str):
    """Random x [m, k] and residual [m, n] in x's dtype, and the plain function's float32 x W^T."""
    import torch

    tdtype = getattr(torch, xdtype)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(tdtype).cuda()
    residual = torch.from_numpy(rng.standard_normal((m, n)).astype(np.float32)).to(tdtype).cuda()
    plain = torch.empty((m, n), device="cuda")
    kernels.funcs[fmt](*kernels.args(fmt, x, gparts, torch.empty((splits, m, n), device="cuda"), plain, xdtype))
    return x, residual, plain


def _close_in_ulps(got, want, ulps: float, xdtype: str) -> float:  # noqa: ANN001 - torch tensors
    """How far past `ulps` units in the last place `got` is from `want` (<= 0: within), where
    `want` is finite; where it is not (f16's range overflows in SiLU x up: the kernel and torch
    both give inf), `got` must be the same value."""
    import torch

    finite = torch.isfinite(want)
    g, w = got[~finite].double(), want[~finite].double()
    assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g[~g.isnan()], w[~w.isnan()]), "non-finite values differ"
    err = (got[finite].double() - want[finite].double()).abs() - ulps * _ulp(xdtype) * want[finite].double().abs()
    return err.max().item() if err.numel() else 0.0


def _silu_mul_past(gated, plain, xdtype: str) -> float:  # noqa: ANN001 - torch tensors
    """How far past 2 ulp SiLU x up of the float result `plain` (gate and up halves of its columns,
    each rounded to x's dtype, as TVM's silu lowers) the function's `gated` is."""
    import torch

    tdtype = getattr(torch, xdtype)
    half = plain.shape[-1] // 2
    gate, up = plain[:, :half].to(tdtype), plain[:, half:].to(tdtype)
    one, zero = torch.ones((), dtype=tdtype, device="cuda"), torch.zeros((), dtype=tdtype, device="cuda")
    return _close_in_ulps(gated, gate * (one / (one + torch.exp(zero - gate))) * up, 2, xdtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("xdtype", ["bfloat16", "float16"])
def test_epilogues_finish_the_float_result_as_torch_does(kernels, fmt: str, xdtype: str) -> None:
    """The *_cast, *_cast_add and *_silu_mul functions against the plain function's float32
    result finished by torch in x's dtype: the cast and the residual add bit for bit (one rounding
    each, as TVM's kernels for astype and add); SiLU(gate) x up within two units in the last
    place (torch computes exp and the division in float32 and rounds; cuda_fp16's hexp and the
    half division are approximations, which TVM's f16 kernels use too)."""
    import torch

    tdtype = getattr(torch, xdtype)
    rng = np.random.default_rng(11 + FORMATS.index(fmt))
    n, k = EPILOGUE_SHAPES[fmt]
    gparts = [torch.from_numpy(p).cuda() for p in random_parts(fmt, n, k, rng)]
    for m in (1, 9, 33, 65):
        for splits in (1, 3):
            x, residual, plain = _x_residual_and_sums(kernels, fmt, gparts, rng, m, n, k, splits, xdtype)
            cast = torch.full((m, n), float("nan"), dtype=tdtype, device="cuda")
            added = torch.full((m, n), float("nan"), dtype=tdtype, device="cuda")
            gated = torch.full((m, n // 2), float("nan"), dtype=tdtype, device="cuda")
            partial = lambda: torch.full((splits, m, n), float("nan"), device="cuda")  # noqa: E731
            kernels.finishing[fmt, "_cast"](*kernels.args(fmt, x, gparts, partial(), cast, xdtype))
            kernels.finishing[fmt, "_cast_add"](*kernels.args(fmt, x, gparts, partial(), added, xdtype, residual))
            kernels.finishing[fmt, "_silu_mul"](*kernels.args(fmt, x, gparts, partial(), gated, xdtype))
            torch.cuda.synchronize()
            where = f"{fmt} {xdtype} {m} rows, {splits} splits"
            assert torch.equal(cast, plain.to(tdtype)), where
            assert torch.equal(added, residual + plain.to(tdtype)), where
            past = _silu_mul_past(gated, plain, xdtype)
            assert past <= 1e-6, f"{where}: SiLU x up off by {past:.3g} past 2 ulp"


def _q4_1_parts_on_the_gpu(seed: int) -> list:
    """Random Q4_1 parts of a [72, 160] weight on the GPU, for the refusal tests."""
    import torch

    return [torch.from_numpy(p).cuda() for p in random_parts("Q4_1", 72, 160, np.random.default_rng(seed))]


@pytest.mark.gpu
def test_epilogues_refuse_outputs_that_do_not_fit(kernels) -> None:
    import torch

    parts = _q4_1_parts_on_the_gpu(2)
    x = torch.zeros(2, 160, dtype=torch.bfloat16, device="cuda")
    partial = torch.zeros(1, 2, 72, device="cuda")
    wide = torch.zeros(2, 72, dtype=torch.bfloat16, device="cuda")  # SiLU x up gives 36 columns
    with pytest.raises(Exception, match="vtool_block_mma_q4_1_silu_mul: out has 72 columns"):
        kernels.finishing["Q4_1", "_silu_mul"](*kernels.args("Q4_1", x, parts, partial, wide, "bfloat16"))
    f16 = torch.zeros(2, 72, dtype=torch.float16, device="cuda")
    with pytest.raises(Exception, match="vtool_block_mma_q4_1_cast: out must have x's dtype"):
        kernels.finishing["Q4_1", "_cast"](*kernels.args("Q4_1", x, parts, partial, f16, "bfloat16"))
    short = torch.zeros(1, 72, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(Exception, match="vtool_block_mma_q4_1_cast_add: the residual must have out's shape"):
        kernels.finishing["Q4_1", "_cast_add"](*kernels.args("Q4_1", x, parts, partial, wide, "bfloat16", short))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("xdtype", ["bfloat16", "float16"])
def test_the_residual_add_writes_the_next_norms_statistics(kernels, fmt: str, xdtype: str) -> None:
    """*_cast_add_norm_stats (decode's o and down projections before a norm): out equals
    *_cast_add's bit for bit, normed is out * w rounded once to x's dtype, and stats[t] the sum of
    rows 4t..4t+3 of out^2 in float32, paired as (0 + 1) + (2 + 3)."""
    import torch

    tdtype = getattr(torch, xdtype)
    rng = np.random.default_rng(61 + FORMATS.index(fmt))
    n, k = EPILOGUE_SHAPES[fmt]
    gparts = [torch.from_numpy(p).cuda() for p in random_parts(fmt, n, k, rng)]
    x, residual, _plain = _x_residual_and_sums(kernels, fmt, gparts, rng, 1, n, k, 1, xdtype)
    weight = torch.from_numpy(rng.uniform(0.2, 2.0, n).astype(np.float32)).to(tdtype).cuda()
    added = torch.full((1, n), float("nan"), dtype=tdtype, device="cuda")
    out, normed = added.clone(), added.clone()
    stats = torch.full((n // 4,), float("nan"), device="cuda")
    partial = lambda: torch.full((1, 1, n), float("nan"), device="cuda")  # noqa: E731
    kernels.finishing[fmt, "_cast_add"](*kernels.args(fmt, x, gparts, partial(), added, xdtype, residual))
    args = kernels.args(fmt, x, gparts, partial(), out, xdtype, residual)
    kernels.norm_pair[fmt, "_cast_add_norm_stats"](*args[:-2], kernels.tensor(weight, xdtype), *args[-2:],
                                                   kernels.tensor(normed, xdtype), kernels.tensor(stats, "float32"))
    torch.cuda.synchronize()
    where = f"{fmt} {xdtype}"
    assert torch.equal(out, added), where
    assert torch.equal(normed, (out.float() * weight.float()).to(tdtype)), where
    sq = (out.float() ** 2).reshape(-1, 4)
    assert torch.equal(stats, (sq[:, 0] + sq[:, 1]) + (sq[:, 2] + sq[:, 3])), where


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("xdtype", ["bfloat16", "float16"])
def test_the_prenormed_functions_scale_by_the_norm(kernels, fmt: str, xdtype: str) -> None:
    """*_prenormed (decode's q|k|v, gate|up and lm_head after a norm): x is h * w, stats the
    producer's block sums of h^2; against (W x) / sqrt(sum(stats) / k + eps) in float64 (float32
    summation's bound plus rsqrtf's); the cast bit for bit of that float result, SiLU x up within 2
    ulp of it, as the plain epilogues."""
    import torch

    tdtype = getattr(torch, xdtype)
    rng = np.random.default_rng(71 + FORMATS.index(fmt))
    eps = 1e-5
    for n, k in [EPILOGUE_SHAPES[fmt], *SHAPES[fmt]]:
        parts = random_parts(fmt, n, k, rng)
        gparts = [torch.from_numpy(p).cuda() for p in parts]
        w = torch.from_numpy(dequantize(fmt, parts)).double()
        x = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32)).to(tdtype).cuda()
        stats = torch.from_numpy((49.0 * rng.chisquare(4, k // 4)).astype(np.float32)).cuda()  # h ~ 7 N(0, 1)
        scale = 1.0 / np.sqrt(stats.double().sum().item() / k + eps)
        xd = x.double().cpu()
        want, bound = scale * (xd @ w.T), scale * (xd.abs() @ w.abs().T)
        partial = lambda: torch.full((1, 1, n), float("nan"), device="cuda")  # noqa: E731
        plain = torch.full((1, n), float("nan"), device="cuda")
        cast = torch.full((1, n), float("nan"), dtype=tdtype, device="cuda")
        gated = torch.full((1, n // 2), float("nan"), dtype=tdtype, device="cuda")
        kernels.norm_pair[fmt, "_prenormed"](*kernels.prenormed_args(fmt, x, stats, eps, gparts, partial(), plain,
                                                                      xdtype))
        kernels.norm_pair[fmt, "_prenormed_cast"](*kernels.prenormed_args(fmt, x, stats, eps, gparts, partial(), cast,
                                                                           xdtype))
        if n % 8 == 0:  # SiLU x up's halves: a multiple of 4 columns each
            kernels.norm_pair[fmt, "_prenormed_silu_mul"](*kernels.prenormed_args(fmt, x, stats, eps, gparts,
                                                                                   partial(), gated, xdtype))
        torch.cuda.synchronize()
        where = f"{fmt} {xdtype} [{n}, {k}]"
        err = ((plain.double().cpu() - want).abs() / (bound + 1e-30)).max().item()
        assert err <= 4e-6, f"{where}: {err:.2e} of sum |x||W|"
        assert torch.equal(cast, plain.to(tdtype)), where
        if n % 8 == 0:
            past = _silu_mul_past(gated, plain, xdtype)
            assert past <= 1e-6, f"{where}: SiLU x up off by {past:.3g} past 2 ulp"


@pytest.mark.gpu
def test_the_norm_pair_refuses_what_it_cannot_share(kernels) -> None:
    import torch

    parts = _q4_1_parts_on_the_gpu(4)
    two = torch.zeros(2, 160, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(Exception, match="vtool_block_mma_q4_1_prenormed_cast: an RMSNorm is shared between one-row "
                                        "GEMVs, not 2 rows"):
        kernels.norm_pair["Q4_1", "_prenormed_cast"](*kernels.prenormed_args(
            "Q4_1", two, torch.ones(40, device="cuda"), 1e-5, parts, torch.zeros(1, 2, 72, device="cuda"),
            torch.zeros(2, 72, dtype=torch.bfloat16, device="cuda"), "bfloat16"))
    one = torch.zeros(1, 160, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(Exception, match="vtool_block_mma_q4_1_prenormed: the norm's stats must be a contiguous "
                                        "float32 CUDA vector of k / 4 = 40"):
        kernels.norm_pair["Q4_1", "_prenormed"](*kernels.prenormed_args(
            "Q4_1", one, torch.ones(39, device="cuda"), 1e-5, parts, torch.zeros(1, 1, 72, device="cuda"),
            torch.zeros(1, 72, device="cuda"), "bfloat16"))
    residual = torch.zeros(1, 72, dtype=torch.bfloat16, device="cuda")
    args = kernels.args("Q4_1", one, parts, torch.zeros(1, 1, 72, device="cuda"), residual.clone(), "bfloat16",
                        residual)
    with pytest.raises(Exception, match="vtool_block_mma_q4_1_cast_add_norm_stats: stats must be a contiguous "
                                        "float32 CUDA vector of n / 4 = 18"):
        kernels.norm_pair["Q4_1", "_cast_add_norm_stats"](
            *args[:-2], kernels.tensor(torch.ones(72, dtype=torch.bfloat16, device="cuda"), "bfloat16"), *args[-2:],
            kernels.tensor(residual.clone(), "bfloat16"), kernels.tensor(torch.zeros(72, device="cuda"), "float32"))


# -- the 8B shape's matrices, timed -------------------------------------------------------------

BENCH = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
         ("lm_head", 128256, 4096)]


def block_mma_splits(rows: int, cols: int, min_blocks: int = 528) -> int:
    """models/quantized_linear.block_mma_splits (held equal here; the GPU machine has no compiler)."""
    row_blocks = -(-rows // 128)
    return max(1, min(-(-cols // 128), -(-min_blocks // row_blocks)))


def test_split_rule_is_the_models() -> None:
    pytest.importorskip("tvm", reason="models/ needs the compiler")
    from vtool.models import quantized_linear

    for n, k in [*[(n, k) for _name, n, k in BENCH], (52, 96), (128, 256), (4, 32)]:
        assert block_mma_splits(n, k) == quantized_linear.block_mma_splits(n, k)


def bench(lib: str, fmt: str = "Q4_1", min_blocks: str = "528") -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
    from gpu_fp8_gemm import _time as timed  # CUDA events over repeated calls

    kern = _Kernels(lib)
    rng = np.random.default_rng(0)
    for name, n, k in BENCH:
        parts = [torch.from_numpy(p).cuda() for p in random_parts(fmt, n, k, rng)]
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        splits = block_mma_splits(n, k, int(min_blocks))
        for m in (1, 8, 16, 32, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda")
            args = kern.args(fmt, x, parts, torch.empty(splits, m, n, device="cuda"), out, "bfloat16")
            us = timed(lambda: kern.funcs[fmt](*args))
            bf16_us = timed(lambda: x @ wb.T)
            print(json.dumps({"matrix": name, "format": fmt, "n": n, "k": k, "rows": m, "splits": splits,
                              "us": round(us, 2),
                              "GB/s": round(nbytes / us / 1e3, 1), "torch_bf16_us": round(bf16_us, 2)}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "prebuild":
        print(build_library(Path(sys.argv[2])))
    elif len(sys.argv) in (3, 4, 5) and sys.argv[1] == "bench":
        bench(sys.argv[2], *sys.argv[3:])
    else:
        sys.exit("usage: python tests/test_gpu_block_mma.py prebuild OUT.so | bench OUT.so [FORMAT [MIN_BLOCKS]]")
