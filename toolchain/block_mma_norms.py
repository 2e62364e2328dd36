"""One sequence's RMSNorms shared between the block GEMVs around them (native/block_mma.cu's
NormRole), so the norm is no kernel of its own.

In `decode` a Llama-style layer's q|k|v and gate|up matmuls, and the lm_head after the final norm,
read an RMSNorm of the residual stream, and that stream is the residual add of the o or down
projection before it, which toolchain/block_mma_epilogues.py has already put into that
projection's block call (`*_cast_add`). The norm's own kernel (about 2 us, 64 a step for the 8B
shape) goes: the add's call also writes h * w (w the norm's weight) and each thread block's sum of
its rows' squares (`*_cast_add_norm_stats`), and the reading call takes h * w as its x, adds the
block sums and scales its result (`*_prenormed[_cast|_silu_mul]`):

    h = cast_add(x, parts, residual)[1];  y = rms_norm(h, w, eps);  read(y, parts2)
        -> (h, hw, stats) = cast_add_norm_stats(x, parts, residual, w)[1:];
           read_prenormed(hw, stats, eps, parts2)

where both calls get one row of x (static shapes of leading dims 1: `decode`; batched calls keep
the norm), the norm's output is read by that call alone, its axis is the last, and h, w and the norm
share the 16-bit dtype. h itself stays (the next residual add reads it). The first layer's norm
(its input is the embedding, no block call) stays as it is.

Numerics: the reading call multiplies h * w rounded to the dtype by the weights and applies
1 / sqrt(mean square + eps) to its float32 sums; the norm's kernel rounds h * scale * w instead,
so the result moves by about one rounding of x.
"""
from __future__ import annotations

import tvm
from tvm import relax

from vtool.models.quantized_linear import block_mma_symbol
from vtool.toolchain.block_mma import BLOCK_MMA_FORMATS
from vtool.toolchain.block_mma_epilogues import Uses, extern_symbol, rewrite_pass

PASS_NAME = "VtoolBlockMmaNorms"
ROWS_PER_STAT = 4  # native/block_mma.cu's kTileRows: one block sum per tile of output rows
_PRODUCERS = {block_mma_symbol(fmt) + "_cast_add": block_mma_symbol(fmt) + "_cast_add_norm_stats"
              for fmt in BLOCK_MMA_FORMATS}
# the float result (lm_head), the cast (q|k|v), SiLU x up (gate|up)
_READERS = {block_mma_symbol(fmt) + suffix: block_mma_symbol(fmt) + "_prenormed" + suffix
            for fmt in BLOCK_MMA_FORMATS for suffix in ("", "_cast", "_silu_mul")}
_DTYPES = ("bfloat16", "float16")


def _one_row(ty: relax.TensorType) -> bool:
    """A static shape whose every dim but the last is 1."""
    shape = getattr(ty, "shape", None)
    return shape is not None and all(isinstance(d, tvm.tirx.IntImm) and int(d) == 1 for d in list(shape)[:-1])


