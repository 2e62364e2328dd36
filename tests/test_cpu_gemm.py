"""schedules/cpu/matmul.py: the NT matmul rule's two schedules (rows of W in vectors for few
rows of A; the packed register-tiled micro-kernel from GEMM_MIN_ROWS rows, chosen per call for
a symbolic row count, and for two symbolic leading dims), each against numpy on the host, with
a fused epilogue and row counts either side of the switch and not whole tiles. Each check runs
for every instruction set this CPU can execute (AVX-512: 16 lanes, AVX2: 8); the AVX-512 tile
choice is also checked where its code cannot run (structure only)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tvm = pytest.importorskip("tvm")
from tvm import te, tirx  # noqa: E402

from vtool.schedules.cpu.matmul import GEMM_MIN_ROWS, schedule_nt_matmul  # noqa: E402
from vtool.targets.host import host_cpu_features  # noqa: E402

# isa -> (the LLVM target, float32 lanes, the CPU flags its code needs)
ISAS = {"avx512": ({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2}, 16, {"avx512f", "avx512bw", "avx512vl"}),
        "avx2": ({"kind": "llvm", "mcpu": "haswell", "num-cores": 2}, 8, {"avx2", "fma"})}
RUNNABLE = [isa for isa, (_target, _lanes, needs) in ISAS.items() if needs <= set(host_cpu_features())]


def runs_here(isa: str) -> bool:
    return isa in RUNNABLE


def _func(rows: int | None, n: int, k: int, lead: int = 1) -> tirx.PrimFunc:
    """(A [lead.., rows, k], W [n, k], bias [n]) -> A . W^T + bias, rows symbolic when None;
    lead=2: A [2, rows, k] and no epilogue (an encoder's projections over [batch, length])."""
    m = tirx.Var("m", "int64") if rows is None else rows
    shape = (2, m) if lead == 2 else (m,)
    a = te.placeholder((*shape, k), "float32", name="A")
    w = te.placeholder((n, k), "float32", name="W")
    b = te.placeholder((n,), "float32", name="B")
    r = te.reduce_axis((0, k), "k")
    c = te.compute((*shape, n), lambda *i: te.sum(a[(*i[:-1], r)] * w[i[-1], r], axis=r), name="NT_matmul")
    if lead == 2:
        return te.create_prim_func([a, w, c]).with_attr("global_symbol", "main")
    d = te.compute((*shape, n), lambda *i: c[i] + b[i[-1]], name="T_add")
    return te.create_prim_func([a, w, b, d]).with_attr("global_symbol", "main")


def _build(func: tirx.PrimFunc, isa: str):
    spec, lanes, _needs = ISAS[isa]
    target = tvm.target.Target(spec)
    scheduled = schedule_nt_matmul(func, lanes)
    assert scheduled is not None
    with target:
        return scheduled, tvm.compile(tvm.IRModule({"main": scheduled}), target=target)


@pytest.fixture(params=RUNNABLE, scope="module")
def isa(request) -> str:
    return request.param


def _check(lib, rows: int, n: int, k: int, lead: int = 1, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    shape = (2, rows) if lead == 2 else (rows,)
    a = rng.standard_normal((*shape, k)).astype("float32")
    w = rng.standard_normal((n, k)).astype("float32")
    b = rng.standard_normal(n).astype("float32") if lead == 1 else np.zeros(n, "float32")
    out = tvm.runtime.tensor(np.full((*shape, n), np.nan, "float32"))
    inputs = (a, w, b) if lead == 1 else (a, w)
    lib["main"](*(tvm.runtime.tensor(x) for x in inputs), out)
    want = a.astype(np.float64) @ w.T.astype(np.float64) + b
    np.testing.assert_allclose(out.numpy(), want, atol=2e-5 * np.sqrt(k) * 4, rtol=1e-5)


@pytest.fixture(scope="module")
def symbolic(isa):
    return _build(_func(None, 64, 576), isa)  # 576: the k block is 192 (not 128)


def test_symbolic_rows_get_both_schedules_chosen_per_call(symbolic):
    root = symbolic[0].body.block
    assert isinstance(root.body, tirx.IfThenElse)  # rows >= GEMM_MIN_ROWS: the micro-kernel
    assert "A_pad" in root.body.then_case.script() and "A_pad" not in root.body.else_case.script()
    assert tirx.analysis.verify_ssa(symbolic[0])


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 3 * GEMM_MIN_ROWS), seed=st.integers(0, 2**16))
def test_symbolic_rows_match_numpy(symbolic, rows, seed):
    _check(symbolic[1], rows, 64, 576, seed=seed)


@pytest.mark.parametrize("rows", [GEMM_MIN_ROWS - 1, GEMM_MIN_ROWS, GEMM_MIN_ROWS + 7])
def test_symbolic_rows_either_side_of_the_switch(symbolic, rows):
    _check(symbolic[1], rows, 64, 576)


def _panel(scheduled: tirx.PrimFunc) -> int | None:
    """The micro-kernel's packed panel width (outputs per panel), or None without one."""
    packed = [b for b in scheduled.body.block.alloc_buffers if b.name == "W_global"]
    return int(packed[0].shape[-1]) if packed else None


@pytest.mark.parametrize("rows", [7, GEMM_MIN_ROWS - 1, GEMM_MIN_ROWS, 2 * GEMM_MIN_ROWS + 1])
def test_static_rows_take_the_schedule_for_their_size(rows, isa):
    scheduled, lib = _build(_func(rows, 96, 256), isa)
    assert (_panel(scheduled) is not None) == (rows >= GEMM_MIN_ROWS)
    _check(lib, rows, 96, 256)


