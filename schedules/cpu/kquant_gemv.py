"""Decode GEMVs over kept K-quant (Q2_K..Q6_K) and IQ4_XS blocks with Q8_K activations and integer dots (x86).

The companion of schedules/cpu/int8_gemv.py (Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 with Q8_0 activations), for
the K-quants llama.cpp's Q2_K..Q6_K presets write and IQ4_XS. As its ggml_vec_dot_*_q8_K do, the
activation row is quantized once per call to GGML Q8_K blocks: per 256 values, the value of
largest magnitude `max` gives iscale = -127 / max, q = nearest_int(iscale * x) (ties to even,
as llama.cpp's nearest_int), clamped to 127, and d_x = 1 / iscale kept as float32. Then
quants multiply quants in integer lanes, and the K-quant's 6- or 8-bit sub-block scales are
applied in integers too, so float arithmetic happens once per 256-weight super-block:

  per 32-weight block b of a tile (4 rows), per vector of rows (4 on avx512vnni, 2 on avx2):
    p  = vpmaddubsw(q_w, q_x)      u8 weight quants x s8 activation quants, pairs -> int16
    Q4_K: p = p(low nibbles, x0..15) + p(high nibbles, x16..31)       |p| <= 2 * 2 * 15 * 127
    Q5_K: the same with the fifth bits or-ed onto the nibbles (fifth_bits, also int8_gemv's for
          Q5_0/Q5_1: the kept qhigh holds each 32's bits as Q5_0 does) |p| <= 2 * 2 * 31 * 127
    Q6_K: q_w = low 4 bits | high 2 bits << 4 (0..63); its -32 comes out as
          p(q_w, x) - p(32, x) (x alone, shared by every row)         |p| <= 2 * 32 * 127
    Q3_K: q_w = 2 bits | third bit << 2 (0..7), - 4 as Q6_K's - 32     |p| <= 2 * 7 * 127
    Q2_K: q_w = 2 bits (0..3)                                          |p| <= 2 * 3 * 127
    IQ4_XS: q_w = the signed level of each nibble (one vpshufb, iq4_levels), times x as
          |q_w| and x with q_w's sign (signed_pairs); the halves meet the scale apart |p| <= 2 * 127 * 127
    acc_int32 += vpmaddwd(p, sub-scale of the row's 32 (Q4_K, Q5_K, IQ4_XS) / 16 (Q6_K, Q3_K, Q2_K) weights)
  per super-block: acc_f32 += float(acc_int32) * d_w * d_x
  Q4_K's, Q5_K's and Q2_K's min: - dmin * d_x * sum over sub-blocks of m * sum(q_x of the
  sub-block), the per-32 (Q2_K: per-16) activation sums (llama.cpp's bsums) made with the
  quantization. Q2_K's and Q3_K's 2-bit quants are kept 64 weights to 16 bytes (Q6_K's qhigh
  layout), so one load of them serves the two blocks of a 64-weight group.

The avx512vnni kernels use AVX-512 BW's 512-bit vpmaddubsw / vpmaddwd (the sub-block scales
are 16-bit multipliers, which vpdpbusd has no slot for); avx2 the same at 256 bits. Weight
layout: vtool.runtime.weights.ggml_blocks's, no repacking beyond it (qweight in Q4_0's nibble
order, [tile, block, row in tile, bytes]); tiles run in parallel. Rows of x beyond one
(batched decode, speculative verification) each make one pass over the tile, with the GEMV's
arithmetic, so each row equals the GEMV of that row bit for bit (gemm_func; the models' GEMMs are
kquant_gemm.py's, several rows per pass with the same per-row result).

The result is the dot product of gguf-py's dequantized weights with the Q8_K-dequantized
activations, up to float32 summation order (tests/test_kquant_gemv.py).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T
from vtool.runtime.weights.ggml_blocks import BLOCK, IQ4_VALUES, SUPER_BLOCK, TILE_ROWS

# = vtool.models.int8_activations.Q8_K_FORMATS (a test holds them equal)
FORMATS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
ISAS = ("avx512vnni", "avx2")

_MADDUBS = {"avx512vnni": "llvm.x86.avx512.pmaddubs.w.512", "avx2": "llvm.x86.avx2.pmadd.ub.sw"}
_MADDWD = {"avx512vnni": "llvm.x86.avx512.pmaddw.d.512", "avx2": "llvm.x86.avx2.pmadd.wd"}
_PSHUFB = {"avx512vnni": "llvm.x86.avx512.pshuf.b.512", "avx2": "llvm.x86.avx2.pshuf.b"}
_PSIGN = "llvm.x86.avx2.psign.b"
PER_SUPER = SUPER_BLOCK // BLOCK  # 8 blocks of 32 per super-block
PREFETCH_TILES = 2  # as int8_gemv.py's: the next tiles a thread reads, into L1 ahead of use


def _check(fmt: str, isa: str, n: int, k: int) -> None:
    if fmt not in FORMATS or isa not in ISAS:
        raise ValueError(f"no Q8_K-activation GEMV for {fmt} on {isa}")
    if n % TILE_ROWS or k % SUPER_BLOCK:
        raise ValueError(f"K-quant GEMV needs n % {TILE_ROWS} == 0 and k % {SUPER_BLOCK} == 0, got [{n}, {k}]")


def gemv_func(fmt: str, isa: str, n: int, k: int, lead: int) -> tirx.PrimFunc:
    """x float32 [1]*lead + [k] times a kept [n, k] weight of `fmt` -> float32 [1]*lead + [n].
    Parameters: x, the weight's parts in ggml_blocks.parts order, y."""
    _check(fmt, isa, n, k)
    return _build(fmt, isa, n, k, (1,) * lead)


