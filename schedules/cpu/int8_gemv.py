"""Decode GEMVs over GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) with 8-bit activations and integer dots (x86).

The K-quants (Q4_K, Q5_K, Q6_K) have their own kernels with Q8_K activations: kquant_gemv.py (GEMVs)
and kquant_gemm.py (GEMMs, register-tiled over rows of x).

The float path (vtool_qmatmul, scheduled by vtool.schedules.cpu.quantized) widens every
quant to float32 before its multiply-add, so a batch-1 GEMV is bound by that conversion,
not by memory. Like llama.cpp, these kernels instead quantize the activation row once per
call to a GGML Q8_0 block row (d_x = max|x| / 127 kept as float16, q_x = round(x / d_x)),
and multiply
quants by quants in integer lanes, 4 byte products per 32-bit lane per instruction:

  avx512vnni  vpdpbusd zmm (u8 x s8, 64 bytes)   Ice Lake / Cascade Lake / Zen 4 and later
  avx2        vpmaddubsw + vpmaddwd (32 bytes)     any AVX2 CPU

One block's integer sum is scaled once by d_w * d_x into float32 accumulators. Q5_0's and
Q5_1's fifth bits are or-ed onto their nibbles first (kquant_gemv.fifth_bits). The offset terms
of Q4_0 (q - 8), Q5_0 (q - 16) and Q4_1/Q5_1 (+ m: the activation block's d * sum(q), what
llama.cpp's Q8_1 activation blocks carry), and the +128 bias that makes Q8_0's
signed activations usable as vpdpbusd's unsigned operand, are folded through per-block
sums of the quantized activation, computed with the quantization, so the inner loop
only touches the weights. Output rows go in tiles of TILE_ROWS (the weight layout of
vtool.runtime.weights.ggml_blocks: [tile, block, row in tile, bytes], one tile's block is one
contiguous run), tiles run in parallel.

The result differs from the float path by the activation rounding (as llama.cpp's
does); the parity tests bound it against transformers.
"""
from __future__ import annotations

import dataclasses
import functools

from tvm import tirx
from tvm.script import tirx as T

# The weight layout the kernels are compiled for: the contract module, shared with the runtime's repacker.
from vtool.runtime.weights.ggml_blocks import BLOCK, TILE_ROWS
from vtool.schedules.cpu import kquant_gemm, kquant_gemv
from vtool.schedules.cpu.kquant_gemv import FORMATS as KQUANT_FORMATS
from vtool.schedules.cpu.kquant_gemv import fifth_bits as _fifth_bits
from vtool.schedules.cpu.kquant_gemv import iq4_levels, signed_pairs

# = vtool.models.int8_activations.INT8_FORMATS (a test holds them equal)
FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")
ISAS = ("avx512vnni", "avx2")

_VNNI = "llvm.x86.avx512.vpdpbusd.512"
_MADDUBS = "llvm.x86.avx2.pmadd.ub.sw"
_MADDWD = "llvm.x86.avx2.pmadd.wd"
_PSIGN = "llvm.x86.avx2.psign.b"
_PHADD = "llvm.x86.avx2.phadd.d"


@dataclasses.dataclass(frozen=True)
class Int8GemvKernels:
    """The kernels of one ISA, as the toolchain hands them to a model (models/quantized_linear.py
    `use_int8_gemv`): the model asks for a kernel per quantized matmul and never imports this
    package."""

    isa: str
    formats: tuple[str, ...] = FORMATS + KQUANT_FORMATS  # the K-quants: Q8_K activations (kquant_gemv.py)

    def matmul(self, fmt: str, rows: int, cols: int, lead: tuple[int | None, ...]) -> tirx.PrimFunc:
        """The kernel for x of shape `lead` + [cols] (None: a symbolic dim) times a kept
        [rows, cols] weight of `fmt`: a GEMV when every lead dim is 1, else a GEMM."""
        if fmt in KQUANT_FORMATS:
            return _kquant_kernel(fmt, self.isa, rows, cols, lead)
        return _kernel(fmt, self.isa, rows, cols, lead)


@functools.lru_cache(maxsize=None)
def _kquant_kernel(fmt: str, isa: str, rows: int, cols: int, lead: tuple[int | None, ...]) -> tirx.PrimFunc:
    if all(d == 1 for d in lead):
        return kquant_gemv.gemv_func(fmt, isa, rows, cols, len(lead))
    dims = tuple(d if d is not None else tirx.Var(f"m{i}", "int64") for i, d in enumerate(lead))
    # several rows per pass over each weight tile, each row equal to the GEMV's bit for bit (kquant_gemm.py)
    return kquant_gemm.gemm_func(fmt, isa, rows, cols, dims)


