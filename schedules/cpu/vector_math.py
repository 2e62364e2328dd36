"""float32 exp, sigmoid, tanh, erf, sin and cos for CPU kernels as arithmetic the vectorizer
keeps in vector registers.

TVM's LLVM lowering turns `exp` (and `sigmoid` and `tanh`, which it writes with exp) into
`llvm.exp`, and with no vector math library LLVM splits a vector exp into one libm `expf`
call per lane. A decode step's silu * mul over 1536 features took 9.7 us that way on the
2-core Xeon (6 ns a feature), 30 times a step for the default model: about 4% of its
decode step, and more of a prompt's. Here each such call becomes Cephes' expf: n =
round(x / ln 2), r = x - n ln 2 in two parts (Cody-Waite, so r keeps its low bits), e^r by
a degree-6 polynomial, 2^n put in the exponent bits of two factors; within 2 ulp of libm's expf for every
float32 (tests/test_vector_math.py). sigmoid(x) = 1 / (1 + e^-x) and tanh as
(1 - e^-2|x|) / (1 + e^-2|x|) with x's sign, the formulas TVM's own lowering uses around
the exp. erf (exact GELU: BERT's feed-forward) was one libm `erff` call per element, 12% of an
all-MiniLM-L6-v2 embedding call: it is now Maclaurin's series below |x| = 0.75 and, above, 1 -
t Q(t) e^-x^2 with t = 1 / (1 + p |x|) (Abramowitz and Stegun 7.1.26's form; Q's six
coefficients fitted here by weighted least squares to erfc(x) e^(x^2) on [0.75, 4], p kept), 1
from |x| = 4 (erfc(4) is under half a float32 spacing of 1); within 3 ulp of the true erf for
every float32 (tests/test_vector_math.py). sin and cos (the rotary embedding's angles, one pair
per element where a model rotates q and k itself: 5% of an EmbeddingGemma call in libm) reduce x
by pi/2 and evaluate a degree-9 odd polynomial for sin and a degree-10 even one for cos on
[-pi/4, pi/4] (coefficients fitted here) in float64, the quadrant picking which and its sign,
then round once: within 0.6 ulp for any angle a position reaches (tested to 2e5 rad). Every kernel of a CPU build goes through this, scheduled by a rule or not, so a
kernel gives the same values however it was scheduled; the attention kernels excepted
(`vectorizable_math`: their soft-cap tanh made TVM's simplifier take up to a minute a kernel).
"""
from __future__ import annotations

import re

import tvm
import tvm_ffi
from tvm import tirx
from tvm.script import tirx as T

_EXP = tvm.ir.Op.get("tirx.exp")
_SIGMOID = tvm.ir.Op.get("tirx.sigmoid")
_TANH = tvm.ir.Op.get("tirx.tanh")
_ERF = tvm.ir.Op.get("tirx.erf")
_SIN = tvm.ir.Op.get("tirx.sin")
_COS = tvm.ir.Op.get("tirx.cos")

LOG2E = 1.44269504088896341
LN2_HI = 0.693359375  # ln 2 = LN2_HI + LN2_LO; LN2_HI has few enough bits that n * LN2_HI is exact
LN2_LO = -2.12194440e-4
EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
            5.0000001201e-1)  # Cephes expf: e^r = 1 + r + r^2 * P(r) on |r| <= ln(2) / 2
# Past these e^x is not a normal float32: above, infinity; below, 0. The true value there is
# subnormal (under 1.2e-38): computing it made a softmax-like input range ten times slower
# (x86 takes a microcode assist per subnormal result), for values no later sum can feel.
EXP_MAX = 88.72283935546875
EXP_MIN = -87.33654022216797
# erf: 2/sqrt(pi) (-1)^n / (n! (2n + 1)), n = 0..8, below ERF_SPLIT (the next term is under 3e-8 there)
ERF_SERIES = (1.128379225730896, -0.37612637877464294, 0.11283791810274124, -0.02686617150902748,
              0.005223977845162153, -0.0008548327023163438, 0.00012055332626914605, -1.4925650248187594e-05,
              1.6462114444948384e-06)