def gemm_func(fmt: str, isa: str, n: int, k: int, lead: tuple) -> tirx.PrimFunc:
    """As gemv_func for x of shape `lead` + [k], symbolic dims (TIR vars) allowed: every row
    of x quantized once, then one pass per row over each weight tile (the GEMV's arithmetic)."""
    _check(fmt, isa, n, k)
    return _build(fmt, isa, n, k, tuple(lead))


def _prefetch(address: tirx.PrimExpr) -> tirx.PrimExpr:
    """A read prefetch of the cache line at `address` into all cache levels."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", address, T.int32(0), T.int32(3), T.int32(1))


def _maddubs(isa: str, a: tirx.PrimExpr, b: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
    """Pairs of u8 a times s8 b, summed into int16 (saturating; the operands here stay below)."""
    return T.call_llvm_pure_intrin(f"int16x{lanes // 2}", _MADDUBS[isa], a, b)


def _maddwd(isa: str, a: tirx.PrimExpr, b: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
    """Pairs of int16 a times int16 b, summed into int32."""
    return T.call_llvm_pure_intrin(f"int32x{lanes // 4}", _MADDWD[isa], a, b)


def _scales16(v: tirx.PrimExpr, rows: int, low_nibble: bool) -> tirx.PrimExpr:
    """Per-16 sub-block scales of `rows` rows as int16: Q6_K's and Q3_K's signed bytes, or
    Q2_K's low nibbles (its mins are the high ones)."""
    if low_nibble:
        v = v & T.Broadcast(T.uint8(15), rows)
    return T.Cast(f"int16x{rows}", v)