@functools.lru_cache(maxsize=None)
def _kernel(fmt: str, isa: str, rows: int, cols: int, lead: tuple[int | None, ...]) -> tirx.PrimFunc:
    """Built once per shape: a model asks for the same few kernels in every layer and entry
    point (242 calls, 8 kernels on the default model), and parsing one takes ~0.15 s."""
    if all(d == 1 for d in lead):
        return gemv_func(fmt, isa, rows, cols, len(lead))
    dims = tuple(d if d is not None else tirx.Var(f"m{i}", "int64") for i, d in enumerate(lead))
    return gemm_func(fmt, isa, rows, cols, dims)


def gemv_func(fmt: str, isa: str, n: int, k: int, lead: int) -> tirx.PrimFunc:
    """x float32 [1]*lead + [k] times a quantized [n, k] weight -> float32 [1]*lead + [n].
    Parameters in the order of the quantized parts (qweight, scale[, min]) between x and y."""
    _check(fmt, isa, n, k)
    return _build(fmt, isa, n, k, lead)


MAX_CHUNK = 8  # rows of x per pass over a weight tile: the remainder passes are written out up to this
# 6 rows per pass: a speculative verify step of 1 + k <= 6 rows (k <= 5) is one pass, each
# weight block unpacked once for all of them. Measured on a 2-core Xeon (AVX-512 VNNI), one
# thread, [3072, 576] Q4_1: 5 rows 115 -> 99 us against 4 per pass (4 + 1); 9 rows 197 ->
# 182 us; 1 row unchanged. At 8 per pass the accumulators spill (AVX-512: every row count
# slower, 1 row +50%). On the AVX2 path, 6 is as fast as 4 or slightly faster.
DEFAULT_CHUNK = 6
# Software prefetch distance, in weight tiles (a tile's block: 64 bytes of Q4 quants, 128 of
# Q8_0). The tiles a thread runs are consecutive, so the next ones are what it reads next.
# Measured with 30 copies of each of the default model's weights in turn (DRAM-bound, as in
# the model), 2-core Xeon: 5-row GEMMs 19.1 -> 12.3 ms on AVX-512 VNNI, 44 -> 21 ms on AVX2;
# the 1-row GEMVs 11.2 -> 9.2 ms and 14.8 -> 10.7 ms.
PREFETCH_TILES = 2
# Rows of x per pass from which the AVX2 Q8_0 kernel regroups a tile's block in registers
# instead of folding each row's dots with vphaddd (_q8_tile_dot_avx2_regrouped).
REGROUP_ROWS = 2
# Bytes of quantized x rows per panel of the GEMM (rounded down to whole passes), as
# kquant_gemm.py's: a panel should stay in the L2 cache while every weight tile passes over it.
PANEL_BYTES = 1 << 20


def gemm_func(fmt: str, isa: str, n: int, k: int, lead: tuple, rows_per_chunk: int = DEFAULT_CHUNK,
              panel_bytes: int = PANEL_BYTES) -> tirx.PrimFunc:
    """As gemv_func for x of shape `lead` + [k] with symbolic dims (TIR vars) in `lead`:
    every row of x is quantized once, and each weight tile's blocks are loaded once per
    `rows_per_chunk` rows of x (prefill, batched decode, speculative verification); the
    last M % rows_per_chunk rows are one pass of exactly that many. Each row's arithmetic
    is the GEMV's, in the same order, so a row of the GEMM equals the GEMV of that row bit
    for bit (tests/test_int8_gemv.py holds it). Rows go in panels of about `panel_bytes` of
    quantized rows (whole passes): every tile passes over one panel before the next."""
    _check(fmt, isa, n, k)
    if not 1 <= rows_per_chunk <= MAX_CHUNK:
        raise ValueError(f"rows_per_chunk must be 1..{MAX_CHUNK}, got {rows_per_chunk}")
    return _build(fmt, isa, n, k, tuple(lead), rows_per_chunk, panel_bytes)


def _check(fmt: str, isa: str, n: int, k: int) -> None:
    if fmt not in FORMATS or isa not in ISAS:
        raise ValueError(f"no int8 GEMV for {fmt} on {isa}")
    if n % TILE_ROWS or k % BLOCK:
        raise ValueError(f"int8 GEMV needs n % {TILE_ROWS} == 0 and k % {BLOCK} == 0, got [{n}, {k}]")


