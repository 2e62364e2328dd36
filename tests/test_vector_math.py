"""The CPU builds' exp, sigmoid, tanh, erf, sin and cos (schedules/cpu/vector_math.py) against
numpy's (scipy's erf), in float64 as the truth, over the whole float32 range, its edges and special values; compiled
both as scalar loops and as 16-lane vectors, the way the schedules emit them."""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import erf as scipy_erf

from vtool.schedules.cpu.vector_math import EXP_MAX, EXP_MIN, vectorizable_math

N = 4096
SPECIAL = [np.inf, -np.inf, np.nan, 0.0, -0.0, EXP_MAX, EXP_MIN, np.nextafter(np.float32(EXP_MAX), np.float32(np.inf)),
           np.nextafter(np.float32(EXP_MIN), np.float32(-np.inf)), 88.0, -87.0, 1e-30, -1e-30, 1e-3, -1e-3]

TRUTH = {
    "exp": lambda x: np.exp(x.astype(np.float64)),
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x.astype(np.float64))),
    "tanh": lambda x: np.tanh(x.astype(np.float64)),
    "erf": lambda x: scipy_erf(x.astype(np.float64)),
    "sin": lambda x: np.sin(x.astype(np.float64)),
    "cos": lambda x: np.cos(x.astype(np.float64)),
}


def _kernel(name: str, lanes: int, rewrite: bool = True):  # noqa: ANN202 - a compiled TVM module
    import tvm

    return tvm.compile(_kernel_func(name, lanes, rewrite), target=tvm.target.Target({"kind": "llvm"}))


def _kernel_func(name: str, lanes: int, rewrite: bool = True):  # noqa: ANN202 - a PrimFunc
    from tvm import s_tir, te

    a = te.placeholder((N,), "float32", name="a")
    b = te.compute((N,), lambda i: getattr(te, name)(a[i]), name="b")
    func = te.create_prim_func([a, b])
    if rewrite:
        rewritten = vectorizable_math(func)
        assert rewritten is not None, f"{name} was not rewritten"
        func = rewritten
    sch = s_tir.Schedule(func)
    if lanes > 1:
        (i,) = sch.get_loops(sch.get_sblock("b"))
        _, inner = sch.split(i, [None, lanes])
        sch.vectorize(inner)
    return sch.mod["main"]


_BUILT: dict = {}