class _Pair:
    """One norm to share: its producer's binding (the `*_cast_add` call), the norm, its reader."""

    def __init__(self, producer: relax.VarBinding, h: relax.Var, norm: relax.Call, reader: relax.VarBinding):
        self.producer, self.h, self.norm, self.reader = producer, h, norm, reader
        out_ty = producer.var.ty.fields[1]
        stats_ty = relax.TensorType([int(out_ty.shape[-1]) // ROWS_PER_STAT], "float32")
        self.fused = relax.DataflowVar(f"{producer.var.name}_norm",
                                       relax.TupleType([*producer.var.ty.fields, out_ty, stats_ty]))
        self.normed = relax.DataflowVar(f"{h.name}_normed", out_ty)
        self.stats = relax.DataflowVar(f"{h.name}_stats", stats_ty)

    def producer_call(self) -> relax.Call:
        inputs = list(self.producer.value.args[1].fields) + [self.norm.args[1]]
        return relax.op.call_dps_packed(_PRODUCERS[extern_symbol(self.producer.value)], relax.Tuple(inputs),
                                        out_ty=list(self.fused.ty.fields))

    def reader_call(self) -> relax.Call:
        eps = relax.prim_value(tvm.tirx.FloatImm("float32", float(self.norm.attrs.epsilon)))
        parts = list(self.reader.value.args[1].fields)[1:]
        return relax.op.call_dps_packed(_READERS[extern_symbol(self.reader.value)],
                                        relax.Tuple([self.normed, self.stats, eps, *parts]),
                                        out_ty=list(self.reader.var.ty.fields))


def _pair(binding: relax.VarBinding, uses: Uses, bindings: dict[relax.Var, relax.VarBinding]) -> _Pair | None:
    """The pair around the norm `binding` binds, or None where the norm stays."""
    norm = binding.value
    reader = bindings.get(uses.only_reader(binding.var))
    if reader is None or extern_symbol(reader.value) not in _READERS or \
            not reader.value.args[1].fields[0].same_as(binding.var):
        return None
    h, w = norm.args
    item = uses.values.get(h)
    if not isinstance(item, relax.TupleGetItem) or item.index != 1:
        return None
    producer = bindings.get(item.tuple_value)
    if producer is None or extern_symbol(producer.value) not in _PRODUCERS:
        return None
    # h is all that is read of the producer's call (its partial sums are a scratch), as the
    # epilogues pass writes it
    readers = uses.readers.get(producer.var, [])
    if len(readers) != 1 or readers[0] is None or not readers[0].same_as(h):
        return None
    x, producer_x = binding.var, producer.value.args[1].fields[0]
    dtypes = {str(x.ty.dtype), str(h.ty.dtype), str(w.ty.dtype)}
    if [int(a) for a in norm.attrs.axes] not in ([-1], [len(x.ty.shape) - 1]) or len(dtypes) != 1 or \
            dtypes.pop() not in _DTYPES or not (_one_row(x.ty) and _one_row(producer_x.ty)) or \
            len(w.ty.shape) != 1 or not isinstance(h.ty.shape[-1], tvm.tirx.IntImm):
        return None
    return _Pair(producer, h, norm, reader)


def _rewrite(func: relax.Function) -> relax.Function:
    uses = Uses(func)
    bindings = {b.var: b for block in func.body.blocks for b in block.bindings if isinstance(b, relax.VarBinding)}
    pairs: list[_Pair] = []
    for binding in bindings.values():
        if uses.bound(binding.var, "relax.nn.rms_norm") is not None:
            pair = _pair(binding, uses, bindings)
            if pair is not None and not any(p.producer.var.same_as(pair.producer.var) for p in pairs):
                pairs.append(pair)
    if not pairs:
        return func
    by_producer = {p.producer.var: p for p in pairs}
    by_h = {p.h: p for p in pairs}
    by_reader = {p.reader.var: p for p in pairs}
    blocks = []
    for block in func.body.blocks:
        out: list[relax.Binding] = []
        for b in block.bindings:
            if b.var in by_producer:
                pair = by_producer[b.var]
                out.append(relax.VarBinding(pair.fused, pair.producer_call()))
            elif b.var in by_h:
                pair = by_h[b.var]
                out += [relax.VarBinding(b.var, relax.TupleGetItem(pair.fused, 1)),
                        relax.VarBinding(pair.normed, relax.TupleGetItem(pair.fused, 2)),
                        relax.VarBinding(pair.stats, relax.TupleGetItem(pair.fused, 3))]
            elif b.var in by_reader:
                out.append(relax.VarBinding(b.var, by_reader[b.var].reader_call()))
            else:
                out.append(b)
        blocks.append(block.__class__(out))
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                          func.attrs, func.span)


def block_mma_norms_pass() -> tvm.transform.Pass:
    """The module pass: decode's norms between two one-row block calls shared by them, the norms
    and the producers' old calls removed."""
    return rewrite_pass(PASS_NAME, _rewrite)