# The quantized activation row as the kernels read it: 32 bytes per block (Q8_0 and IQ4_NL on
# avx512vnni: x + 128, vpdpbusd's unsigned side). A weight vector holds every row's 16 bytes of a
# block (Q4: low nibbles = weights 0..15, high = 16..31), so it meets x[0:16] and x[16:32] each
# repeated in every 128-bit lane: one broadcast load (vbroadcasti32x4 / vbroadcasti128) from
# this row, not a replicated copy (which took 4x the bytes: prompt rows fell out of the L2 cache).
# Measured with panels (PANEL_BYTES) and the +128 as the dot chain's start value, against the
# replicated copy, 512 rows, 2 threads of a 2-core Xeon (AVX-512 VNNI, AMX): [1536, 576] Q8_0
# 147 -> 187 GMAC/s, Q4_1 149 -> 181; [576, 1536] Q8_0 74 -> 181, Q5_0 72 -> 139; the AVX2 code
# [1536, 576] Q8_0 61 -> 64, Q4_1 85 -> 89. 8 rows per pass instead of 6: no better (180-186).
XR_BYTES = BLOCK


def _bcast16(xr: tirx.Buffer, row: tirx.PrimExpr, b: tirx.PrimExpr, half: int, lanes: int) -> tirx.PrimExpr:
    """Bytes 16*half .. 16*half + 15 of row `row`'s block b, repeated in each 128-bit lane."""
    v = xr.vload([row, b, 16 * half], "int8x16")
    return T.Shuffle([v] * (lanes // 16), [j % 16 for j in range(lanes)])


def _scales(sc: tirx.Buffer, t: tirx.PrimExpr, b: tirx.PrimExpr, first: tirx.PrimExpr, rows: int,
            repeat: int) -> tirx.PrimExpr:
    """d_w of `rows` rows of a tile from `first`, in block b, each repeated `repeat` times
    (float32 x rows*repeat, matching the integer dot's lanes). It does not depend on the
    row of x, so LLVM computes it once for all rows of a chunk."""
    s = T.Cast(f"float32x{rows}", sc.vload([t, b, first], f"float16x{rows}"))
    if repeat == 1:
        return s
    return T.Shuffle([s] * repeat, [i // repeat for i in range(rows * repeat)])


def _scaled(dot: tirx.PrimExpr, dx: tirx.PrimExpr, dw: tirx.PrimExpr) -> tirx.PrimExpr:
    """An integer block dot as float, times d_x (a broadcast from memory) and d_w."""
    lanes = 16 if "x16" in str(dot.ty) else 8
    return T.Cast(f"float32x{lanes}", dot) * T.Broadcast(dx, lanes) * dw


def _round_half_away(v: tirx.PrimExpr) -> tirx.PrimExpr:
    """Round to nearest, ties away from zero, exactly as GGML's reference quantizer (roundf)
    and gguf-py's np_roundf: |v| = f + r with f = floor(|v|), r exact, and floor(2r) adds the
    half. (TIR's round would tie to even.)"""
    a = T.fabs(v)
    f = T.floor(a)
    return T.if_then_else(v < T.float32(0), -(f + T.floor((a - f) * T.float32(2))), f + T.floor((a - f) * T.float32(2)))


def _prefetch(address: tirx.PrimExpr) -> tirx.PrimExpr:
    """A read prefetch of the cache line at `address` into all cache levels."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", address, T.int32(0), T.int32(3), T.int32(1))


def _vnni(acc: tirx.PrimExpr, a: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    """acc[i] + the sum over 4 bytes of u8 a times s8 b (int32x16)."""
    return T.call_llvm_pure_intrin("int32x16", _VNNI, acc, a, b)


def _maddubs(a: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    """Pairs of u8 a times s8 b, summed into int16x16 (saturating; operands here stay far below)."""
    return T.call_llvm_pure_intrin("int16x16", _MADDUBS, a, b)


def _pairs_to_i32(p: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.call_llvm_pure_intrin("int32x8", _MADDWD, p, T.Broadcast(T.int16(1), 16))


def _low(v: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
    return v & T.Broadcast(T.uint8(15), lanes)


def _high(v: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
    return v >> T.Broadcast(T.uint8(4), lanes)


def _q4_dot_vnni(v: tirx.PrimExpr, xlo: tirx.PrimExpr, xhi: tirx.PrimExpr, qh: tirx.PrimExpr | None = None
                 ) -> tirx.PrimExpr:
    """A tile's block of nibbles (4 rows x 16 bytes) against the block's activations:
    int32x16, lanes 4r..4r+3 summing to row r. `qh` (Q5_0): the rows' 5th bits, or-ed in."""
    lo, hi = _low(v, 64), _high(v, 64)
    if qh is not None:
        lo, hi = lo | _fifth_bits(qh, 4, False), hi | _fifth_bits(qh, 4, True)
    return _vnni(_vnni(T.Broadcast(T.int32(0), 16), lo, xlo), hi, xhi)


def _q4_dot_avx2(v: tirx.PrimExpr, xlo: tirx.PrimExpr, xhi: tirx.PrimExpr, qh: tirx.PrimExpr | None = None
                 ) -> tirx.PrimExpr:
    """Two rows' nibbles (2 x 16 bytes): int32x8, lanes 4r..4r+3 summing to row r.
    Nibbles <= 15 times |x| <= 127: the int16 sums stay below 2^13 (Q5_0's 5-bit quants
    <= 31: below 2^14)."""
    lo, hi = _low(v, 32), _high(v, 32)
    if qh is not None:
        lo, hi = lo | _fifth_bits(qh, 2, False), hi | _fifth_bits(qh, 2, True)
    return _pairs_to_i32(_maddubs(lo, xlo) + _maddubs(hi, xhi))


def _nl_dot_vnni(v: tirx.PrimExpr, xlo: tirx.PrimExpr, xhi: tirx.PrimExpr) -> tirx.PrimExpr:
    """IQ4_NL: a tile's block of codes (4 rows x 16 bytes) looked up to signed levels, against
    x + 128 (unsigned, the Q4 layout), the +128 taken out as Q8_0's is: int32x16."""
    lo, hi = iq4_levels("avx512vnni", _low(v, 64), 64), iq4_levels("avx512vnni", _high(v, 64), 64)
    zero, bias = T.Broadcast(T.int32(0), 16), T.Broadcast(T.uint8(128), 64)
    return _vnni(_vnni(zero - _vnni(_vnni(zero, bias, lo), bias, hi), T.reinterpret("uint8x64", xlo), lo),
                 T.reinterpret("uint8x64", xhi), hi)


def _nl_dot_avx2(v: tirx.PrimExpr, xlo: tirx.PrimExpr, xhi: tirx.PrimExpr) -> tirx.PrimExpr:
    """IQ4_NL on AVX2: two rows' levels against x with the sign trick (pairs up to 2 * 127 * 127,
    so the halves are widened to int32 before they are added): int32x8."""
    lo, hi = iq4_levels("avx2", _low(v, 32), 32), iq4_levels("avx2", _high(v, 32), 32)
    return _pairs_to_i32(signed_pairs("avx2", lo, xlo, 32)) + _pairs_to_i32(signed_pairs("avx2", hi, xhi, 32))


def _q8_dot_vnni(w01: tirx.PrimExpr, w23: tirx.PrimExpr, xlo: tirx.PrimExpr, xhi: tirx.PrimExpr) -> tirx.PrimExpr:
    """A tile's Q8_0 block (rows 0-1 and 2-3, 2 x 32 signed bytes each) against x + 128
    (unsigned, in the Q4 layout): int32x16, lanes 4r..4r+3 summing to row r. Two 128-bit
    lane shuffles regroup the rows' first and second 16 bytes (as Q4's low and high
    nibbles), so one dot chain serves 4 rows; the +128 comes out as the chain's start value,
    minus the same chain over 128s, which does not depend on x (LLVM computes it once for a
    pass's rows, and no instruction per row takes it out). Exact integers: the same sums."""
    first = [i for r in range(4) for i in range(32 * r, 32 * r + 16)]  # byte i of w01 | w23
    second = [i + 16 for i in first]
    a, b = T.Shuffle([w01, w23], first), T.Shuffle([w01, w23], second)
    zero, bias = T.Broadcast(T.int32(0), 16), T.Broadcast(T.uint8(128), 64)
    return _vnni(_vnni(zero - _vnni(_vnni(zero, bias, a), bias, b), T.reinterpret("uint8x64", xlo), a),
                 T.reinterpret("uint8x64", xhi), b)


def _q8_dot_avx2(w: tirx.PrimExpr, x: tirx.PrimExpr) -> tirx.PrimExpr:
    """One row of a Q8_0 block against x: |w| (unsigned) times x * sign(w), llama.cpp's way
    of feeding vpmaddubsw two signed operands. int32x8 summing to the row."""
    return _pairs_to_i32(_maddubs(T.call_llvm_pure_intrin("int8x32", _PSIGN, w, w),
                                  T.call_llvm_pure_intrin("int8x32", _PSIGN, x, w)))


def _hadd(a: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    """vphaddd: per 128-bit lane, adjacent pairs of a then of b (int32x8)."""
    return T.call_llvm_pure_intrin("int32x8", _PHADD, a, b)


def _q8_tile_dot_avx2(qw: tirx.Buffer, t: tirx.PrimExpr, b: tirx.PrimExpr, x: tirx.PrimExpr) -> tirx.PrimExpr:
    """A tile's Q8_0 block (4 rows) against x: int32x8, lanes r and r + 4 summing to row r
    (bytes 0-15 and 16-31). The four rows' int32x8 dots are folded by two rounds of vphaddd
    (exact integers), so a row of x keeps one accumulator register per tile instead of four:
    with 6 rows per pass the four-register form needed 24 of AVX2's 16 vector registers and
    spilled. The GEMV's form: for several rows of x per pass, _q8_tile_dot_avx2_regrouped."""
    d = [_q8_dot_avx2(qw.vload([t, b, r, 0], "int8x32"), x) for r in range(TILE_ROWS)]
    return _hadd(_hadd(d[0], d[1]), _hadd(d[2], d[3]))


def _i32(v: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.reinterpret("int32x8", v)


def _i8(v: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.reinterpret("int8x32", v)


def _q8_tile_dot_avx2_regrouped(qw: tirx.Buffer, t: tirx.PrimExpr, b: tirx.PrimExpr, x: tirx.PrimExpr
                                ) -> tirx.PrimExpr:
    """_q8_tile_dot_avx2's result (the same integers in the same lanes) without horizontal adds:
    the block's 4 rows are regrouped in registers (vpunpck{l,h}dq then vpunpck{l,h}qdq, 8
    shuffles that do not depend on x, so a pass of several rows of x does them once) into
    4 vectors, vector j holding dword j of every row in lanes 0-3 and dword j + 4 in lanes 4-7;
    each meets x's dwords j and j + 4 spread over the same lanes (one vpshufd), and the 4 dots
    are summed by vpaddd. Per row of x: 4 vpshufd and 3 vpaddd instead of 3 vphaddd (6 shuffle
    uops). Measured in C (tests/bench/q8_0_avx2_fold.c, AMD EPYC Zen 4, one thread, 6 rows of x
    per pass): 50.7 -> 59.9 GMAC/s; at 1 row per pass it is slower (42.3 -> 38.9), so the GEMV
    keeps the vphaddd form. Equal bits: each lane sums the same 16 bytes' products exactly."""
    r = [_i32(qw.vload([t, b, i, 0], "int8x32")) for i in range(TILE_ROWS)]
    lo, hi = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]  # vpunpck{l,h}dq
    t01, t01h = T.Shuffle([r[0], r[1]], lo), T.Shuffle([r[0], r[1]], hi)
    t23, t23h = T.Shuffle([r[2], r[3]], lo), T.Shuffle([r[2], r[3]], hi)
    qlo, qhi = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]  # vpunpck{l,h}qdq
    w = [T.Shuffle([t01, t23], qlo), T.Shuffle([t01, t23], qhi), T.Shuffle([t01h, t23h], qlo),
         T.Shuffle([t01h, t23h], qhi)]
    xi = _i32(x)
    d = [_q8_dot_avx2(_i8(w[j]), _i8(T.Shuffle([xi], [j] * 4 + [j + 4] * 4))) for j in range(4)]
    return (d[0] + d[1]) + (d[2] + d[3])


def _build(fmt: str, isa: str, n: int, k: int, lead: int | tuple, rows_per_chunk: int = 1,
           panel_bytes: int = PANEL_BYTES) -> tirx.PrimFunc:
    """The kernel for x of shape `lead` + [k] (`lead` an int: that many unit dims, a GEMV;
    a tuple: its dims, symbolic ones as TIR vars, a GEMM over their product M), handling
    `rows_per_chunk` rows of x per pass over a weight tile (the rest in one pass of their count),
    in panels of about `panel_bytes` of quantized rows."""
    nb, nt = k // BLOCK, n // TILE_ROWS
    q4 = fmt != "Q8_0"
    vnni = isa == "avx512vnni"
    qbytes, qdtype = (16, "uint8") if q4 else (32, "int8")
    has_min = fmt in ("Q4_1", "Q5_1")
    q5 = fmt in ("Q5_0", "Q5_1")
    nl = fmt == "IQ4_NL"  # 4-bit codes of non-linear levels (signed)
    offset = {"Q4_0": -8.0, "Q5_0": -16.0}.get(fmt, 0.0)
    dims = (1,) * lead if isinstance(lead, int) else tuple(lead)
    xshape, yshape = dims + (k,), dims + (n,)
    m = 1
    for d in dims:
        m = m * d
    static = isinstance(m, int)
    chunk = rows_per_chunk
    # rows of x per panel (whole passes): every weight tile passes over one panel before the next,
    # so the panel's quantized rows (XR_BYTES per block) stay in the L2 cache
    panel = max(chunk, panel_bytes // (nb * XR_BYTES) // chunk * chunk)
    npanels = (m + panel - 1) // panel
    flip = T.int8(-128) if (vnni and (nl or not q4)) else T.int8(0)
    attrs = {"tirx.noalias": True, "vtool.int8_gemv": f"{fmt}/{isa}"}

    @T.macro
    def quantize_row(x1, xq, xr, xd, xs, row):  # noqa: ANN001 - TVMScript macro
        # Per 32-block: d_x = max|x| / 127, q = round(x / d_x), sum(q) * d_x (the offsets' factor).
        for b in range(nb):
            amax = T.alloc_buffer((1,), "float32")
            qsum = T.alloc_buffer((1,), "int32")
            amax[0] = T.float32(0)
            qsum[0] = 0
            for j in range(BLOCK):
                amax[0] = T.max(amax[0], T.fabs(x1[row * k + b * BLOCK + j]))
            for j in range(BLOCK):
                xq[row * k + b * BLOCK + j] = T.Cast("int8", _round_half_away(T.if_then_else(
                    amax[0] > T.float32(0), x1[row * k + b * BLOCK + j] * (T.float32(1) / (amax[0] / T.float32(127))),
                    T.float32(0))))
                qsum[0] = qsum[0] + T.Cast("int32", xq[row * k + b * BLOCK + j])
            # d_x rounded to float16 as GGML's Q8_0 stores it: the activation is exactly a
            # Q8_0 block (what llama.cpp's dot products use, and gguf-py's quantizer gives)
            xd[row, b] = T.Cast("float32", T.Cast("float16", amax[0] / T.float32(127)))
            xs[row, b] = T.Cast("float32", qsum[0]) * xd[row, b]
            for j in range(BLOCK):
                # Q8_0 and IQ4_NL on VNNI: x + 128 (the sign bit flipped), vpdpbusd's unsigned side
                xr[row, b, j] = xq[row * k + b * BLOCK + j] ^ flip

    @T.macro
    def accumulate(acc, corr, qw, sc, mn, xr, xd, xs, t, b, row, i, qh, q8_tile_dot):  # noqa: ANN001 - TVMScript macro
        # One row of x against block b of tile t, into that row's accumulators (slot i).
        # q8_tile_dot: the AVX2 Q8_0 tile dot for this pass's row count (equal bits either way).
        # Expressions, not named temporaries: TVMScript makes a named vector value a
        # workspace allocation; LLVM shares the weight loads between the rows of a chunk.
        if nl and vnni:
            acc[i, T.Ramp(0, 1, 16)] = acc[i, T.Ramp(0, 1, 16)] + _scaled(_nl_dot_vnni(
                qw.vload([t, b, 0, 0], "uint8x64"), _bcast16(xr, row, b, 0, 64),
                _bcast16(xr, row, b, 1, 64)), xd[row, b], _scales(sc, t, b, 0, 4, 4))
        elif nl:
            for h in range(2):
                acc[i, T.Ramp(h * 8, 1, 8)] = acc[i, T.Ramp(h * 8, 1, 8)] + _scaled(_nl_dot_avx2(
                    qw.vload([t, b, 2 * h, 0], "uint8x32"), _bcast16(xr, row, b, 0, 32),
                    _bcast16(xr, row, b, 1, 32)), xd[row, b], _scales(sc, t, b, 2 * h, 2, 4))
        elif q4 and vnni:
            acc[i, T.Ramp(0, 1, 16)] = acc[i, T.Ramp(0, 1, 16)] + _scaled(_q4_dot_vnni(
                qw.vload([t, b, 0, 0], "uint8x64"), _bcast16(xr, row, b, 0, 64),
                _bcast16(xr, row, b, 1, 64), qh.vload([t, b, 0, 0], "uint8x16") if q5 else None),
                xd[row, b], _scales(sc, t, b, 0, 4, 4))
        elif q4:
            for h in range(2):
                acc[i, T.Ramp(h * 8, 1, 8)] = acc[i, T.Ramp(h * 8, 1, 8)] + _scaled(_q4_dot_avx2(
                    qw.vload([t, b, 2 * h, 0], "uint8x32"), _bcast16(xr, row, b, 0, 32),
                    _bcast16(xr, row, b, 1, 32), qh.vload([t, b, 2 * h, 0], "uint8x8") if q5 else None),
                    xd[row, b], _scales(sc, t, b, 2 * h, 2, 4))
        elif vnni:
            acc[i, T.Ramp(0, 1, 16)] = acc[i, T.Ramp(0, 1, 16)] + _scaled(_q8_dot_vnni(
                qw.vload([t, b, 0, 0], "int8x64"), qw.vload([t, b, 2, 0], "int8x64"),
                _bcast16(xr, row, b, 0, 64), _bcast16(xr, row, b, 1, 64)),
                xd[row, b], _scales(sc, t, b, 0, 4, 4))
        else:
            acc[i, T.Ramp(0, 1, 8)] = acc[i, T.Ramp(0, 1, 8)] + _scaled(q8_tile_dot(
                qw, t, b, xr.vload([row, b, 0], "int8x32")), xd[row, b], T.Shuffle(
                [T.Cast("float32x4", sc.vload([t, b, 0], "float16x4"))] * 2, [0, 1, 2, 3, 0, 1, 2, 3]))
        if has_min:  # + m * sum(x) per row (Q4_1, Q5_1)
            corr[i, T.Ramp(0, 1, 4)] = corr[i, T.Ramp(0, 1, 4)] + T.Cast(
                "float32x4", mn.vload([t, b, 0], "float16x4")) * T.Broadcast(xs[row, b], 4)
        elif q4 and offset != 0.0:  # (q - 8) * d: - 8 * d * sum(x) per row (Q5_0: - 16)
            corr[i, T.Ramp(0, 1, 4)] = corr[i, T.Ramp(0, 1, 4)] + T.Cast(
                "float32x4", sc.vload([t, b, 0], "float16x4")) * T.Broadcast(xs[row, b] * T.float32(offset), 4)

    @T.macro
    def store(acc, corr, y1, t, row, i):  # noqa: ANN001 - TVMScript macro
        for r in range(4):
            if q4 or vnni:  # 4 lanes per row
                y1[row * n + t * 4 + r] = (acc[i, r * 4] + acc[i, r * 4 + 1] + acc[i, r * 4 + 2]
                                           + acc[i, r * 4 + 3] + corr[i, r])
            else:  # Q8_0 on AVX2: lanes r and r + 4 (_q8_tile_dot_avx2)
                y1[row * n + t * 4 + r] = acc[i, r] + acc[i, r + 4]

    @T.macro
    def rows_pass(qw, sc, mn, y1, xr, xd, xs, t, first, count, qh):  # noqa: ANN001 - TVMScript macro
        # `count` (static) rows of x from `first` against tile t: every block's weights are
        # loaded once and used by each row. Global scope on purpose: small global allocations
        # become stack slots (LLVM keeps them in registers); "local" ones became a workspace
        # call per tile. One pair per pass, sized to it, so that LLVM promotes each whole.
        acc = T.alloc_buffer((count, 32), "float32")
        corr = T.alloc_buffer((count, 4), "float32")
        for i in T.unroll(count):
            acc[i, T.Ramp(0, 1, 16)] = T.Broadcast(T.float32(0), 16)
            acc[i, T.Ramp(16, 1, 16)] = T.Broadcast(T.float32(0), 16)
            corr[i, T.Ramp(0, 1, 4)] = T.Broadcast(T.float32(0), 4)
        for b in range(nb):
            # This block of the tile PREFETCH_TILES ahead, into L1: the weights stream from DRAM
            # once, and the hardware prefetcher alone left the multi-row passes waiting on them
            # (prefetches of addresses past the last tile do not fault).
            _prefetch(T.address_of(qw[t + PREFETCH_TILES, b, 0, 0]))
            if not q4:  # a Q8_0 tile block is two cache lines
                _prefetch(T.address_of(qw[t + PREFETCH_TILES, b, 2, 0]))
            _prefetch(T.address_of(sc[t + PREFETCH_TILES, b, 0]))
            if has_min:
                _prefetch(T.address_of(mn[t + PREFETCH_TILES, b, 0]))
            if q5:
                _prefetch(T.address_of(qh[t + PREFETCH_TILES, b, 0, 0]))
            for i in T.unroll(count):
                accumulate(acc, corr, qw, sc, mn, xr, xd, xs, t, b, first + i, i, qh,
                           _q8_tile_dot_avx2_regrouped if count >= REGROUP_ROWS else _q8_tile_dot_avx2)
        for i in T.unroll(count):
            store(acc, corr, y1, t, first + i, i)

    @T.macro
    def passes(qw, sc, mn, y1, xr, xd, xs, t, p, qh):  # noqa: ANN001 - TVMScript macro
        # Tile t over panel p's rows: whole passes, then the rest (only in the last panel) in one
        # pass of exactly that many (a verify step's 1 + k rows are all one pass): each count is
        # its own unrolled code.
        for c in range(T.min(m - p * panel, panel) // chunk):
            rows_pass(qw, sc, mn, y1, xr, xd, xs, t, p * panel + c * chunk, chunk, qh)
        if chunk > 1:
            if T.min(m - p * panel, panel) % chunk == 1:
                rows_pass(qw, sc, mn, y1, xr, xd, xs, t, m - 1, 1, qh)
        if chunk > 2:
            if T.min(m - p * panel, panel) % chunk == 2:
                rows_pass(qw, sc, mn, y1, xr, xd, xs, t, m - 2, 2, qh)
        if chunk > 3:
            if T.min(m - p * panel, panel) % chunk == 3:
                rows_pass(qw, sc, mn, y1, xr, xd, xs, t, m - 3, 3, qh)
        if chunk > 4:
            if T.min(m - p * panel, panel) % chunk == 4:
                rows_pass(qw, sc, mn, y1, xr, xd, xs, t, m - 4, 4, qh)
        if chunk > 5:
            if T.min(m - p * panel, panel) % chunk == 5:
                rows_pass(qw, sc, mn, y1, xr, xd, xs, t, m - 5, 5, qh)
        if chunk > 6:
            if T.min(m - p * panel, panel) % chunk == 6:
                rows_pass(qw, sc, mn, y1, xr, xd, xs, t, m - 6, 6, qh)
        if chunk > 7:
            if T.min(m - p * panel, panel) % chunk == 7:
                rows_pass(qw, sc, mn, y1, xr, xd, xs, t, m - 7, 7, qh)

    @T.macro
    def kernel(x, qw, sc, mn, y, qh):  # noqa: ANN001 - TVMScript macro
        x1 = T.decl_buffer((m * k,), "float32", data=x.data)
        y1 = T.decl_buffer((m * n,), "float32", data=y.data)
        xq = T.alloc_buffer((m * k,), "int8")
        xr = T.alloc_buffer((m, nb, XR_BYTES), "int8")
        xd = T.alloc_buffer((m, nb), "float32")
        xs = T.alloc_buffer((m, nb), "float32")
        if static:
            for row in range(m):
                quantize_row(x1, xq, xr, xd, xs, row)
        else:
            for row in T.parallel(m):
                quantize_row(x1, xq, xr, xd, xs, row)
        for p in range(npanels):
            for t in T.parallel(nt):
                passes(qw, sc, mn, y1, xr, xd, xs, t, p, qh)

    if has_min and q5:
        @T.prim_func(private=True)
        def gemv_q5_min(x: T.Buffer(xshape, "float32"), qw: T.Buffer((nt, nb, TILE_ROWS, qbytes), qdtype),
                        qh: T.Buffer((nt, nb, TILE_ROWS, 4), "uint8"), sc: T.Buffer((nt, nb, TILE_ROWS), "float16"),
                        mn: T.Buffer((nt, nb, TILE_ROWS), "float16"), y: T.Buffer(yshape, "float32")):
            T.func_attr(attrs)
            kernel(x, qw, sc, mn, y, qh)

        return gemv_q5_min

    if has_min:
        @T.prim_func(private=True)
        def gemv_min(x: T.Buffer(xshape, "float32"), qw: T.Buffer((nt, nb, TILE_ROWS, qbytes), qdtype),
                     sc: T.Buffer((nt, nb, TILE_ROWS), "float16"), mn: T.Buffer((nt, nb, TILE_ROWS), "float16"),
                     y: T.Buffer(yshape, "float32")):
            T.func_attr(attrs)
            kernel(x, qw, sc, mn, y, None)

        return gemv_min

    if q5:
        @T.prim_func(private=True)
        def gemv_q5(x: T.Buffer(xshape, "float32"), qw: T.Buffer((nt, nb, TILE_ROWS, qbytes), qdtype),
                    qh: T.Buffer((nt, nb, TILE_ROWS, 4), "uint8"), sc: T.Buffer((nt, nb, TILE_ROWS), "float16"),
                    y: T.Buffer(yshape, "float32")):
            T.func_attr(attrs)
            kernel(x, qw, sc, None, y, qh)

        return gemv_q5

    @T.prim_func(private=True)
    def gemv(x: T.Buffer(xshape, "float32"), qw: T.Buffer((nt, nb, TILE_ROWS, qbytes), qdtype),
             sc: T.Buffer((nt, nb, TILE_ROWS), "float16"), y: T.Buffer(yshape, "float32")):
        T.func_attr(attrs)
        kernel(x, qw, sc, None, y, None)

    return gemv
