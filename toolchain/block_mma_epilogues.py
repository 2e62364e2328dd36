"""The batched-decode block matmuls finish their own results (native/block_mma.cu's epilogues).

`models/quantized_linear._block_mma` calls `vtool_block_mma_<fmt>`, whose float32 result the
model then casts to the compute dtype and, in a decoder layer, adds to the residual stream (the
o and down projections) or splits into Llama's gate and up halves for SiLU(gate) * up (gate|up).
TVM compiles each of those into a kernel of its own that reads the float32 result back, after the
matmul's own two launches (the blocks, then the sum of its k splits): three launches a matmul,
four matmuls a layer. This pass hands that work to the kernel that adds the splits:

    astype(mma[1], T)                                      -> vtool_block_mma_<fmt>_cast
    add(residual, astype(mma[1], T))                       -> vtool_block_mma_<fmt>_cast_add
    split(astype(mma[1], T), 2, -1) -> silu(gate) * up     -> vtool_block_mma_<fmt>_silu_mul

so a matmul is two launches and writes its result once, in T. The kernels compute what TVM's
kernels for the same ops compute, operation for operation, so the values do not change. `decode`
(one sequence) calls the same functions, whose one-row GEMV finishes the result in its only
launch.

Only single-use chains are rewritten: a value something else also reads stays where it is (an
intermediate read twice would otherwise be computed twice), and the chain's dead ops go with
DeadCodeElimination.
"""
from __future__ import annotations

from typing import Callable

import tvm
import tvm_ffi
from tvm import relax

from vtool.models.quantized_linear import block_mma_symbol
from vtool.toolchain.block_mma import BLOCK_MMA_FORMATS

PASS_NAME = "VtoolBlockMmaEpilogues"
_BASE_SYMBOLS = {block_mma_symbol(fmt) for fmt in BLOCK_MMA_FORMATS}
_COMPUTE_DTYPES = ("bfloat16", "float16")


def op_name(value: relax.Expr) -> str | None:
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        return value.op.name
    return None


def extern_symbol(value: relax.Expr) -> str | None:
    """The packed function's name of a call_dps_packed, else None."""
    if op_name(value) == "relax.call_dps_packed" and isinstance(value.args[0], relax.ExternFunc):
        return str(value.args[0].global_symbol)
    return None


class Uses:
    """Who reads each variable of a function's dataflow blocks (variables read by the block's
    outputs or the function's body count as read by None, so they never look single-use)."""

    def __init__(self, func: relax.Function):
        self.values = relax.analysis.get_var2val(func)
        self.readers: dict[relax.Var, list[relax.Var | None]] = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                for var in relax.analysis.free_vars(binding.value):
                    self.readers.setdefault(var, []).append(binding.var)
        for var in relax.analysis.free_vars(func.body.body):
            self.readers.setdefault(var, []).append(None)

    def only_reader(self, var: relax.Var) -> relax.Var | None:
        """The one binding that reads `var`, or None (no reader, several, or an output)."""
        readers = self.readers.get(var, [])
        return readers[0] if len(readers) == 1 and isinstance(var, relax.DataflowVar) else None

    def bound(self, var: relax.Var | None, op: str) -> relax.Call | None:
        value = self.values.get(var) if var is not None else None
        return value if op_name(value) == op else None


def _item_of(uses: Uses, tuple_var: relax.Var, index: int, alone: bool = False) -> relax.Var | None:
    """The one variable bound to tuple_var[index], when tuple_var is read only by such items
    (and, with `alone`, no other element is read: a block matmul's partial sums must be a
    scratch nobody reads, or the rewrite would change what they hold)."""
    found = None
    for reader in uses.readers.get(tuple_var, []):
        value = uses.values.get(reader) if reader is not None else None
        if not isinstance(value, relax.TupleGetItem):
            return None
        if value.index == index:
            if found is not None:
                return None
            found = reader
        elif alone and uses.readers.get(reader):
            return None
    return found


