"""bf16 tensor-core matmuls for CUDA.

DLight tensorizes only float16 (WMMA) and int8; TVM 0.27 ships no bfloat16 WMMA
intrinsics, so every bf16 matmul with more than a few rows ran on a SIMT schedule (the
8B prefill was 33x slower than torch). WMMA has had bf16 fragments since sm_80, and
TVM's own intrinsic generators take the dtype as a parameter: this module registers the
bf16 variants under DLight's naming scheme and runs DLight's float16 tensor-core rule
with them, for matmuls that read bf16 and accumulate in float32 (every vtool matmul
accumulates in float32).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

from tvm import s_tir, tirx
from tvm.s_tir import TensorIntrin
from tvm.s_tir.dlight.gpu import matmul as dlight_matmul
from tvm.s_tir.tensor_intrin import cuda as cuda_intrin

LOAD_A = "wmma_load_16x16x16_bf16_a_shared_dyn"
LOAD_B_TRANS = "wmma_load_16x16x16_bf16_b_trans_shared_dyn"
SYNC_TRANS = "wmma_sync_16x16x16_bf16bf16f32_trans"


@functools.lru_cache(maxsize=1)
def register_intrinsics() -> None:
    TensorIntrin.register(LOAD_A, *cuda_intrin.get_wmma_load_intrin(16, 16, 16, "bfloat16", "shared.dyn",
                                                                      False, False))
    TensorIntrin.register(LOAD_B_TRANS, *cuda_intrin.get_wmma_load_intrin(16, 16, 16, "bfloat16", "shared.dyn",
                                                                            True, True))
    TensorIntrin.register(SYNC_TRANS, *cuda_intrin.get_wmma_sync_intrin(16, 16, 16, "bfloat16", "float32", True))


@contextlib.contextmanager
def _bf16_intrinsic_names() -> Iterator[None]:
    """DLight's rule asks get_wmma_intrin_group for float16 names at call time; answer
    with the bf16 ones (the float32 fill/store intrinsics are shared)."""
    original = cuda_intrin.get_wmma_intrin_group

    def bf16_group(load_scope, store_scope, in_dtype, out_dtype, trans_b):  # noqa: ANN001 - TVM's signature
        group = original(load_scope, store_scope, "float16", out_dtype, trans_b)
        return {**group, "load_a": LOAD_A, "load_b": LOAD_B_TRANS, "compute": SYNC_TRANS}

    cuda_intrin.get_wmma_intrin_group = bf16_group
    try:
        yield
    finally:
        cuda_intrin.get_wmma_intrin_group = original


def _is_bf16_matmul(func: tirx.PrimFunc) -> bool:
    """A plain (batched) matmul reading bf16 and accumulating in float32."""
    sch = s_tir.Schedule(func)
    blocks = dlight_matmul.get_reduction_blocks(sch, sch.get_child_blocks(sch.get_sblock("root")))
    if not blocks:
        return False
    stmt = sch.get(blocks[0])
    if not dlight_matmul.get_index_map(stmt):  # the DLight rule asserts on anything else
        return False
    in_dtype, out_dtype = dlight_matmul.get_in_out_dtypes(stmt)
    return in_dtype == "bfloat16" and out_dtype == "float32"


def schedule_bf16_matmul(func: tirx.PrimFunc, target) -> s_tir.Schedule | None:  # noqa: ANN001
    """DLight's tensor-core matmul schedule with bf16 WMMA, or None when func is not a
    bf16-in, float32-accumulate matmul or the rule does not take it."""
    try:
        if not _is_bf16_matmul(func):
            return None
    except Exception:  # noqa: BLE001 - not a matmul-shaped kernel
        return None
    register_intrinsics()
    with _bf16_intrinsic_names():
        try:
            return dlight_matmul.MatmulTensorization().apply(func, target, False)
        except (AssertionError, RuntimeError, ValueError):  # a shape the rule cannot tile (TVM raises RuntimeError kinds)
            return None
