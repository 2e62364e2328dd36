"""toolchain/block_mma_epilogues.py: the casts, residual adds and SiLU x up after the batched-decode
block matmuls go to the matmuls' own finishing kernels, and nothing else changes.

Here (no GPU): the pass on a real CUDA export of a tiny Q4_1 GGUF (every layer's four matmuls
fused in `batch_decode` and in `decode`, whose one row the functions' GEMV takes; the prompt
functions untouched; the residual each add read passed on), and on small hand-built Relax
functions for the chains it must leave alone. The kernels' values against torch are
test_gpu_block_mma.py's (on a GPU); the model's batches against its prompt path are
test_gpu_quantized.py's bf16 batch cases.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("tvm", reason="the pass is part of the compiler")

import tvm  # noqa: E402
from tvm import relax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from vtool.toolchain.block_mma_epilogues import block_mma_epilogues_pass  # noqa: E402

BF16 = "bfloat16"


def _block_bindings(func: relax.Function) -> list[relax.Binding]:
    """The bindings of every call_dps_packed of a vtool block matmul, in order."""
    found = []
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and \
                    value.op.name == "relax.call_dps_packed" and "vtool_block_mma" in str(value.args[0].global_symbol):
                found.append(binding)
    return found


def _calls(func: relax.Function) -> list[tuple[str, list[relax.Expr]]]:
    """(symbol, inputs) of every vtool block matmul call, in order."""
    return [(str(b.value.args[0].global_symbol), list(b.value.args[1].fields)) for b in _block_bindings(func)]


def _ops(func: relax.Function) -> list[str]:
    return [b.value.op.name for blk in func.body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The Relax module of a bf16 sm_90a build of a tiny Q4_1 GGUF (three layers), before the
    pipeline, and its layer count."""
    from quant_gguf import VARIANTS, write_tiny_gguf

    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.toolchain.build import model_module
    from vtool.toolchain.plan import BuildOptions, check_request, resolve_plan

    qtype_of, tie, _kept, shape = VARIANTS["q4_1"]
    path = write_tiny_gguf(tmp_path_factory.mktemp("q4_1") / "m.gguf", qtype_of, tie=tie, shape=shape)
    options = BuildOptions(dtype=BF16, quantization="gguf", attention="tir")
    spec = check_request("sm_90a", options)
    plan = resolve_plan(open_checkpoint(path), spec, options, notice=lambda _msg: None)
    _target, mod, _params, _entries = model_module(plan.config, spec, BF16, lambda _msg: None, dict(plan.kept),
                                                   attention="tir", activations="none", gemm=plan.gemm)
    return mod, plan.config.num_hidden_layers


@pytest.mark.parametrize("entry", ["batch_decode", "decode"])
def test_every_layers_four_matmuls_finish_in_their_own_kernel(exported, entry: str) -> None:
    """batch_decode's matmuls (the tensor cores) and decode's (one sequence: the same functions,
    whose single row goes through their GEMV)."""
    mod, layers = exported
    before = _calls(mod[entry])
    assert {s for s, _ in before} <= {"vtool_block_mma_q4_1", "vtool_block_mma_q8_0"} and len(before) >= 4 * layers
    after_mod = block_mma_epilogues_pass()(mod)
    after = _calls(after_mod[entry])
    kinds = [s.removeprefix("vtool_block_mma_q4_1") for s, _ in after if s.startswith("vtool_block_mma_q4_1")]
    # per layer: q|k|v (cast, then attention's reshape), o (+ residual), gate|up (SiLU x up), down (+ residual)
    assert kinds == ["_cast", "_cast_add", "_silu_mul", "_cast_add"] * layers
    ops = _ops(after_mod[entry])
    assert "relax.nn.silu" not in ops and "relax.add" not in ops and "relax.split" not in ops
    # each fused call reads the matmul's own inputs (the same x and parts, in order) ...
    for (old_symbol, old_inputs), (new_symbol, new_inputs) in zip(
            [c for c in before if c[0].endswith("q4_1")], [c for c in after if "q4_1" in c[0]]):
        assert new_symbol.startswith(old_symbol)
        assert all(a.same_as(b) for a, b in zip(old_inputs, new_inputs))
        assert len(new_inputs) == len(old_inputs) + (new_symbol.endswith("_cast_add"))
    # ... and the prompt functions do not change
    for name in ("prefill", "batch_prefill"):
        tvm.ir.assert_structural_equal(after_mod[name], mod[name])


def _partial_splits(func: relax.Function) -> list[int]:
    """The leading dim (splits) of the partial-sum scratch of each block call in `func`."""
    return [int(b.var.ty.fields[0].shape[0]) for b in _block_bindings(func)]


def test_one_sequence_reads_no_partial_sums(exported) -> None:
    """decode's block calls get a partial scratch of one split (their GEMV does not write it);
    batch_decode's keep block_mma_splits' counts (the tiny model's k is split in some)."""
    mod, _layers = exported
    one = _partial_splits(mod["decode"])
    assert one and set(one) == {1}, one
    assert max(_partial_splits(mod["batch_decode"])) > 1