def _per_row(v: tirx.PrimExpr, rows: int, repeat: int) -> tirx.PrimExpr:
    """A vector of `rows` values, each repeated `repeat` times (row r at lanes r*repeat...)."""
    return T.Shuffle([v] * repeat, [i // repeat for i in range(rows * repeat)])


def fifth_bits(qh: tirx.PrimExpr, rows: int, second: bool, shift: int = 4) -> tirx.PrimExpr:
    """Q5_0's, Q5_1's and Q5_K's 5th bits, 16 per row of `rows` (qh: the rows' 4 bytes each, bit e
    of the little-endian 32 = element e's), as 16 or 0 in the byte lanes of the nibbles they
    complete (row r's element j at lane 16r + j; `second`: elements 16..31): a byte shuffle, a
    constant bit mask, a min and a shift (`shift` 2: Q3_K's third bits, as 4 or 0)."""
    lanes = rows * 16
    pick = [4 * (i // 16) + 2 * second + (i % 16) // 8 for i in range(lanes)]
    bits = T.Shuffle([qh] * 4, pick)
    mask = T.Shuffle([T.Broadcast(T.uint8(1 << b), lanes // 8) for b in range(8)],
                     [(i % 8) * (lanes // 8) for i in range(lanes)])
    return T.min(bits & mask, T.Broadcast(T.uint8(1), lanes)) << T.Broadcast(T.uint8(shift), lanes)


def iq4_levels(isa: str, codes: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
    """IQ4_NL's / IQ4_XS's levels (signed bytes) of a vector of 4-bit codes: one vpshufb from a
    constant table of the 16 levels (repeated in each 128-bit lane)."""
    table = T.Shuffle([T.Broadcast(T.int8(v), lanes // 16) for v in IQ4_VALUES],
                      [(i % 16) * (lanes // 16) for i in range(lanes)])
    return T.call_llvm_pure_intrin(f"int8x{lanes}", _PSHUFB[isa], table, T.reinterpret(f"int8x{lanes}", codes))


def signed_pairs(isa: str, w: tirx.PrimExpr, x: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
    """Pairs of signed bytes w times signed bytes x, summed into int16 (|w|, |x| <= 127): vpmaddubsw
    of |w| and x with w's sign, llama.cpp's way (vpsignb on AVX2; AVX-512 has none: two selects)."""
    if isa == "avx2":
        return _maddubs(isa, T.call_llvm_pure_intrin(f"int8x{lanes}", _PSIGN, w, w),
                        T.call_llvm_pure_intrin(f"int8x{lanes}", _PSIGN, x, w), lanes)
    zero = T.Broadcast(T.int8(0), lanes)
    return _maddubs(isa, T.Select(w < zero, zero - w, w), T.Select(w < zero, zero - x, x), lanes)


def _two_bits(v: tirx.PrimExpr, shift: int, lanes: int, qh: tirx.PrimExpr | None, second: bool,
              rows: int) -> tirx.PrimExpr:
    """The 2-bit quants at bits shift..shift+1 of each byte (Q2_K, Q3_K), Q3_K's third bits or-ed in."""
    q = (v >> T.Broadcast(T.uint8(shift), lanes)) & T.Broadcast(T.uint8(3), lanes)
    return q if qh is None else q | fifth_bits(qh, rows, second, 2)


def _dot16(isa: str, q: tirx.PrimExpr, x: tirx.PrimExpr, offset: int, lanes: int) -> tirx.PrimExpr:
    """Pairs of (q - offset) times x as int16: q's offset comes out as the same dot over `offset`s."""
    p = _maddubs(isa, q, x, lanes)
    return p if offset == 0 else p - _maddubs(isa, T.Broadcast(T.uint8(offset), lanes), x, lanes)


def _quants(v: tirx.PrimExpr, lanes: int, high: bool, qh: tirx.PrimExpr | None, rows: int) -> tirx.PrimExpr:
    """A vector of packed nibbles -> its low (or high) nibbles, Q5_K's fifth bits or-ed in."""
    q = v >> T.Broadcast(T.uint8(4), lanes) if high else v & T.Broadcast(T.uint8(15), lanes)
    return q if qh is None else q | fifth_bits(qh, rows, high)


def _build(fmt: str, isa: str, n: int, k: int, dims: tuple) -> tirx.PrimFunc:
    nb, nsb, nt = k // BLOCK, k // SUPER_BLOCK, n // TILE_ROWS
    vnni = isa == "avx512vnni"
    lanes = 64 if vnni else 32  # bytes per weight vector
    rows_v = lanes // 16  # tile rows per weight vector: 4 (one vector a tile) or 2 (two halves)
    halves = TILE_ROWS // rows_v
    q4k = fmt in ("Q4_K", "Q5_K")  # 6-bit scales and mins per 32 weights
    q5k = fmt == "Q5_K"
    low2 = fmt in ("Q2_K", "Q3_K")  # 2-bit quants, scales per 16 weights (Q3_K: + third bits, - 4)
    q3k, q2k = fmt == "Q3_K", fmt == "Q2_K"
    has_min = fmt in ("Q4_K", "Q5_K", "Q2_K")  # - dmin * m * x
    iq4 = fmt == "IQ4_XS"  # non-linear 4-bit levels, a signed scale per 32
    xshape, yshape = dims + (k,), dims + (n,)
    m = 1
    for d in dims:
        m = m * d
    static = isinstance(m, int)
    attrs = {"tirx.noalias": True, "vtool.int8_gemv": f"{fmt}/{isa}"}
    u8, i8 = f"uint8x{lanes}", f"int8x{lanes}"
    qh_t = f"uint8x{4 * rows_v}"  # Q5_K/Q3_K: the fifth (third) bits of a vector's rows, 4 bytes each
    sc_t = f"{'uint8' if q2k else 'int8'}x{rows_v}"  # per-16 scales of a vector's rows (Q6_K, Q3_K, Q2_K)
    acc_lanes = lanes // 4  # int32 lanes per vector: 4 per row

    @T.macro
    def quantize_row(x1, xq, xr, xd, xs, xs16, row):  # noqa: ANN001 - TVMScript macro
        # Q8_K, as llama.cpp's quantize_row_q8_K_ref: per 256 values, the first of largest
        # magnitude gives iscale = -127 / max; q = nearest_int(iscale * x) capped at 127
        for s in range(nsb):
            amax = T.alloc_buffer((1,), "float32")
            vmax = T.alloc_buffer((1,), "float32")
            amax[0] = T.float32(0)
            vmax[0] = T.float32(0)
            for j in range(SUPER_BLOCK):
                if T.fabs(x1[row * k + s * SUPER_BLOCK + j]) > amax[0]:
                    amax[0] = T.fabs(x1[row * k + s * SUPER_BLOCK + j])
                    vmax[0] = x1[row * k + s * SUPER_BLOCK + j]
            iscale = T.if_then_else(amax[0] > T.float32(0), T.float32(-127) / vmax[0], T.float32(0))
            for j in range(SUPER_BLOCK):
                xq[row * k + s * SUPER_BLOCK + j] = T.Cast("int8", T.min(
                    T.round(iscale * x1[row * k + s * SUPER_BLOCK + j]), T.float32(127)))
            xd[row, s] = T.if_then_else(amax[0] > T.float32(0), T.float32(1) / iscale, T.float32(0))
        for b in range(nb):
            qsum = T.alloc_buffer((1,), "int32")
            qsum[0] = 0
            for j in range(BLOCK):
                qsum[0] = qsum[0] + T.Cast("int32", xq[row * k + b * BLOCK + j])
            xs[row, b] = qsum[0]
            if q2k:  # Q2_K's mins are per 16 weights
                for half in range(2):
                    hsum = T.alloc_buffer((1,), "int32")
                    hsum[0] = 0
                    for j in range(16):
                        hsum[0] = hsum[0] + T.Cast("int32", xq[row * k + b * BLOCK + half * 16 + j])
                    xs16[row, 2 * b + half] = hsum[0]
            # the Q4 layout of int8_gemv.py: [x0..15 x rows_v | x16..31 x rows_v]
            for r in range(rows_v):
                for j in range(16):
                    xr[row, b, r * 16 + j] = xq[row * k + b * BLOCK + j]
                    xr[row, b, lanes + r * 16 + j] = xq[row * k + b * BLOCK + 16 + j]

    @T.macro
    def block_q4k(iacc, macc, qw, qh, ssc, smn, xr, xs, t, b, row):  # noqa: ANN001 - TVMScript macro
        for h in T.unroll(halves):
            iacc[T.Ramp(h * acc_lanes, 1, acc_lanes)] = iacc[T.Ramp(h * acc_lanes, 1, acc_lanes)] + _maddwd(
                isa, _maddubs(isa, _quants(qw.vload([t, b, h * rows_v, 0], u8), lanes, False,
                                           qh.vload([t, b, h * rows_v, 0], qh_t) if q5k else None, rows_v),
                              xr.vload([row, b, 0], i8), lanes)
                + _maddubs(isa, _quants(qw.vload([t, b, h * rows_v, 0], u8), lanes, True,
                                        qh.vload([t, b, h * rows_v, 0], qh_t) if q5k else None, rows_v),
                           xr.vload([row, b, lanes], i8), lanes),
                _per_row(T.Cast(f"int16x{rows_v}", ssc.vload([t, b, h * rows_v], f"uint8x{rows_v}")), rows_v, 8),
                lanes)
        macc[T.Ramp(0, 1, 4)] = macc[T.Ramp(0, 1, 4)] + T.Cast("int32x4", smn.vload([t, b, 0], "uint8x4")) * T.Broadcast(xs[row, b], 4)

    @T.macro
    def block_q6k(iacc, qw, qh, ssc, xr, t, b, g, shift, row):  # noqa: ANN001 - TVMScript macro
        for h in T.unroll(halves):
            iacc[T.Ramp(h * acc_lanes, 1, acc_lanes)] = iacc[T.Ramp(h * acc_lanes, 1, acc_lanes)] + _maddwd(
                isa, _maddubs(isa, (qw.vload([t, b, h * rows_v, 0], u8) & T.Broadcast(T.uint8(15), lanes))
                              | (((qh.vload([t, g, h * rows_v, 0], u8) >> T.Broadcast(T.uint8(shift), lanes))
                                  & T.Broadcast(T.uint8(3), lanes)) << T.Broadcast(T.uint8(4), lanes)),
                              xr.vload([row, b, 0], i8), lanes)
                - _maddubs(isa, T.Broadcast(T.uint8(32), lanes), xr.vload([row, b, 0], i8), lanes),
                _per_row(T.Cast(f"int16x{rows_v}", ssc.vload([t, 2 * b, h * rows_v], f"int8x{rows_v}")), rows_v, 8),
                lanes) + _maddwd(
                isa, _maddubs(isa, (qw.vload([t, b, h * rows_v, 0], u8) >> T.Broadcast(T.uint8(4), lanes))
                              | (((qh.vload([t, g, h * rows_v, 0], u8) >> T.Broadcast(T.uint8(shift + 2), lanes))
                                  & T.Broadcast(T.uint8(3), lanes)) << T.Broadcast(T.uint8(4), lanes)),
                              xr.vload([row, b, lanes], i8), lanes)
                - _maddubs(isa, T.Broadcast(T.uint8(32), lanes), xr.vload([row, b, lanes], i8), lanes),
                _per_row(T.Cast(f"int16x{rows_v}", ssc.vload([t, 2 * b + 1, h * rows_v], f"int8x{rows_v}")),
                         rows_v, 8),
                lanes)

    @T.macro
    def block_iq4(iacc, qw, ssc, xr, t, b, row):  # noqa: ANN001 - TVMScript macro
        # IQ4_XS: the levels of the low nibbles (x0..15) and the high ones (x16..31), each pair sum
        # up to 2 * 127 * 127, so the halves meet the scale apart (their int16 sum could overflow)
        for h in T.unroll(halves):
            iacc[T.Ramp(h * acc_lanes, 1, acc_lanes)] = iacc[T.Ramp(h * acc_lanes, 1, acc_lanes)] + _maddwd(
                isa, signed_pairs(isa, iq4_levels(isa, _quants(qw.vload([t, b, h * rows_v, 0], u8), lanes, False,
                                                               None, rows_v), lanes),
                                  xr.vload([row, b, 0], i8), lanes),
                _per_row(T.Cast(f"int16x{rows_v}", ssc.vload([t, b, h * rows_v], f"int8x{rows_v}")), rows_v, 8),
                lanes) + _maddwd(
                isa, signed_pairs(isa, iq4_levels(isa, _quants(qw.vload([t, b, h * rows_v, 0], u8), lanes, True,
                                                               None, rows_v), lanes),
                                  xr.vload([row, b, lanes], i8), lanes),
                _per_row(T.Cast(f"int16x{rows_v}", ssc.vload([t, b, h * rows_v], f"int8x{rows_v}")), rows_v, 8),
                lanes)

    @T.macro
    def block_low2(iacc, macc, qw, qh, ssc, xr, xs16, t, b, g, shift, row):  # noqa: ANN001 - TVMScript macro
        # Q2_K/Q3_K: block b = bits shift.. (x0..15) and shift + 2.. (x16..31) of 64-weight group g
        for h in T.unroll(halves):
            iacc[T.Ramp(h * acc_lanes, 1, acc_lanes)] = iacc[T.Ramp(h * acc_lanes, 1, acc_lanes)] + _maddwd(
                isa, _dot16(isa, _two_bits(qw.vload([t, g, h * rows_v, 0], u8), shift, lanes,
                                           qh.vload([t, b, h * rows_v, 0], qh_t) if q3k else None, False, rows_v),
                            xr.vload([row, b, 0], i8), 4 if q3k else 0, lanes),
                _per_row(_scales16(ssc.vload([t, 2 * b, h * rows_v], sc_t), rows_v, q2k), rows_v, 8),
                lanes) + _maddwd(
                isa, _dot16(isa, _two_bits(qw.vload([t, g, h * rows_v, 0], u8), shift + 2, lanes,
                                           qh.vload([t, b, h * rows_v, 0], qh_t) if q3k else None, True, rows_v),
                            xr.vload([row, b, lanes], i8), 4 if q3k else 0, lanes),
                _per_row(_scales16(ssc.vload([t, 2 * b + 1, h * rows_v], sc_t), rows_v, q2k), rows_v, 8),
                lanes)
        if q2k:  # the mins (high nibbles of the per-16 bytes) times the activations' per-16 sums
            macc[T.Ramp(0, 1, 4)] = macc[T.Ramp(0, 1, 4)] + T.Cast(
                "int32x4", ssc.vload([t, 2 * b, 0], "uint8x4") >> T.Broadcast(T.uint8(4), 4)) * T.Broadcast(
                xs16[row, 2 * b], 4) + T.Cast("int32x4", ssc.vload([t, 2 * b + 1, 0], "uint8x4") >> T.Broadcast(
                    T.uint8(4), 4)) * T.Broadcast(xs16[row, 2 * b + 1], 4)

    @T.macro
    def row_pass(qw, qh, sc, mn, ssc, smn, y1, xr, xd, xs, xs16, t, row):  # noqa: ANN001 - TVMScript macro
        # One row of x against tile t. Small global allocations become stack slots that LLVM
        # keeps in registers (see int8_gemv.py's rows_pass).
        facc = T.alloc_buffer((16,), "float32")
        iacc = T.alloc_buffer((16,), "int32")
        macc = T.alloc_buffer((4,), "int32")
        corr = T.alloc_buffer((4,), "float32")
        facc[T.Ramp(0, 1, 16)] = T.Broadcast(T.float32(0), 16)
        corr[T.Ramp(0, 1, 4)] = T.Broadcast(T.float32(0), 4)
        for s in range(nsb):
            iacc[T.Ramp(0, 1, 16)] = T.Broadcast(T.int32(0), 16)
            macc[T.Ramp(0, 1, 4)] = T.Broadcast(T.int32(0), 4)
            if q4k:
                for j in T.unroll(PER_SUPER):
                    _prefetch(T.address_of(qw[t + PREFETCH_TILES, s * PER_SUPER + j, 0, 0]))
                    if q5k and j % 4 == 0:  # a 64-byte line of qhigh holds 4 blocks' bits
                        _prefetch(T.address_of(qh[t + PREFETCH_TILES, s * PER_SUPER + j, 0, 0]))
                    block_q4k(iacc, macc, qw, qh, ssc, smn, xr, xs, t, s * PER_SUPER + j, row)
            elif iq4:
                for j in T.unroll(PER_SUPER):
                    _prefetch(T.address_of(qw[t + PREFETCH_TILES, s * PER_SUPER + j, 0, 0]))
                    block_iq4(iacc, qw, ssc, xr, t, s * PER_SUPER + j, row)
            elif low2:
                # pairs of blocks: one 64-weight group of 2-bit quants, bits 0..3, then 4..7
                for j in T.unroll(PER_SUPER // 2):
                    _prefetch(T.address_of(qw[t + PREFETCH_TILES, s * 4 + j, 0, 0]))
                    if q3k and j % 2 == 0:  # a 64-byte line of qhigh holds 4 blocks' bits
                        _prefetch(T.address_of(qh[t + PREFETCH_TILES, s * PER_SUPER + 2 * j, 0, 0]))
                    block_low2(iacc, macc, qw, qh, ssc, xr, xs16, t, s * PER_SUPER + 2 * j, s * 4 + j, 0, row)
                    block_low2(iacc, macc, qw, qh, ssc, xr, xs16, t, s * PER_SUPER + 2 * j + 1, s * 4 + j, 4, row)
            else:
                # pairs of blocks: one 64-weight group of qhigh, the 2-bit fields at bits 0..3, then 4..7
                for j in T.unroll(PER_SUPER // 2):
                    _prefetch(T.address_of(qw[t + PREFETCH_TILES, s * PER_SUPER + 2 * j, 0, 0]))
                    _prefetch(T.address_of(qw[t + PREFETCH_TILES, s * PER_SUPER + 2 * j + 1, 0, 0]))
                    _prefetch(T.address_of(qh[t + PREFETCH_TILES, s * 4 + j, 0, 0]))
                    block_q6k(iacc, qw, qh, ssc, xr, t, s * PER_SUPER + 2 * j, s * 4 + j, 0, row)
                    block_q6k(iacc, qw, qh, ssc, xr, t, s * PER_SUPER + 2 * j + 1, s * 4 + j, 4, row)
            # d_w (float16, one per row of the super-block) x d_x, once per 256 weights
            facc[T.Ramp(0, 1, 16)] = facc[T.Ramp(0, 1, 16)] + T.Cast("float32x16", iacc[T.Ramp(0, 1, 16)]) * _per_row(
                T.Cast("float32x4", sc.vload([t, s, 0], "float16x4")), 4, 4) * T.Broadcast(xd[row, s], 16)
            if has_min:
                corr[T.Ramp(0, 1, 4)] = corr[T.Ramp(0, 1, 4)] + T.Cast("float32x4", macc[T.Ramp(0, 1, 4)]) * T.Cast(
                    "float32x4", mn.vload([t, s, 0], "float16x4")) * T.Broadcast(xd[row, s], 4)
        for r in range(4):
            y1[row * n + t * 4 + r] = facc[r * 4] + facc[r * 4 + 1] + facc[r * 4 + 2] + facc[r * 4 + 3] - corr[r]

    @T.macro
    def kernel(x, qw, qh, sc, mn, ssc, smn, y):  # noqa: ANN001 - TVMScript macro
        x1 = T.decl_buffer((m * k,), "float32", data=x.data)
        y1 = T.decl_buffer((m * n,), "float32", data=y.data)
        xq = T.alloc_buffer((m * k,), "int8")
        xr = T.alloc_buffer((m, nb, 2 * lanes), "int8")
        xd = T.alloc_buffer((m, nsb), "float32")
        xs = T.alloc_buffer((m, nb), "int32")
        xs16 = T.alloc_buffer((m, 2 * nb if q2k else 1), "int32")
        if static:
            for row in range(m):
                quantize_row(x1, xq, xr, xd, xs, xs16, row)
        else:
            for row in T.parallel(m):
                quantize_row(x1, xq, xr, xd, xs, xs16, row)
        for t in T.parallel(nt):
            for row in range(m):
                row_pass(qw, qh, sc, mn, ssc, smn, y1, xr, xd, xs, xs16, t, row)

    return entry_point(fmt, kernel, xshape, yshape, nt, nb, nsb, attrs)


def entry_point(fmt: str, kernel, xshape: tuple, yshape: tuple, nt: int, nb: int, nsb: int,  # noqa: ANN001
                attrs: dict) -> tirx.PrimFunc:
    """The PrimFunc of a K-quant / IQ4_XS kernel macro (this file's GEMV, kquant_gemm.py's GEMM):
    x, the format's weight parts as ggml_blocks lays them out, y; `kernel(x, qw, qh, sc, mn, ssc,
    smn, y)` takes None for the parts the format lacks."""
    q4k, q5k = fmt in ("Q4_K", "Q5_K"), fmt == "Q5_K"
    q3k, q2k, iq4 = fmt == "Q3_K", fmt == "Q2_K", fmt == "IQ4_XS"
    if iq4:
        @T.prim_func(private=True)
        def entry_iq4xs(x: T.Buffer(xshape, "float32"), qw: T.Buffer((nt, nb, TILE_ROWS, 16), "uint8"),
                       sc: T.Buffer((nt, nsb, TILE_ROWS), "float16"), ssc: T.Buffer((nt, nb, TILE_ROWS), "int8"),
                       y: T.Buffer(yshape, "float32")):
            T.func_attr(attrs)
            kernel(x, qw, None, sc, None, ssc, None, y)

        return entry_iq4xs

    if q3k:
        @T.prim_func(private=True)
        def entry_q3k(x: T.Buffer(xshape, "float32"), qw: T.Buffer((nt, nb // 2, TILE_ROWS, 16), "uint8"),
                     qh: T.Buffer((nt, nb, TILE_ROWS, 4), "uint8"), sc: T.Buffer((nt, nsb, TILE_ROWS), "float16"),
                     ssc: T.Buffer((nt, 2 * nb, TILE_ROWS), "int8"), y: T.Buffer(yshape, "float32")):
            T.func_attr(attrs)
            kernel(x, qw, qh, sc, None, ssc, None, y)

        return entry_q3k

    if q2k:
        @T.prim_func(private=True)
        def entry_q2k(x: T.Buffer(xshape, "float32"), qw: T.Buffer((nt, nb // 2, TILE_ROWS, 16), "uint8"),
                     sc: T.Buffer((nt, nsb, TILE_ROWS), "float16"), mn: T.Buffer((nt, nsb, TILE_ROWS), "float16"),
                     ssc: T.Buffer((nt, 2 * nb, TILE_ROWS), "uint8"), y: T.Buffer(yshape, "float32")):
            T.func_attr(attrs)
            kernel(x, qw, None, sc, mn, ssc, None, y)

        return entry_q2k

    if q5k:
        @T.prim_func(private=True)
        def entry_q5k(x: T.Buffer(xshape, "float32"), qw: T.Buffer((nt, nb, TILE_ROWS, 16), "uint8"),
                     qh: T.Buffer((nt, nb, TILE_ROWS, 4), "uint8"),
                     sc: T.Buffer((nt, nsb, TILE_ROWS), "float16"), mn: T.Buffer((nt, nsb, TILE_ROWS), "float16"),
                     ssc: T.Buffer((nt, nb, TILE_ROWS), "uint8"), smn: T.Buffer((nt, nb, TILE_ROWS), "uint8"),
                     y: T.Buffer(yshape, "float32")):
            T.func_attr(attrs)
            kernel(x, qw, qh, sc, mn, ssc, smn, y)

        return entry_q5k

    if q4k:
        @T.prim_func(private=True)
        def entry_q4k(x: T.Buffer(xshape, "float32"), qw: T.Buffer((nt, nb, TILE_ROWS, 16), "uint8"),
                     sc: T.Buffer((nt, nsb, TILE_ROWS), "float16"), mn: T.Buffer((nt, nsb, TILE_ROWS), "float16"),
                     ssc: T.Buffer((nt, nb, TILE_ROWS), "uint8"), smn: T.Buffer((nt, nb, TILE_ROWS), "uint8"),
                     y: T.Buffer(yshape, "float32")):
            T.func_attr(attrs)
            kernel(x, qw, None, sc, mn, ssc, smn, y)

        return entry_q4k

    @T.prim_func(private=True)
    def entry_q6k(x: T.Buffer(xshape, "float32"), qw: T.Buffer((nt, nb, TILE_ROWS, 16), "uint8"),
                 qh: T.Buffer((nt, nb // 2, TILE_ROWS, 16), "uint8"), sc: T.Buffer((nt, nsb, TILE_ROWS), "float16"),
                 ssc: T.Buffer((nt, 2 * nb, TILE_ROWS), "int8"), y: T.Buffer(yshape, "float32")):
        T.func_attr(attrs)
        kernel(x, qw, qh, sc, None, ssc, None, y)

    return entry_q6k