def _plan(func: relax.Function) -> dict[relax.Var, tuple[str, list[relax.Expr], tvm.ir.Type]]:
    """{variable whose binding becomes the fused call's result: (symbol, its inputs, the type of
    its partial sums [splits, ..., n] float32, as the original call's)}."""
    uses = Uses(func)
    plan: dict[relax.Var, tuple[str, list[relax.Expr], tvm.ir.Type]] = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            symbol = extern_symbol(binding.value)
            if symbol not in _BASE_SYMBOLS:
                continue
            inputs, partial_ty = list(binding.value.args[1].fields), binding.var.ty.fields[0]
            result = _item_of(uses, binding.var, 1, alone=True)
            cast_var = uses.only_reader(result) if result is not None else None
            cast = uses.bound(cast_var, "relax.astype")
            if cast is None or str(cast.attrs.dtype) not in _COMPUTE_DTYPES or \
                    str(inputs[0].ty.dtype) != str(cast.attrs.dtype):
                continue
            reader = uses.only_reader(cast_var)
            if uses.bound(reader, "relax.astype") is not None:
                # cast back to float32 (the logits): TVM fuses both casts into one kernel after the
                # matmul writes its float32 result itself, fewer launches than a cast epilogue
                continue
            add = uses.bound(reader, "relax.add")
            if add is not None:
                residual = add.args[1] if add.args[0].same_as(cast_var) else add.args[0]
                if not residual.same_as(cast_var) and tvm_ffi.structural_equal(residual.ty, cast_var.ty):
                    plan[reader] = (symbol + "_cast_add", inputs + [residual], partial_ty)
                    continue
            gated = _gated_product(uses, cast_var, reader)
            if gated is not None:
                plan[gated] = (symbol + "_silu_mul", inputs, partial_ty)
                continue
            plan[cast_var] = (symbol + "_cast", inputs, partial_ty)
    return plan


def _gated_product(uses: Uses, cast_var: relax.Var, split_var: relax.Var | None) -> relax.Var | None:
    """The variable of silu(gate) * up when `split_var` halves `cast_var` along its last axis
    into gate and up, each read only there; else None."""
    split = uses.bound(split_var, "relax.split")
    if split is None or not split.args[0].same_as(cast_var):
        return None
    ndim = len(cast_var.ty.shape)
    sections = split.attrs.indices_or_sections  # a count (an IntImm), or split points (an Array)
    if not hasattr(sections, "value") or int(sections) != 2 or int(split.attrs.axis) not in (-1, ndim - 1):
        return None
    gate, up = _item_of(uses, split_var, 0), _item_of(uses, split_var, 1)
    if gate is None or up is None:
        return None
    silu_var = uses.only_reader(gate)
    if uses.bound(silu_var, "relax.nn.silu") is None:
        return None
    product_var = uses.only_reader(silu_var)
    product = uses.bound(product_var, "relax.multiply")
    if product is None or not (product.args[0].same_as(silu_var) and product.args[1].same_as(up)) or \
            uses.only_reader(up) != product_var:
        return None
    return product_var


def _rewrite(func: relax.Function) -> relax.Function:
    plan = _plan(func)
    if not plan:
        return func
    blocks = []
    for block in func.body.blocks:
        bindings = []
        for binding in block.bindings:
            if binding.var not in plan:
                bindings.append(binding)
                continue
            symbol, inputs, partial_ty = plan[binding.var]
            call = relax.op.call_dps_packed(symbol, relax.Tuple(inputs), out_ty=[partial_ty, binding.var.ty])
            fused = relax.DataflowVar(f"{binding.var.name}_fused", relax.TupleType([partial_ty, binding.var.ty]))
            bindings.append(relax.VarBinding(fused, call))
            bindings.append(relax.VarBinding(binding.var, relax.TupleGetItem(fused, 1)))
        blocks.append(relax.DataflowBlock(bindings) if isinstance(block, relax.DataflowBlock)
                      else relax.BindingBlock(bindings))
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                          func.attrs, func.span)


def rewrite_pass(name: str, rewrite: Callable[[relax.Function], relax.Function]) -> tvm.transform.Pass:
    """A module pass applying `rewrite` to every Relax function, then removing what no longer has
    a reader (DeadCodeElimination) where anything changed."""

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs, global_infos=mod.global_infos)
        changed = False
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                new = rewrite(func)
                changed |= not new.same_as(func)
                out[gv] = new
        return relax.transform.DeadCodeElimination()(out) if changed else mod

    return _pass


def block_mma_epilogues_pass() -> tvm.transform.Pass:
    """The module pass: every Relax function's block-matmul chains fused, dead ops removed."""
    return rewrite_pass(PASS_NAME, _rewrite)