def test_the_residual_is_the_stream_the_add_read(exported) -> None:
    mod, _layers = exported
    func = block_mma_epilogues_pass()(mod)["batch_decode"]
    values = relax.analysis.get_var2val(func)
    adds = [(s, inputs) for s, inputs in _calls(func) if s.endswith("_cast_add")]
    # layer 0's o projection adds to the embeddings; every later add to the previous add's result
    assert adds[0][1][-1].same_as(func.params[0])
    for (_s, inputs), (_prev_s, _prev_inputs) in zip(adds[1:], adds):
        producer = values[inputs[-1]]
        assert isinstance(producer, relax.TupleGetItem) and "_cast_add" in str(values[producer.tuple_value].args[0].global_symbol)


# -- hand-built chains -------------------------------------------------------------------------

def _chain(tail: str, rows: int = 2, n: int = 16, k: int = 64) -> tvm.IRModule:
    """main(x, qweight, scale, min, h): a Q4_1 block matmul whose result `tail` finishes."""
    x = relax.Var("x", relax.TensorType([rows, k], BF16))
    qw = relax.Var("qw", relax.TensorType([n // 4, k // 32, 4, 16], "uint8"))
    sc = relax.Var("sc", relax.TensorType([n // 4, k // 32, 4], "float16"))
    mn = relax.Var("mn", relax.TensorType([n // 4, k // 32, 4], "float16"))
    h = relax.Var("h", relax.TensorType([rows, n], BF16))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, qw, sc, mn, h]):
        with bb.dataflow():
            outs = [relax.TensorType([3, rows, n], "float32"), relax.TensorType([rows, n], "float32")]
            mm = bb.emit(relax.op.call_dps_packed("vtool_block_mma_q4_1", relax.Tuple([x, qw, sc, mn]), out_ty=outs))
            y = bb.emit(relax.TupleGetItem(mm, 1))
            if tail == "partial read":  # the scratch is read: the call must stay as it is
                y = bb.emit(relax.op.add(y, relax.op.sum(bb.emit(relax.TupleGetItem(mm, 0)), axis=[0])))
            if tail == "float read twice":
                out = bb.emit(relax.op.add(relax.op.astype(y, BF16), relax.op.astype(y, BF16)))
            else:
                c = bb.emit(relax.op.astype(y, BF16))
                if tail in ("add", "partial read"):
                    out = bb.emit(relax.op.add(h, c))
                elif tail == "add twice":  # the cast feeds two adds: finished as a cast, read by both
                    out = bb.emit(relax.op.add(bb.emit(relax.op.add(h, c)), c))
                elif tail == "broadcast add":
                    out = bb.emit(relax.op.add(c, relax.op.strided_slice(h, [0], [0], [1])))
                elif tail in ("silu", "gelu", "three parts"):
                    parts = bb.emit(relax.op.split(c, 3 if tail == "three parts" else 2, axis=-1))
                    gate, up = bb.emit(relax.TupleGetItem(parts, 0)), bb.emit(relax.TupleGetItem(parts, 1))
                    act = relax.op.nn.silu(gate) if tail != "gelu" else relax.op.nn.gelu_tanh(gate)
                    out = bb.emit(relax.op.multiply(bb.emit(act), up))
                else:
                    out = c
            result = bb.emit_output(out)
        bb.emit_func_output(result)
    return bb.get()


@pytest.mark.parametrize("tail, symbol", [
    ("add", "vtool_block_mma_q4_1_cast_add"),
    ("silu", "vtool_block_mma_q4_1_silu_mul"),
    ("cast", "vtool_block_mma_q4_1_cast"),
    ("add twice", "vtool_block_mma_q4_1_cast"),
    ("broadcast add", "vtool_block_mma_q4_1_cast"),
    ("gelu", "vtool_block_mma_q4_1_cast"),
    ("three parts", "vtool_block_mma_q4_1_cast"),
    ("float read twice", "vtool_block_mma_q4_1"),
    ("partial read", "vtool_block_mma_q4_1"),
])
def test_chains_it_fuses_and_chains_it_leaves(tail: str, symbol: str) -> None:
    mod = _chain(tail)
    out = block_mma_epilogues_pass()(mod)
    assert [s for s, _ in _calls(out["main"])] == [symbol]
    if symbol == "vtool_block_mma_q4_1":
        tvm.ir.assert_structural_equal(out, mod)
    # the function still returns what it returned, in type
    tvm.ir.assert_structural_equal(out["main"].ret_ty, mod["main"].ret_ty)


def test_silu_mul_returns_half_the_columns() -> None:
    out = block_mma_epilogues_pass()(_chain("silu", rows=5, n=24))["main"]
    call = next(b.value for blk in out.body.blocks for b in blk.bindings if isinstance(b.value, relax.Call)
                and isinstance(b.value.op, tvm.ir.Op) and b.value.op.name == "relax.call_dps_packed")
    partial_ty, out_ty = call.ty.fields
    assert [int(d) for d in partial_ty.shape] == [3, 5, 24] and partial_ty.dtype == "float32"
    assert [int(d) for d in out_ty.shape] == [5, 12] and out_ty.dtype == BF16
