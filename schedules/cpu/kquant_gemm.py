"""Integer-dot GEMMs over kept K-quant (Q2_K..Q6_K) and IQ4_XS blocks with Q8_K activation rows (x86),
register-tiled over rows of x: prompts (`--activations q8_0`), batched decode and speculative verification.

The GEMVs (schedules/cpu/kquant_gemv.py) make one pass over a weight tile per row of x, so
every weight block is loaded and unpacked (nibbles split, fifth/high bits or-ed in, levels
looked up, sub-block scales widened) once per row. Here a pass takes ROWS rows of x (the
last M % ROWS rows one pass of exactly that many): each block is unpacked once and meets
every row of the pass from registers, like int8_gemv.py's Q8_0-family GEMM.

Per 32-weight block b of a tile's vector of weight rows (4 rows on avx512vnni, one zmm; 2 on
avx2, one ymm, the tile in two halves), per row i of the pass (X: x's 16 bytes of the half
block, one vbroadcasti32x4 / vbroadcasti128 load from the quantized row, no replicated copy):

  Q4_K, Q5_K  acc_i += pairs(maddubs(lo, X0) + maddubs(hi, X1)) * sub-scale      (per 32)
  Q2_K        acc_i += pairs(maddubs(q, X0)) * sc(2b) + pairs(maddubs(q', X1)) * sc(2b+1)  (per 16)
  Q6_K, Q3_K  acc_i += the same over x + 128 (unsigned, stored so by the quantizer) times
              the signed w = q - 32 (Q3_K: q - 4). The +128 adds 128 * sum(w) * sc, which
              does not depend on x: it is summed once per pass (`bias`) and taken out per
              super-block, so the offset costs no instruction per row (the GEMV spends two
              vpmaddubsw on it). |(x + 128) w| pairs <= 2 * 255 * 32: no saturation.
  IQ4_XS      acc_i += pairs(maddubs(|L|, X with L's sign)) * sub-scale, the halves apart

`pairs(p) * s` is vpdpwssd on avx512vnni (the AVX-512 VNNI int16 dot, one instruction: acc +
p[2j] s[2j] + p[2j+1] s[2j+1]) and vpmaddwd + vpaddd on avx2. Per 256-weight super-block:
facc_i += float(acc_i) * d_w * d_x, and for Q4_K/Q5_K/Q2_K the min: the rows' mins (per 32,
Q2_K per 16), transposed once per pass, times the activation row's per-32 (per-16) sums
(llama.cpp's Q8_K bsums, made with the quantization) in one vpmaddwd per row (two for Q2_K),
the lanes of 4 rows reduced together by shuffle-adds and scaled as one vector.

Every integer sum here is exact and lands in the same vector lane as in the GEMV, and the
float arithmetic is the GEMV's, in the same order: each row of the GEMM equals the GEMV of
that row bit for bit (tests/test_kquant_gemm.py holds it), so prompts, batched decode and
verification keep decode's numerics. The Q8_K quantization of the rows is kquant_gemv's.

Loop nest: x quantized once (rows in parallel); then panels of rows of x (PANEL_BYTES of quantized
rows, so that a panel stays in L2 while every weight tile passes over it); in a panel, weight tiles
in parallel, each tile's passes over the panel's rows.

Measured on a 2-core Xeon (AVX-512 VNNI, AMX), one thread, [1536, 1536] x 512 rows, other jobs
running: 83-117 GMAC/s with the avx512vnni code (Q4_K 114, Q6_K 117), 46-79 with the avx2 code,
against 37-41 on the float path (dequantize + float GEMM). One GEMV pass per row (kquant_gemv's
gemm_func, what prompts took before) was slower than the float path (2 threads: 29-62 against 40-85).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from vtool.runtime.weights.ggml_blocks import BLOCK, SUPER_BLOCK, TILE_ROWS
from vtool.schedules.cpu.kquant_gemv import (PER_SUPER, PREFETCH_TILES, _maddubs, _maddwd, _per_row, _prefetch,
                                            _quants, _scales16, _two_bits, entry_point, iq4_levels, signed_pairs)

FORMATS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # = kquant_gemv.FORMATS (a test holds it)
ISAS = ("avx512vnni", "avx2")
# Rows of x per pass over a weight vector. AVX-512: per row an int32 and a float32 accumulator
# (zmm; the min terms of 4 rows share one more): 8 rows take 18 of the 32 registers, the unpacked
# block and the rows' x the rest. Measured on a 2-core Xeon (AVX-512 VNNI, AMX), one thread,
# [1536, 1536] x 512 rows: Q6_K 96 -> 129 GMAC/s from 6 rows to 8, Q4_K level (125-129); LLVM
# splits many vpdpwssd into vpmaddwd + vpaddd (its machine combiner, unless the target has the
# fast-dpwssd tuning: +10% on Q4_K here), fewest in the 8-row pass. AVX2 (16 ymm, a tile in two
# halves, accumulators partly on the stack): 6 rows, against 2, 3, 4 (Q4_K 67 against 57-61, Q6_K
# 38 against 22-32 GMAC/s, the same run).
ROWS = {"avx512vnni": 8, "avx2": 6}
MAX_ROWS = 8
# Bytes of quantized x rows per panel (rounded down to whole passes): every weight tile of the
# matmul passes over one panel before the next, so a panel should stay in the L2 cache.
PANEL_BYTES = 1 << 20
_VPDPWSSD = "llvm.x86.avx512.vpdpwssd.512"
GROUP = 4  # rows of x whose min terms are reduced and scaled together (MAX_ROWS <= 2 * GROUP)


def _group(count: int, g: int) -> int:
    """Rows in group g of a pass of `count` rows."""
    return min(GROUP, count - g * GROUP)


def _check(fmt: str, isa: str, n: int, k: int) -> None:
    if fmt not in FORMATS or isa not in ISAS:
        raise ValueError(f"no Q8_K-activation GEMM for {fmt} on {isa}")
    if n % TILE_ROWS or k % SUPER_BLOCK:
        raise ValueError(f"K-quant GEMM needs n % {TILE_ROWS} == 0 and k % {SUPER_BLOCK} == 0, got [{n}, {k}]")


def gemm_func(fmt: str, isa: str, n: int, k: int, lead: tuple, rows: int | None = None,
              panel_bytes: int = PANEL_BYTES) -> tirx.PrimFunc:
    """x float32 of shape `lead` + [k] (symbolic dims as TIR vars) times a kept [n, k] weight of
    `fmt` -> float32 `lead` + [n]. Parameters: x, the weight's parts in ggml_blocks.parts order,
    y (as kquant_gemv.gemv_func's). `rows`: rows of x per pass (default ROWS[isa])."""
    _check(fmt, isa, n, k)
    rows = ROWS[isa] if rows is None else rows
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be 1..{MAX_ROWS}, got {rows}")
    return _build(fmt, isa, n, k, tuple(lead), rows, max(rows, panel_bytes // k // rows * rows))


def _bcast16(xq: tirx.Buffer, row: tirx.PrimExpr, col: tirx.PrimExpr, lanes: int, dtype: str) -> tirx.PrimExpr:
    """16 bytes of quantized row `row` from column `col`, repeated in each 128-bit lane (one
    broadcast load): x meets every weight row of the vector the same way."""
    v = xq.vload([row, col], "int8x16")
    b = T.Shuffle([v] * (lanes // 16), [j % 16 for j in range(lanes)])
    return b if dtype == "int8" else T.reinterpret(f"{dtype}x{lanes}", b)


def _dp(isa: str, acc: tirx.PrimExpr, p: tirx.PrimExpr, s: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
    """acc (int32) + pairs of int16 p times int16 s: vpdpwssd, or vpmaddwd and an add."""
    if isa == "avx512vnni":
        return T.call_llvm_pure_intrin("int32x16", _VPDPWSSD, acc, p, s)
    return acc + _maddwd(isa, p, s, lanes)


def _build(fmt: str, isa: str, n: int, k: int, dims: tuple, chunk: int, panel: int) -> tirx.PrimFunc:
    nb, nsb, nt = k // BLOCK, k // SUPER_BLOCK, n // TILE_ROWS
    vnni = isa == "avx512vnni"
    lanes = 64 if vnni else 32  # bytes per weight vector
    rows_v = lanes // 16  # weight rows per vector: 4 (the tile) or 2 (half of it)
    halves = TILE_ROWS // rows_v
    al = 4 * rows_v  # int32 / float32 accumulator lanes: 4 per weight row
    q4k = fmt in ("Q4_K", "Q5_K")
    q5k = fmt == "Q5_K"
    q3k, q2k, q6k = fmt == "Q3_K", fmt == "Q2_K", fmt == "Q6_K"
    iq4 = fmt == "IQ4_XS"
    has_min = fmt in ("Q4_K", "Q5_K", "Q2_K")
    offset = {"Q6_K": 32, "Q3_K": 4}.get(fmt, 0)  # w = q - offset, met by x + 128
    xtype = "uint8" if offset else "int8"
    xshape, yshape = dims + (k,), dims + (n,)
    m = 1
    for d in dims:
        m = m * d
    static = isinstance(m, int)
    npanels = (m + panel - 1) // panel
    attrs = {"tirx.noalias": True, "vtool.int8_gemv": f"{fmt}/{isa}"}
    u8 = f"uint8x{lanes}"
    qh_t = f"uint8x{4 * rows_v}"
    sc_t = f"{'uint8' if q2k else 'int8'}x{rows_v}"
    f32 = f"float32x{al}"
    nbs = 2 * nb if q2k else nb  # activation sums: per 16 (Q2_K's mins) or per 32
    per_s = nbs // nsb  # mins (and sums) per super-block: 16 or 8
    zero_i = T.Broadcast(T.int32(0), al)
    flip = T.int8(-128) if offset else T.int8(0)

    def x16(xq, row, b, second):  # noqa: ANN001, ANN202
        return _bcast16(xq, row, b * BLOCK + 16 * second, lanes, xtype)

    def scale32(ssc, t, b, h, dtype):  # noqa: ANN001, ANN202 - a vector's rows' scale per 32, as int16 per pair
        return _per_row(T.Cast(f"int16x{rows_v}", ssc.vload([t, b, h * rows_v], f"{dtype}x{rows_v}")), rows_v, 8)

    def scale16(ssc, t, c, h):  # noqa: ANN001, ANN202 - per 16 (Q6_K, Q3_K, Q2_K)
        return _per_row(_scales16(ssc.vload([t, c, h * rows_v], sc_t), rows_v, q2k), rows_v, 8)

    def signed(v):  # noqa: ANN001, ANN202 - uint8 q - offset as int8
        return T.reinterpret(f"int8x{lanes}", v - T.Broadcast(T.uint8(offset), lanes))

    def q6(qw, qh, t, b, g, h, shift, high):  # noqa: ANN001, ANN202 - Q6_K's 6-bit quants, - 32
        v = qw.vload([t, b, h * rows_v, 0], u8)
        low = v >> T.Broadcast(T.uint8(4), lanes) if high else v & T.Broadcast(T.uint8(15), lanes)
        top = ((qh.vload([t, g, h * rows_v, 0], u8) >> T.Broadcast(T.uint8(shift + 2 * high), lanes))
               & T.Broadcast(T.uint8(3), lanes)) << T.Broadcast(T.uint8(4), lanes)
        return signed(low | top)

    def q3(qw, qh, t, b, g, h, shift, high):  # noqa: ANN001, ANN202 - Q3_K's / Q2_K's 2- or 3-bit quants
        q = _two_bits(qw.vload([t, g, h * rows_v, 0], u8), shift + 2 * high, lanes,
                      qh.vload([t, b, h * rows_v, 0], qh_t) if q3k else None, high, rows_v)
        return signed(q) if q3k else q

    def mins_t(src, t, s, h):  # noqa: ANN001, ANN202
        """The super-block's mins of the vector's rows, transposed to int16 [row][min], in
        groups of rows filling one vector of int16 each (the sums' layout: [min] per row)."""
        groups = []
        rows_g = (lanes // 2) // per_s  # rows per int16 vector: 4 or 2 (per 32), 2 or 1 (per 16)
        raw = src.vload([t, s * per_s, 0], f"uint8x{per_s * TILE_ROWS}")
        for g in range(rows_v // rows_g):
            pick = [c * TILE_ROWS + h * rows_v + g * rows_g + r for r in range(rows_g) for c in range(per_s)]
            v = T.Shuffle([raw], pick)
            if q2k:  # Q2_K's byte: sc | m << 4
                v = v >> T.Broadcast(T.uint8(4), len(pick))
            groups.append(T.Cast(f"int16x{len(pick)}", v))
        return groups, rows_g

    def min_sums(src, bs, t, s, h, first, rows):  # noqa: ANN001, ANN202
        """int32 [x row][weight row] for `rows` (static) rows of x from `first`: the sum over the
        super-block's mins m * (x's sum under it). One vpmaddwd per x row and weight-row group
        gives `gsz` lanes per weight row; pairwise shuffle-adds over all the rows' vectors at once
        reduce them (exact integers: any order is the GEMV's sum)."""
        groups, rows_g = mins_t(src, t, s, h)
        vecs = []
        for i in range(rows):
            sums = bs.vload([first + i, s * per_s], f"int16x{per_s}")
            rep = T.Shuffle([sums] * rows_g, [j % per_s for j in range(per_s * rows_g)])
            vecs += [_maddwd(isa, g, rep, lanes) for g in groups]
        width = len(vecs) * (lanes // 4)
        v = T.Shuffle(vecs, list(range(width))) if len(vecs) > 1 else vecs[0]
        gsz = per_s // 2  # int32 lanes per weight row
        while gsz > 1:
            v = T.Shuffle([v], list(range(0, width, 2))) + T.Shuffle([v], list(range(1, width, 2)))
            width, gsz = width // 2, gsz // 2
        return v

    def min_corr(src, bs, mn, xd, corr, t, s, h, first, g, rows):  # noqa: ANN001, ANN202
        """corr[g] + float(min_sums) * dmin * d_x for rows g*GROUP .. of the pass (GEMV's order)."""
        w = rows * rows_v
        dmin = T.Cast(f"float32x{rows_v}", mn.vload([t, s, h * rows_v], f"float16x{rows_v}"))
        dx = T.Shuffle([T.Broadcast(xd[first + g * GROUP + i, s], rows_v) for i in range(rows)], list(range(w)))
        return corr[g, T.Ramp(0, 1, w)] + T.Cast(f"float32x{w}", min_sums(
            src, bs, t, s, h, first + g * GROUP, rows)) * T.Shuffle([dmin] * rows, [j % rows_v for j in range(w)]) * dx

    @T.macro
    def quantize_row(x1, xq, xd, bs, row):  # noqa: ANN001 - TVMScript macro
        # Q8_K, as kquant_gemv.py's quantize_row (llama.cpp's quantize_row_q8_K_ref): the same
        # operations, so the same quants and d_x
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
                # Q6_K, Q3_K: x + 128 (the sign bit flipped), vpmaddubsw's unsigned side
                xq[row, s * SUPER_BLOCK + j] = T.Cast("int8", T.min(
                    T.round(iscale * x1[row * k + s * SUPER_BLOCK + j]), T.float32(127))) ^ flip
            xd[row, s] = T.if_then_else(amax[0] > T.float32(0), T.float32(1) / iscale, T.float32(0))
        if has_min:  # the activation sums the mins meet (llama.cpp's bsums): per 32, Q2_K per 16
            for c in range(nbs):
                qsum = T.alloc_buffer((1,), "int32")
                qsum[0] = 0
                for j in range(k // nbs):
                    qsum[0] = qsum[0] + T.Cast("int32", xq[row, c * (k // nbs) + j])
                bs[row, c] = T.Cast("int16", qsum[0])

    @T.macro
    def rows_pass(qw, qh, sc, mn, ssc, smn, y1, xq, xd, bs, t, h, first, count):  # noqa: ANN001 - TVMScript macro
        # `count` (static) rows of x from `first` against weight vector h of tile t. Small global
        # allocations become stack slots that LLVM keeps in registers (int8_gemv.py's rows_pass).
        facc = T.alloc_buffer((count, al), "float32")
        iacc = T.alloc_buffer((count, al), "int32")
        corr = T.alloc_buffer(((count + GROUP - 1) // GROUP, GROUP * rows_v), "float32")  # [x row][weight row]
        bias = T.alloc_buffer((al,), "int32")
        for i in T.unroll(count):
            facc[i, T.Ramp(0, 1, al)] = T.Broadcast(T.float32(0), al)
        for g in T.unroll((count + GROUP - 1) // GROUP):
            corr[g, T.Ramp(0, 1, GROUP * rows_v)] = T.Broadcast(T.float32(0), GROUP * rows_v)
        for s in range(nsb):
            for i in T.unroll(count):
                iacc[i, T.Ramp(0, 1, al)] = zero_i
            bias[T.Ramp(0, 1, al)] = zero_i
            if q4k:
                for j in T.unroll(PER_SUPER):
                    _prefetch(T.address_of(qw[t + PREFETCH_TILES, s * PER_SUPER + j, 0, 0]))
                    if q5k and j % 4 == 0:
                        _prefetch(T.address_of(qh[t + PREFETCH_TILES, s * PER_SUPER + j, 0, 0]))
                    for i in T.unroll(count):
                        iacc[i, T.Ramp(0, 1, al)] = _dp(isa, iacc[i, T.Ramp(0, 1, al)], _maddubs(
                            isa, _quants(qw.vload([t, s * PER_SUPER + j, h * rows_v, 0], u8), lanes, False,
                                         qh.vload([t, s * PER_SUPER + j, h * rows_v, 0], qh_t) if q5k else None,
                                         rows_v),
                            x16(xq, first + i, s * PER_SUPER + j, 0), lanes) + _maddubs(
                            isa, _quants(qw.vload([t, s * PER_SUPER + j, h * rows_v, 0], u8), lanes, True,
                                         qh.vload([t, s * PER_SUPER + j, h * rows_v, 0], qh_t) if q5k else None,
                                         rows_v),
                            x16(xq, first + i, s * PER_SUPER + j, 1), lanes),
                            scale32(ssc, t, s * PER_SUPER + j, h, "uint8"), lanes)
            elif iq4:
                for j in T.unroll(PER_SUPER):
                    _prefetch(T.address_of(qw[t + PREFETCH_TILES, s * PER_SUPER + j, 0, 0]))
                    for i in T.unroll(count):
                        iacc[i, T.Ramp(0, 1, al)] = _dp(isa, _dp(isa, iacc[i, T.Ramp(0, 1, al)], signed_pairs(
                            isa, iq4_levels(isa, _quants(qw.vload([t, s * PER_SUPER + j, h * rows_v, 0], u8), lanes,
                                                         False, None, rows_v), lanes),
                            x16(xq, first + i, s * PER_SUPER + j, 0), lanes),
                            scale32(ssc, t, s * PER_SUPER + j, h, "int8"), lanes), signed_pairs(
                            isa, iq4_levels(isa, _quants(qw.vload([t, s * PER_SUPER + j, h * rows_v, 0], u8), lanes,
                                                         True, None, rows_v), lanes),
                            x16(xq, first + i, s * PER_SUPER + j, 1), lanes),
                            scale32(ssc, t, s * PER_SUPER + j, h, "int8"), lanes)
            elif q6k:
                # block pairs: one 64-weight group of qhigh, its 2-bit fields at bits 0..3, then 4..7
                for j in T.unroll(PER_SUPER):
                    if j % 2 == 0:
                        _prefetch(T.address_of(qh[t + PREFETCH_TILES, s * 4 + j // 2, 0, 0]))
                    _prefetch(T.address_of(qw[t + PREFETCH_TILES, s * PER_SUPER + j, 0, 0]))
                    for i in T.unroll(count):
                        iacc[i, T.Ramp(0, 1, al)] = _dp(isa, _dp(isa, iacc[i, T.Ramp(0, 1, al)], _maddubs(
                            isa, x16(xq, first + i, s * PER_SUPER + j, 0),
                            q6(qw, qh, t, s * PER_SUPER + j, s * 4 + j // 2, h, 4 * (j % 2), 0), lanes),
                            scale16(ssc, t, 2 * (s * PER_SUPER + j), h), lanes), _maddubs(
                            isa, x16(xq, first + i, s * PER_SUPER + j, 1),
                            q6(qw, qh, t, s * PER_SUPER + j, s * 4 + j // 2, h, 4 * (j % 2), 1), lanes),
                            scale16(ssc, t, 2 * (s * PER_SUPER + j) + 1, h), lanes)
                    bias[T.Ramp(0, 1, al)] = _dp(isa, _dp(isa, bias[T.Ramp(0, 1, al)], _maddubs(
                        isa, T.Broadcast(T.uint8(128), lanes),
                        q6(qw, qh, t, s * PER_SUPER + j, s * 4 + j // 2, h, 4 * (j % 2), 0), lanes),
                        scale16(ssc, t, 2 * (s * PER_SUPER + j), h), lanes), _maddubs(
                        isa, T.Broadcast(T.uint8(128), lanes),
                        q6(qw, qh, t, s * PER_SUPER + j, s * 4 + j // 2, h, 4 * (j % 2), 1), lanes),
                        scale16(ssc, t, 2 * (s * PER_SUPER + j) + 1, h), lanes)
            else:
                # Q3_K, Q2_K: block pairs, one 64-weight group of 2-bit quants (bits 0..3, then 4..7)
                for j in T.unroll(PER_SUPER):
                    if j % 2 == 0:
                        _prefetch(T.address_of(qw[t + PREFETCH_TILES, s * 4 + j // 2, 0, 0]))
                    if q3k and j % 4 == 0:
                        _prefetch(T.address_of(qh[t + PREFETCH_TILES, s * PER_SUPER + j, 0, 0]))
                    for i in T.unroll(count):
                        iacc[i, T.Ramp(0, 1, al)] = _dp(isa, _dp(isa, iacc[i, T.Ramp(0, 1, al)], _maddubs(
                            isa, x16(xq, first + i, s * PER_SUPER + j, 0),
                            q3(qw, qh, t, s * PER_SUPER + j, s * 4 + j // 2, h, 4 * (j % 2), 0), lanes)
                            if q3k else _maddubs(
                            isa, q3(qw, qh, t, s * PER_SUPER + j, s * 4 + j // 2, h, 4 * (j % 2), 0),
                            x16(xq, first + i, s * PER_SUPER + j, 0), lanes),
                            scale16(ssc, t, 2 * (s * PER_SUPER + j), h), lanes), _maddubs(
                            isa, x16(xq, first + i, s * PER_SUPER + j, 1),
                            q3(qw, qh, t, s * PER_SUPER + j, s * 4 + j // 2, h, 4 * (j % 2), 1), lanes)
                            if q3k else _maddubs(
                            isa, q3(qw, qh, t, s * PER_SUPER + j, s * 4 + j // 2, h, 4 * (j % 2), 1),
                            x16(xq, first + i, s * PER_SUPER + j, 1), lanes),
                            scale16(ssc, t, 2 * (s * PER_SUPER + j) + 1, h), lanes)
                    if q3k:
                        bias[T.Ramp(0, 1, al)] = _dp(isa, _dp(isa, bias[T.Ramp(0, 1, al)], _maddubs(
                            isa, T.Broadcast(T.uint8(128), lanes),
                            q3(qw, qh, t, s * PER_SUPER + j, s * 4 + j // 2, h, 4 * (j % 2), 0), lanes),
                            scale16(ssc, t, 2 * (s * PER_SUPER + j), h), lanes), _maddubs(
                            isa, T.Broadcast(T.uint8(128), lanes),
                            q3(qw, qh, t, s * PER_SUPER + j, s * 4 + j // 2, h, 4 * (j % 2), 1), lanes),
                            scale16(ssc, t, 2 * (s * PER_SUPER + j) + 1, h), lanes)
            # d_w (float16, one per row of the super-block) x d_x, once per 256 weights: the
            # GEMV's expression, lane for lane
            for i in T.unroll(count):
                facc[i, T.Ramp(0, 1, al)] = facc[i, T.Ramp(0, 1, al)] + T.Cast(
                    f32, iacc[i, T.Ramp(0, 1, al)] - bias[T.Ramp(0, 1, al)]) * _per_row(
                    T.Cast(f"float32x{rows_v}", sc.vload([t, s, h * rows_v], f"float16x{rows_v}")), rows_v, 4
                ) * T.Broadcast(xd[first + i, s], al)
            if has_min:  # the rows' min terms, GROUP rows at a time
                corr[0, T.Ramp(0, 1, _group(count, 0) * rows_v)] = min_corr(
                    ssc if q2k else smn, bs, mn, xd, corr, t, s, h, first, 0, _group(count, 0))
                if count > GROUP:
                    corr[1, T.Ramp(0, 1, _group(count, 1) * rows_v)] = min_corr(
                        ssc if q2k else smn, bs, mn, xd, corr, t, s, h, first, 1, _group(count, 1))
        for i in T.unroll(count):
            for r in range(rows_v):
                y1[(first + i) * n + t * TILE_ROWS + h * rows_v + r] = (
                    facc[i, r * 4] + facc[i, r * 4 + 1] + facc[i, r * 4 + 2] + facc[i, r * 4 + 3]
                    - corr[i // GROUP, (i % GROUP) * rows_v + r])

    @T.macro
    def passes(qw, qh, sc, mn, ssc, smn, y1, xq, xd, bs, t, h, p):  # noqa: ANN001 - TVMScript macro
        # weight vector h (static) of tile t over panel p's rows: whole passes, then the rest (only
        # in the last panel) in one pass of exactly that many, each count its own unrolled code
        for c in range(T.min(m - p * panel, panel) // chunk):
            rows_pass(qw, qh, sc, mn, ssc, smn, y1, xq, xd, bs, t, h, p * panel + c * chunk, chunk)
        if chunk > 1:
            if T.min(m - p * panel, panel) % chunk == 1:
                rows_pass(qw, qh, sc, mn, ssc, smn, y1, xq, xd, bs, t, h, m - 1, 1)
        if chunk > 2:
            if T.min(m - p * panel, panel) % chunk == 2:
                rows_pass(qw, qh, sc, mn, ssc, smn, y1, xq, xd, bs, t, h, m - 2, 2)
        if chunk > 3:
            if T.min(m - p * panel, panel) % chunk == 3:
                rows_pass(qw, qh, sc, mn, ssc, smn, y1, xq, xd, bs, t, h, m - 3, 3)
        if chunk > 4:
            if T.min(m - p * panel, panel) % chunk == 4:
                rows_pass(qw, qh, sc, mn, ssc, smn, y1, xq, xd, bs, t, h, m - 4, 4)
        if chunk > 5:
            if T.min(m - p * panel, panel) % chunk == 5:
                rows_pass(qw, qh, sc, mn, ssc, smn, y1, xq, xd, bs, t, h, m - 5, 5)
        if chunk > 6:
            if T.min(m - p * panel, panel) % chunk == 6:
                rows_pass(qw, qh, sc, mn, ssc, smn, y1, xq, xd, bs, t, h, m - 6, 6)
        if chunk > 7:
            if T.min(m - p * panel, panel) % chunk == 7:
                rows_pass(qw, qh, sc, mn, ssc, smn, y1, xq, xd, bs, t, h, m - 7, 7)

    @T.macro
    def kernel(x, qw, qh, sc, mn, ssc, smn, y):  # noqa: ANN001 - TVMScript macro
        x1 = T.decl_buffer((m * k,), "float32", data=x.data)
        y1 = T.decl_buffer((m * n,), "float32", data=y.data)
        xq = T.alloc_buffer((m, k), "int8")
        xd = T.alloc_buffer((m, nsb), "float32")
        bs = T.alloc_buffer((m, nbs if has_min else 1), "int16")
        if static:
            for row in range(m):
                quantize_row(x1, xq, xd, bs, row)
        else:
            for row in T.parallel(m):
                quantize_row(x1, xq, xd, bs, row)
        for p in range(npanels):
            for t in T.parallel(nt):
                passes(qw, qh, sc, mn, ssc, smn, y1, xq, xd, bs, t, 0, p)
                if halves == 2:  # avx2: the tile's second pair of rows
                    passes(qw, qh, sc, mn, ssc, smn, y1, xq, xd, bs, t, 1, p)

    return entry_point(fmt, kernel, xshape, yshape, nt, nb, nsb, attrs)