@pytest.mark.parametrize("n, rows, panel", [(96, 40, 48), (96, 64, 48), (64, 36, 32), (64, 60, 32), (96, 41, 48)])
def test_the_tile_follows_the_outputs_and_whole_tiles_need_no_padding(n, rows, panel):
    """AVX-512: 8 x 3-vector tiles where the outputs are a multiple of 48, else 6 x 2 (32). Static
    rows that are whole tiles (40 and 64 of 8, 36 and 60 of 6) are neither padded nor cropped,
    and the bias still follows the matmul (run where AVX-512 code can run)."""
    scheduled, lib = _build(_func(rows, n, 256), "avx512")
    assert _panel(scheduled) == panel
    tile_rows = 8 if panel == 48 else 6
    assert ("A_pad" in scheduled.script()) == (rows % tile_rows != 0)
    if runs_here("avx512"):
        _check(lib, rows, n, 256)


@pytest.mark.parametrize("n, rows", [(96, 36), (64, 60), (48, 41)])
def test_avx2_has_one_tile_6_by_2(n, rows):
    """AVX2's 16 registers hold only the 6 x 2-vector tile (a panel of 16 outputs)."""
    scheduled, lib = _build(_func(rows, n, 256), "avx2")
    assert _panel(scheduled) == 16
    assert ("A_pad" in scheduled.script()) == (rows % 6 != 0)
    if runs_here("avx2"):
        _check(lib, rows, n, 256)


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 2 * GEMM_MIN_ROWS), seed=st.integers(0, 2**16))
def test_two_symbolic_leading_dims_take_the_micro_kernel_at_every_size(two_leading, rows, seed):
    scheduled, lib = two_leading
    assert "A_pad" in scheduled.script()  # the row schedule cannot fuse them
    _check(lib, rows, 32, 192, lead=2, seed=seed)  # rows not a whole tile: the padded tail


@pytest.fixture(scope="module")
def two_leading(isa):
    return _build(_func(None, 32, 192, lead=2), isa)


def test_an_epilogue_chain_goes_into_both_schedules(isa):
    """matmul -> bias add -> GELU (an encoder's intermediate layer): every block of the chain
    moves into the tiles, so both bodies of the run-time choice hold no block in common."""
    m = tirx.Var("m", "int64")
    a = te.placeholder((1, m, 128), "float32", name="A")
    w = te.placeholder((64, 128), "float32", name="W")
    b = te.placeholder((64,), "float32", name="B")
    r = te.reduce_axis((0, 128), "k")
    c = te.compute((1, m, 64), lambda x, i, j: te.sum(a[x, i, r] * w[j, r], axis=r), name="NT_matmul")
    d = te.compute((1, m, 64), lambda x, i, j: c[x, i, j] + b[j], name="T_add")
    e = te.compute((1, m, 64), lambda x, i, j: d[x, i, j] * 0.5 * (1 + tirx.erf(d[x, i, j] * 0.7071067811865476)),
                   name="T_gelu")
    scheduled, lib = _build(te.create_prim_func([a, w, b, e]).with_attr("global_symbol", "main"), isa)
    assert isinstance(scheduled.body.block.body, tirx.IfThenElse)
    rng = np.random.default_rng(1)
    for rows in (5, 70):
        x = rng.standard_normal((1, rows, 128)).astype("float32")
        wt = rng.standard_normal((64, 128)).astype("float32")
        bias = rng.standard_normal(64).astype("float32")
        out = tvm.runtime.tensor(np.zeros((1, rows, 64), "float32"))
        lib["main"](*(tvm.runtime.tensor(v) for v in (x, wt, bias)), out)
        y = x.astype(np.float64) @ wt.T.astype(np.float64) + bias
        from scipy.special import erf

        np.testing.assert_allclose(out.numpy(), y * 0.5 * (1 + erf(y / np.sqrt(2))), atol=2e-4, rtol=1e-5)


def test_a_batched_decode_step_tiles_its_batch_not_its_unit_dim(isa):
    """[batch, 1, k] rows (one new position per sequence): the tiles run over the batch; padding
    the unit dim to a tile would multiply the work by six."""
    m = tirx.Var("m", "int64")
    a = te.placeholder((m, 1, 128), "float32", name="A")
    w = te.placeholder((64, 128), "float32", name="W")
    r = te.reduce_axis((0, 128), "k")
    c = te.compute((m, 1, 64), lambda i, x, j: te.sum(a[i, x, r] * w[j, r], axis=r), name="NT_matmul")
    scheduled, lib = _build(te.create_prim_func([a, w, c]).with_attr("global_symbol", "main"), isa)
    pads = [buf for buf in scheduled.body.block.alloc_buffers if buf.name == "A_pad"]
    assert pads and int(pads[0].shape[1]) == 1, pads
    rng = np.random.default_rng(2)
    for rows in (3, 40):
        x = rng.standard_normal((rows, 1, 128)).astype("float32")
        wt = rng.standard_normal((64, 128)).astype("float32")
        out = tvm.runtime.tensor(np.zeros((rows, 1, 64), "float32"))
        lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(wt), out)
        np.testing.assert_allclose(out.numpy(), x.astype(np.float64) @ wt.T.astype(np.float64), atol=2e-4, rtol=1e-5)


def test_outputs_not_a_whole_panel_keep_the_row_schedule(isa):
    scheduled, lib = _build(_func(None, 36, 128), isa)  # 36 outputs: no whole panel (32 or 16)
    assert "A_pad" not in scheduled.script()
    _check(lib, 50, 36, 128)
