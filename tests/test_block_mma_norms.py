"""toolchain/block_mma_norms.py: `decode`'s RMSNorms between two one-row block calls are shared by
them (the residual add writes the norm's statistics, the reader scales by them), and nothing else
changes.

Here (no GPU): the pass after the epilogues pass on a real CUDA export of a tiny Q4_1 GGUF (every
norm but the first layer's, whose input is the embedding, shared; the batched and prompt functions
untouched), and on small hand-built Relax functions for what it must leave alone. The functions'
values are test_gpu_block_mma.py's (on a GPU); the model's tokens test_gpu_quantized.py's bf16
cases.
"""
from __future__ import annotations

import pytest

pytest.importorskip("tvm", reason="the pass is part of the compiler")

import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from test_block_mma_epilogues import _calls, _ops, exported  # noqa: E402,F401  (exported: the fixture)
from vtool.toolchain.block_mma_epilogues import block_mma_epilogues_pass  # noqa: E402
from vtool.toolchain.block_mma_norms import block_mma_norms_pass  # noqa: E402

BF16 = "bfloat16"


@pytest.fixture(scope="module")
def passes(exported):  # noqa: F811 - the fixture imported above
    """(the module after the epilogues pass, the same after the norms pass, its layer count)."""
    mod, layers = exported
    epilogues = block_mma_epilogues_pass()(mod)
    return epilogues, block_mma_norms_pass()(epilogues), layers


def _norms(func: relax.Function) -> list[relax.Call]:
    return [v for v in relax.analysis.get_var2val(func).values()
            if isinstance(v, relax.Call) and getattr(v.op, "name", "") == "relax.nn.rms_norm"]


def test_decode_shares_every_norm_after_a_block_call(passes) -> None:
    before, after, layers = passes
    func = after["decode"]
    kinds = [s.removeprefix("vtool_block_mma_q4_1") for s, _ in _calls(func) if s.startswith("vtool_block_mma_q4_1")]
    # layer 0's q|k|v reads the norm of the embedding (no block call gives it); every other norm
    # comes from the o or down projection's residual add before it
    layer = ["_cast_add_norm_stats", "_prenormed_silu_mul", "_cast_add_norm_stats"]
    assert kinds == ["_cast", *layer] + ["_prenormed_cast", *layer] * (layers - 1)
    # the final norm goes into the lm_head's call (Q8_0 blocks in this file)
    assert [s for s, _ in _calls(func) if not s.startswith("vtool_block_mma_q4_1")] == ["vtool_block_mma_q8_0_prenormed"]
    norms = _norms(before["decode"])
    assert len(_norms(func)) == 1 and len(norms) == 2 * layers + 1
    eps = norms[0].attrs.epsilon
    values = relax.analysis.get_var2val(func)
    producers = {}
    for symbol, inputs in _calls(func):
        if symbol.endswith("_norm_stats"):  # x, parts, residual, then the next norm's weight
            assert any(inputs[-1].same_as(n.args[1]) for n in norms), f"{symbol} takes no norm's weight"
        if "_prenormed" in symbol:  # the producer's normed row and statistics, then epsilon
            normed, stats = values[inputs[0]], values[inputs[1]]
            assert (normed.index, stats.index) == (2, 3) and normed.tuple_value.same_as(stats.tuple_value)
            producer = str(values[normed.tuple_value].args[0].global_symbol)
            assert producer.endswith("_cast_add_norm_stats")
            producers[normed.tuple_value] = producer
            assert float(inputs[2].value) == pytest.approx(eps, rel=1e-6)
    assert len(producers) == 2 * layers  # each producer feeds one reader


def test_the_batched_and_prompt_functions_keep_their_norms(passes) -> None:
    before, after, _layers = passes
    for name in ("batch_decode", "prefill", "batch_prefill", "batch_verify"):
        tvm.ir.assert_structural_equal(after[name], before[name])


# -- hand-built chains -------------------------------------------------------------------------

def _pair(rows: int = 1, k: int = 64, n: int = 64, axis: int = -1, dtype: str = BF16, norm_read_twice: bool = False,
          partial_read: bool = False, reader: str = "vtool_block_mma_q4_1_cast") -> tvm.IRModule:
    """main(x, res, w, qweight, scale, min, ...): h = cast_add(x, ..., res)[1]; rms_norm(h, w) into
    `reader`; returns the reader's result and h."""
    v = relax.Var
    x, res = v("x", relax.TensorType([rows, k], dtype)), v("res", relax.TensorType([rows, n], dtype))
    w = v("w", relax.TensorType([n if axis == -1 else rows], dtype))
    parts = [v("qw", relax.TensorType([n // 4, k // 32, 4, 16], "uint8")),
             v("sc", relax.TensorType([n // 4, k // 32, 4], "float16")),
             v("mn", relax.TensorType([n // 4, k // 32, 4], "float16"))]
    parts2 = [v("qw2", relax.TensorType([n // 4, n // 32, 4, 16], "uint8")),
              v("sc2", relax.TensorType([n // 4, n // 32, 4], "float16")),
              v("mn2", relax.TensorType([n // 4, n // 32, 4], "float16"))]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, res, w, *parts, *parts2]):
        with bb.dataflow():
            outs = [relax.TensorType([1, rows, n], "float32"), relax.TensorType([rows, n], dtype)]
            add = bb.emit(relax.op.call_dps_packed("vtool_block_mma_q4_1_cast_add", relax.Tuple([x, *parts, res]),
                                                   out_ty=outs))
            h = bb.emit(relax.TupleGetItem(add, 1))
            y = bb.emit(relax.op.nn.rms_norm(h, w, axes=[axis], epsilon=1e-6))
            mm = bb.emit(relax.op.call_dps_packed(reader, relax.Tuple([y, *parts2]), out_ty=outs))
            out = bb.emit(relax.TupleGetItem(mm, 1))
            if norm_read_twice:
                out = bb.emit(relax.op.add(out, y))
            if partial_read:
                out = bb.emit(relax.op.add(out, relax.op.astype(relax.op.sum(bb.emit(relax.TupleGetItem(add, 0)),
                                                                            axis=[0]), dtype)))
            gv = bb.emit_output(relax.Tuple([out, h]))
        bb.emit_func_output(gv)
    return bb.get()


def test_a_one_row_pair_shares_the_norm() -> None:
    after = block_mma_norms_pass()(_pair())
    calls = _calls(after["main"])
    params = after["main"].params
    assert [s for s, _ in calls] == ["vtool_block_mma_q4_1_cast_add_norm_stats", "vtool_block_mma_q4_1_prenormed_cast"]
    (_p, producer), (_r, reader) = calls
    assert all(a.same_as(b) for a, b in zip(producer, [params[0], *params[3:6], params[1], params[2]]))
    assert float(reader[2].value) == pytest.approx(1e-6) and all(a.same_as(b) for a, b in zip(reader[3:], params[6:]))
    assert "relax.nn.rms_norm" not in _ops(after["main"])


@pytest.mark.parametrize("case", [dict(rows=2), dict(norm_read_twice=True), dict(partial_read=True), dict(axis=0),
                                  dict(dtype="float32"), dict(reader="vtool_block_mma_q4_1_cast_add")],
                         ids=["two rows", "norm read twice", "partial sums read", "not the last axis", "float32",
                              "a residual add reads it"])
def test_what_the_pair_cannot_share_stays(case: dict) -> None:
    mod = _pair(**case)
    tvm.ir.assert_structural_equal(block_mma_norms_pass()(mod), mod)