def _run(name: str, lanes: int, x: np.ndarray, rewrite: bool = True) -> np.ndarray:
    import tvm

    key = (name, lanes, rewrite)
    if key not in _BUILT:
        _BUILT[key] = _kernel(name, lanes, rewrite)
    padded = np.zeros(N, np.float32)
    padded[:len(x)] = x
    out = tvm.runtime.tensor(np.zeros(N, np.float32))
    _BUILT[key]["main"](tvm.runtime.tensor(padded), out)
    return out.numpy()[:len(x)]


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(7)
    wide = rng.uniform(-110, 110, N // 2)
    narrow = rng.standard_normal(N // 2 - len(SPECIAL)) * 4
    return np.concatenate([wide, narrow, SPECIAL]).astype(np.float32)


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in units of the float32 spacing at want, where want is a normal float32."""
    want32 = want.astype(np.float32)
    return np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want32)).astype(np.float64)


@pytest.mark.parametrize("lanes", [1, 16])
@pytest.mark.parametrize("name", ["exp", "sigmoid"])
def test_exp_and_sigmoid_are_within_two_ulp(name: str, lanes: int):
    x = _inputs()
    with np.errstate(over="ignore"):
        want = TRUTH[name](x)
    got = _run(name, lanes, x)
    with np.errstate(over="ignore"):
        want32 = want.astype(np.float32)
    normal = np.isfinite(want32) & (np.abs(want32) >= np.finfo(np.float32).tiny)
    assert normal.sum() > N // 2
    assert _ulps(got[normal], want[normal]).max() <= 2.0
    # where the true value is not a normal float32: NaN stays NaN, overflow is inf, and a
    # subnormal comes out as a subnormal or 0 (flushed), never anything larger
    rest = ~normal
    np.testing.assert_array_equal(np.isnan(got[rest]), np.isnan(x[rest]))
    big = rest & np.isinf(want32)
    assert np.all(got[big] == np.inf)
    small = rest & ~np.isnan(x) & (np.abs(want32) < np.finfo(np.float32).tiny)
    assert np.all(np.abs(got[small]) < np.finfo(np.float32).tiny)


@pytest.mark.parametrize("lanes", [1, 16])
def test_tanh_is_as_close_as_tvms_own_lowering(lanes: int):
    """TVM writes tanh as (1 - e^-2|x|) / (1 + e^-2|x|) around libm's exp; the rewrite keeps the
    formula, so near 0 both lose the same relative precision (an absolute error of about an
    ulp of 1), and elsewhere both are within a few ulp."""
    x = _inputs()
    want = TRUTH["tanh"](x)
    got, tvms = _run("tanh", lanes, x), _run("tanh", lanes, x, rewrite=False)
    finite = ~np.isnan(x)
    assert np.abs(got[finite] - want[finite]).max() <= 1.5 * np.spacing(np.float32(1))
    assert np.abs(got[finite] - want[finite]).max() <= 1.5 * np.abs(tvms[finite] - want[finite]).max() + 1e-12
    away_from_zero = finite & (np.abs(x) > 0.5)
    assert _ulps(got[away_from_zero], want[away_from_zero]).max() <= 4.0
    assert np.isnan(got[~finite]).all()


@pytest.mark.parametrize("lanes", [1, 16])
def test_erf_is_within_three_ulp(lanes: int):
    """Everywhere (the series below |x| = 0.75, the fitted tail above, 1 from 4), with a dense
    sweep over where it is not 1, both sides of the split, and the special values: NaN stays
    NaN, the infinities give +-1, -0 gives -0."""
    from vtool.schedules.cpu.vector_math import ERF_ONE, ERF_SPLIT

    edges = [ERF_SPLIT, np.nextafter(np.float32(ERF_SPLIT), np.float32(0)), ERF_ONE,
             np.nextafter(np.float32(ERF_ONE), np.float32(0))]
    x = _inputs()
    x[: N // 2] = np.linspace(-4.5, 4.5, N // 2)
    x[N // 2: N // 2 + 8] = edges + [-e for e in edges]
    got, want = _run("erf", lanes, x), TRUTH["erf"](x)
    normal = ~np.isnan(x) & (np.abs(want.astype(np.float32)) >= np.finfo(np.float32).tiny)
    assert _ulps(got[normal], want[normal]).max() <= 3.0
    assert np.isnan(got[np.isnan(x)]).all()
    np.testing.assert_array_equal(got[np.isinf(x)], np.sign(x[np.isinf(x)]))
    zeros = x == 0
    np.testing.assert_array_equal(np.signbit(got[zeros]), np.signbit(x[zeros]))


@pytest.mark.parametrize("lanes", [1, 16])
@pytest.mark.parametrize("name", ["sin", "cos"])
def test_sin_and_cos_are_within_one_ulp_over_any_rotary_angle(name: str, lanes: int):
    """Angles as rotary embeddings make them (position x frequency, up to 2e5 rad), small ones,
    and quadrant edges: within 1 ulp where the value is not near 0 (float64 inside, one rounding:
    measured 0.52), within an ulp of 1 near 0; NaN and the infinities give NaN."""
    rng = np.random.default_rng(3)
    edges = np.float32(np.pi / 4) * np.arange(-12, 13, dtype=np.float32)
    x = np.concatenate([rng.uniform(-2e5, 2e5, N // 2), rng.uniform(-8, 8, N // 4), edges,
                        [np.inf, -np.inf, np.nan, 0.0, 1e-30, -1e-30, 1e-4]]).astype(np.float32)
    x = np.concatenate([x, rng.uniform(-100, 100, N - len(x))]).astype(np.float32)
    with np.errstate(invalid="ignore"):
        want = TRUTH[name](x)
    got = _run(name, lanes, x)
    finite = np.isfinite(x)
    assert np.abs(got[finite] - want[finite]).max() <= np.spacing(np.float32(1))
    away = finite & (np.abs(want) > 1e-3)
    assert _ulps(got[away], want[away]).max() <= 1.0
    assert np.isnan(got[~finite]).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=-200, max_value=200, width=32), min_size=1, max_size=64))
def test_sigmoid_stays_in_the_unit_interval_and_monotone(values):
    x = np.sort(np.asarray(values, np.float32))
    got = _run("sigmoid", 16, x)
    assert np.all((got >= 0) & (got <= 1))
    assert np.all(np.diff(got) >= 0)


def test_other_dtypes_and_ops_are_left_alone():
    from tvm import te

    a = te.placeholder((8,), "float64", name="a")
    func = te.create_prim_func([a, te.compute((8,), lambda i: te.exp(a[i]), name="b")])
    assert vectorizable_math(func) is None
    f = te.placeholder((8,), "float32", name="f")
    func = te.create_prim_func([f, te.compute((8,), lambda i: te.log(f[i]) + te.sqrt(f[i]), name="g")])
    assert vectorizable_math(func) is None


def test_a_cpu_builds_silu_kernel_has_no_libm_exp(tiny_shape_dir):
    """Through the CPU schedule pass, the decoder's silu * mul kernel carries no exp or sigmoid
    call for LLVM to split into libm calls."""
    import tvm
    from tvm import tirx

    from vtool.schedules import rules_for
    from vtool.toolchain.tune import extract_kernels

    _, target, mod = extract_kernels(tiny_shape_dir("llama-gqa"), "x86-avx2", "float32", "none")
    silu = [gv for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc) and "silu" in gv.name_hint]
    assert silu
    assert any("sigmoid" in mod[gv].script() or "exp" in mod[gv].script() for gv in silu)
    with target:
        scheduled = rules_for("cpu")(tvm.IRModule(dict(mod.functions_items())))
    for gv in silu:
        func = next(f for g, f in scheduled.functions_items() if g.name_hint == gv.name_hint)
        text = func.script()
        assert "T.sigmoid" not in text and "T.exp(" not in text, gv.name_hint
        # and TVM's lowering keeps its feature loop a vector loop
        assert _lowered_is_vector(func.with_attr("global_symbol", "main"), target), gv.name_hint


def _lowered_is_vector(func, target) -> bool:  # noqa: ANN001 - a PrimFunc, a Target
    """Whether TVM's TIR pipeline kept the `T.vectorized` loop of `func` a vector loop. Its
    VectorizeLoop turns a loop whose body holds anything it cannot widen (T.isnan did) into a
    scalar loop, with no message; LLVM then vectorized the loop or not depending on what else
    the module held (the default model's prefill silu * mul stayed scalar: 6% of a prompt)."""
    import tvm

    mod = tvm.tirx.transform.BindTarget(target.with_host(target))(tvm.IRModule({"main": func}))
    pipeline, _, _ = tvm.tirx.get_tir_pipeline("default")
    text = pipeline(mod)["main"].script()
    return "T.Ramp" in text and not re.search(r"\bfor \w+_s\b|, \w+_s in T\.grid", text)


@pytest.mark.parametrize("name", ["exp", "sigmoid", "tanh", "erf", "sin", "cos"])
def test_the_rewrite_keeps_a_vectorized_loop_a_vector_loop(name: str):
    import tvm

    func = _kernel_func(name, 16)
    assert _lowered_is_vector(func, tvm.target.Target({"kind": "llvm", "mcpu": "haswell"}))


def test_attention_kernels_keep_their_tanh():
    """A kernel with a `sm_scale` parameter (an attention kernel: Gemma-2's soft-capped scores)
    is left alone; rewritten, TVM's simplifier took up to a minute to compile one."""
    from tvm import te

    a = te.placeholder((8,), "float32", name="a")
    sm_scale = te.var("sm_scale", "float32")
    capped = te.compute((8,), lambda i: te.tanh(a[i] * sm_scale), name="b")
    assert vectorizable_math(te.create_prim_func([a, capped, sm_scale])) is None
    plain = te.compute((8,), lambda i: te.tanh(a[i]), name="c")
    assert vectorizable_math(te.create_prim_func([a, plain])) is not None


def _half_store_func(name: str, out_dtype: str):  # noqa: ANN202 - a PrimFunc
    """b[i] = out_dtype(name(a[i] * 2) + 1), float32 inside."""
    from tvm import te

    a = te.placeholder((64,), "float32", name="a")
    b = te.compute((64,), lambda i: (getattr(te, name)(a[i] * 2.0) + 1.0).astype(out_dtype), name="b")
    return te.create_prim_func([a, b])


def _vectorized(func):  # noqa: ANN001, ANN202 - PrimFunc -> PrimFunc
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    (i,) = sch.get_loops(sch.get_sblock("b"))
    sch.vectorize(sch.split(i, [None, 16])[1])
    return sch.mod["main"]


@pytest.mark.parametrize("name", ["exp", "tanh", "sin"])
def test_calls_rounded_to_bfloat16_keep_libm_and_compile(name: str):
    """A call whose result is cast to bfloat16 is not rewritten: TVM's bfloat16 legalization
    copies the cast's operand, and a copied Let chain made VectorizeLoop fail ("Let cannot bind
    the same var to two different values"; every bfloat16 CPU build failed). Rewritten, the
    kernel fails to compile; kept, it compiles and rounds libm's value. float16 (a native LLVM
    cast) is still rewritten."""
    import ml_dtypes
    import tvm

    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
    func = _half_store_func(name, "bfloat16")
    assert vectorizable_math(func) is None
    assert vectorizable_math(_half_store_func(name, "float16")) is not None
    with pytest.raises(Exception, match="Let cannot bind the same var"):  # what the rule avoids
        tvm.compile(_vectorized(_rewrite_ignoring_the_rule(func)), target=target)
    lib = tvm.compile(_vectorized(func), target=target)
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    out = tvm.runtime.tensor(np.zeros(64, ml_dtypes.bfloat16))
    lib["main"](tvm.runtime.tensor(x), out)
    want = (TRUTH[name](x * 2) + 1).astype(np.float32).astype(ml_dtypes.bfloat16)
    got = out.numpy()
    # one bfloat16 step apart at most (libm's float32 value, then one rounding)
    assert np.all(np.abs(got.astype(np.float64) - want.astype(np.float64)) <= np.abs(want.astype(np.float64)) * 2**-7)


def _rewrite_ignoring_the_rule(func):  # noqa: ANN001, ANN202 - PrimFunc -> PrimFunc
    """func with every call rewritten, the bfloat16 rule ignored (to show what it prevents)."""
    import tvm
    import tvm_ffi

    from vtool.schedules.cpu import vector_math

    def rewrite(call):  # noqa: ANN001, ANN202
        make = vector_math._REWRITES.get(call.op) if isinstance(call.op, tvm.ir.Op) else None
        return make(call.args[0]) if make is not None else call

    return tvm_ffi.structural_map(func, [(tvm.ir.Call, rewrite)])