ERF_SPLIT = 0.75
ERF_P = 0.3275911
# erfc(x) e^(x^2) = sum_k ERF_TAIL[k-1] t^k, t = 1 / (1 + ERF_P x), on [ERF_SPLIT, ERF_ONE]: fitted
# to scipy's erfc, weighted by e^(-x^2) (the error it makes in erf), Lawson-reweighted towards
# minimax; fit error 1.1e-9, float32 evaluation within 3 ulp
ERF_TAIL = (0.19802379608154297, 0.08737166225910187, 0.4500819742679596, -0.18739044666290283,
            0.238302543759346, 0.21373368799686432)
ERF_ONE = 4.0
# on [-pi/4, pi/4]: sin r = r + r^3 SIN_POLY(r^2), cos r = 1 - r^2 / 2 + r^4 COS_POLY(r^2), each
# fitted by least squares (Lawson-reweighted to near minimax; fit errors 5e-12 relative, 1e-13),
# evaluated in float64 and rounded once: within 0.6 ulp of the true value
SIN_POLY = (-0.1666666664082013, 0.008333329307468815, -0.00019839313100564808, 2.7181294377385744e-06)
COS_POLY = (0.04166666662285721, -0.0013888883755935172, 2.4799520677040716e-05, -2.7210293041917177e-07)


def _lanes(expr: tirx.PrimExpr) -> int:
    match = re.fullmatch(r"float32(?:x(\d+))?", str(expr.ty))
    if match is None:
        raise ValueError(f"expected a float32 expression, got {expr.ty}")
    return int(match.group(1) or 1)


def _const(value: float, lanes: int, dtype: str = "float32") -> tirx.PrimExpr:
    scalar = tirx.const(value, dtype)
    return scalar if lanes == 1 else T.Broadcast(scalar, lanes)


def _int_const(value: int, lanes: int) -> tirx.PrimExpr:
    return T.int32(value) if lanes == 1 else T.Broadcast(T.int32(value), lanes)


def _typed(base: str, lanes: int) -> str:
    return base if lanes == 1 else f"{base}x{lanes}"


def _let(name: str, value: tirx.PrimExpr, lanes: int, body, dtype: str = "float32") -> tirx.PrimExpr:  # noqa: ANN001 - Var -> PrimExpr
    var = tirx.Var(name, _typed(dtype, lanes))
    return tirx.Let(var, value, body(var))


def _horner(coefficients: tuple[float, ...], x: tirx.PrimExpr, const) -> tirx.PrimExpr:  # noqa: ANN001 - float -> PrimExpr
    """sum_i coefficients[i] x^i, evaluated from the highest power down."""
    value = const(coefficients[-1])
    for coefficient in reversed(coefficients[:-1]):
        value = value * x + const(coefficient)
    return value


