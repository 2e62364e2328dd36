"""CUDA schedules for the mixture-of-experts kernels of models/moe.py (found by block name).

moe_gemv, out[t, j, n] = sum_c x[t, j or 0, c] * W[idx[t, j], n, c]: one thread block per
(token, chosen expert, ROWS output rows); threadIdx.y takes a row, the 32 lanes of threadIdx.x
walk its reduction (consecutive lanes read consecutive weights, coalesced), each lane sums its
stride in a register and the warp adds the lanes (TVM's cross-thread reduction). Only the
chosen experts' rows are read: the expert is idx[t, j] in the weight's index. A prompt's many
tokens are many blocks; a grouped GEMM over tokens per expert would read each expert once
(not done: correctness first).

moe_route, the per-token softmax + top-k: one thread per token, THREADS tokens per block.
"""
from __future__ import annotations

from tvm import s_tir, tirx

from vtool.schedules.cuda.quantized_gemv import find_block

GEMV_BLOCK = "moe_gemv"  # models/moe.py's names (schedules/ does not import models/)
ROUTE_BLOCK = "moe_route"
ROWS = 4
LANES = 32
THREADS = 64


def schedule_moe(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """`func` scheduled, or None when it is neither MoE kernel."""
    if func.attrs is not None and func.attrs.get("tirx.is_scheduled", False):
        return None
    sch = s_tir.Schedule(func)
    gemv = find_block(sch, GEMV_BLOCK)
    if gemv is not None:
        t, j, n, c = sch.get_loops(gemv)
        dtypes = {str(sch.get(loop).loop_var.ty.dtype) for loop in (t, j, n, c)}
        if len(dtypes) != 1:
            raise ValueError(f"{GEMV_BLOCK}: loops of types {sorted(dtypes)}; TVM would not lower its cross-thread "
                             "reduction (make every extent of models/moe.py's kernel one type)")
        # The lanes' partial sums meet in TVM's cross-thread reduction, which lowers only when
        # every loop of the block has one integer type (models/moe.py makes them all int64;
        # tests/test_moe.py holds that, tests/support/moe_probe.py checks the kernel on a GPU).
        # A partial last chunk (reductions of 36, 40) is predicated.
        no, ni = sch.split(n, [None, ROWS])
        co, ci = sch.split(c, [None, LANES])
        sch.reorder(t, j, no, ni, ci, co)
        bx = sch.fuse(t, j, no)
        sch.bind(bx, "blockIdx.x")
        sch.bind(ni, "threadIdx.y")
        sch.bind(ci, "threadIdx.x")
        return sch.mod["main"].with_attr("tirx.is_scheduled", True)
    route = find_block(sch, ROUTE_BLOCK)
    if route is not None:
        (t,) = sch.get_loops(route)
        bx, tx = sch.split(t, [None, THREADS])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        return sch.mod["main"].with_attr("tirx.is_scheduled", True)
    return None