def _is_nan(x: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
    """x is a NaN: its magnitude bits above infinity's (0x7f800000). `x != x` would do in C, but
    TVM's simplifier may fold it to false."""
    bits = T.reinterpret(_typed("int32", lanes), x) & _int_const(0x7FFFFFFF, lanes)
    return bits > _int_const(0x7F800000, lanes)


def polynomial_exp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """e^x for a float32 (scalar or vector) expression, as vectorizable arithmetic."""
    lanes = _lanes(x)
    c = lambda v: _const(v, lanes)  # noqa: E731
    int_type = _typed("int32", lanes)

    def power_of_two(n: tirx.PrimExpr) -> tirx.PrimExpr:  # 2^n for an int32 n in [-126, 127]
        return T.reinterpret(_typed("float32", lanes), T.shift_left(n + _int_const(127, lanes), _int_const(23, lanes)))

    def body(xv: tirx.Var) -> tirx.PrimExpr:
        def with_clamped(xc: tirx.Var) -> tirx.PrimExpr:
            def with_n(n: tirx.Var) -> tirx.PrimExpr:
                def with_r(r: tirx.Var) -> tirx.PrimExpr:
                    poly = _horner(EXP_POLY[::-1], r, c)  # EXP_POLY lists the highest power first
                    e_r = poly * r * r + r + c(1.0)
                    # 2^n as two factors: n reaches 128 (x up to EXP_MAX), one past a
                    # normal float's exponent
                    n_int = T.Cast(int_type, n)
                    half = T.shift_right(n_int, _int_const(1, lanes))
                    return e_r * power_of_two(half) * power_of_two(n_int - half)

                return _let("exp_r", (xc - n * c(LN2_HI)) - n * c(LN2_LO), lanes, with_r)

            return _let("exp_n", T.floor(xc * c(LOG2E) + c(0.5)), lanes, with_n)

        value = _let("exp_xc", T.min(T.max(xv, c(EXP_MIN)), c(EXP_MAX)), lanes, with_clamped)
        value = T.Select(xv > c(EXP_MAX), c(float("inf")), value)
        value = T.Select(xv < c(EXP_MIN), c(0.0), value)
        # the clamp would turn a NaN into a number; NaN tested on its bits, as T.isnan has no
        # vector form in TVM's VectorizeLoop, which then made the whole loop scalar
        return T.Select(_is_nan(xv, lanes), xv, value)

    return _let("exp_x", x, lanes, body)


def polynomial_sigmoid(x: tirx.PrimExpr) -> tirx.PrimExpr:
    one = _const(1.0, _lanes(x))
    return one / (one + polynomial_exp(-x))


def polynomial_tanh(x: tirx.PrimExpr) -> tirx.PrimExpr:
    lanes = _lanes(x)
    one = _const(1.0, lanes)

    def body(xv: tirx.Var) -> tirx.PrimExpr:
        def with_e(e: tirx.Var) -> tirx.PrimExpr:
            magnitude = (one - e) / (one + e)
            return T.Select(xv >= _const(0.0, lanes), magnitude, -magnitude)

        return _let("tanh_e", polynomial_exp(_const(-2.0, lanes) * T.max(xv, -xv)), lanes, with_e)

    return _let("tanh_x", x, lanes, body)


def polynomial_erf(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """erf(x) for a float32 (scalar or vector) expression, as vectorizable arithmetic."""
    lanes = _lanes(x)
    c = lambda v: _const(v, lanes)  # noqa: E731

    def body(xv: tirx.Var) -> tirx.PrimExpr:
        def with_a(a: tirx.Var) -> tirx.PrimExpr:  # |x|, at most ERF_ONE
            def with_a2(a2: tirx.Var) -> tirx.PrimExpr:
                series = _horner(ERF_SERIES, a2, c)

                def with_t(t: tirx.Var) -> tirx.PrimExpr:
                    tail = _horner(ERF_TAIL, t, c)
                    return c(1.0) - tail * t * polynomial_exp(-a2)

                def signed(large: tirx.Var) -> tirx.PrimExpr:
                    # the series times x itself: odd, and -0 stays -0
                    return T.Select(a < c(ERF_SPLIT), xv * series, T.Select(xv >= c(0.0), large, -large))

                return _let("erf_large", _let("erf_t", c(1.0) / (c(1.0) + c(ERF_P) * a), lanes, with_t), lanes,
                            signed)

            return _let("erf_a2", a * a, lanes, with_a2)

        value = _let("erf_a", T.min(T.max(xv, -xv), c(ERF_ONE)), lanes, with_a)
        return T.Select(_is_nan(xv, lanes), xv, value)  # the clamp would turn a NaN into 1

    return _let("erf_x", x, lanes, body)


def _sin_or_cos(x: tirx.PrimExpr, shift: int) -> tirx.PrimExpr:
    """sin(x) (shift 0) or cos(x) = sin(x + pi/2) (shift 1) as vectorizable arithmetic: the
    reduction by pi/2 and both polynomials in float64, one rounding to float32 at the end."""
    lanes = _lanes(x)
    d = lambda v: _const(v, lanes, "float64")  # noqa: E731
    let = lambda name, value, body: _let(name, value, lanes, body, "float64")  # noqa: E731

    def body(xd: tirx.Var) -> tirx.PrimExpr:  # x in float64
        def with_k(k: tirx.Var) -> tirx.PrimExpr:  # x / (pi/2), rounded
            def with_r(r: tirx.Var) -> tirx.PrimExpr:
                def with_r2(r2: tirx.Var) -> tirx.PrimExpr:
                    def with_sin(sin_r: tirx.Var) -> tirx.PrimExpr:
                        def with_cos(cos_r: tirx.Var) -> tirx.PrimExpr:
                            # the quadrant, k mod 4 taken in float64 (no int32 overflow for any x)
                            q = T.Cast(_typed("int32", lanes), k - d(4.0) * T.floor(k * d(0.25)))
                            q = (q + _int_const(shift, lanes)) & _int_const(3, lanes)
                            value = T.Select(q == _int_const(0, lanes), sin_r,
                                             T.Select(q == _int_const(1, lanes), cos_r,
                                                      T.Select(q == _int_const(2, lanes), -sin_r, -cos_r)))
                            return T.Cast(_typed("float32", lanes), value)

                        cos_r = d(1.0) - d(0.5) * r2 + r2 * r2 * _horner(COS_POLY, r2, d)
                        return let("trig_cos", cos_r, with_cos)

                    return let("trig_sin", r + r * r2 * _horner(SIN_POLY, r2, d), with_sin)

                return let("trig_r2", r * r, with_r2)

            return let("trig_r", xd - k * d(1.5707963267948966), with_r)

        return let("trig_k", T.floor(xd * d(0.6366197723675814) + d(0.5)), with_k)

    return let("trig_x", T.Cast(_typed("float64", lanes), x), body)


def polynomial_sin(x: tirx.PrimExpr) -> tirx.PrimExpr:
    return _sin_or_cos(x, 0)


def polynomial_cos(x: tirx.PrimExpr) -> tirx.PrimExpr:
    return _sin_or_cos(x, 1)


_REWRITES = {_EXP: polynomial_exp, _SIGMOID: polynomial_sigmoid, _TANH: polynomial_tanh, _ERF: polynomial_erf,
             _SIN: polynomial_sin, _COS: polynomial_cos}


def _calls_rounded_to_bfloat16(func: tirx.PrimFunc) -> list[tvm.ir.Call]:
    """The calls inside a cast to bfloat16. TVM's BF16ComputeLegalize rounds such a cast's
    operand with integer arithmetic that reads it twice, so the operand is copied whole; a
    copied Let chain then binds each of its variables twice, which VectorizeLoop refuses ("Let
    cannot bind the same var to two different values") and CSE mangles ("used before
    definition"). These calls keep libm's scalar functions."""
    inside: list[tvm.ir.Call] = []

    def collect(node: tvm.ir.Call) -> None:
        inside.append(node)

    def on_cast(cast: tirx.Cast) -> None:
        if str(cast.ty).startswith("bfloat16"):
            tvm_ffi.structural_walk(cast.value, [(tvm.ir.Call, collect)])

    tvm_ffi.structural_walk(func.body, [(tirx.Cast, on_cast)])
    return inside


def vectorizable_math(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """`func` with every float32 exp, sigmoid, tanh, erf, sin and cos written as vector arithmetic, or None
    when it has none, or when it is an attention kernel (a `sm_scale` parameter): their only
    such call is a soft-capped score's tanh (Gemma-2), inside masks and the online softmax's
    selects, where TVM's simplifier then took 18-56 s to compile one kernel (against under 2 s).
    Calls whose result is rounded to bfloat16 stay as they are (_calls_rounded_to_bfloat16)."""
    if any(getattr(p, "name", None) == "sm_scale" for p in func.params):
        return None
    hits: list[tvm.ir.Call] = []
    kept = _calls_rounded_to_bfloat16(func)

    def rewrite(call: tvm.ir.Call) -> tirx.PrimExpr:
        make = _REWRITES.get(call.op) if isinstance(call.op, tvm.ir.Op) else None
        if make is None or len(call.args) != 1 or not re.fullmatch(r"float32(x\d+)?", str(call.ty)):
            return call
        if any(call.same_as(k) for k in kept):
            return call
        hits.append(call)
        return make(call.args[0])

    out = tvm_ffi.structural_map(func, [(tvm.ir.Call, rewrite)])
    return out if hits else None
