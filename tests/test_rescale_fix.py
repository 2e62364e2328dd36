"""schedules/cpu/rescale_fix.py: TVM's serial CPU attention kernels read their 1-element
rescale buffer `scale_O` at every head-dim index; after the fix (and after the CPU schedule
pass, which applies it) every read is element 0, and nothing else changed."""
from __future__ import annotations

import importlib

import pytest
import tvm
import tvm_ffi
from tvm.relax.frontend.nn.llm import _prefill_kernels

from vtool.schedules.cpu import cpu_schedule_pass
from vtool.schedules.cpu.rescale_fix import BUFFER, fix_rescale_reads

# the module (the package's `tree_attn` name is a function of it)
tree_attn = importlib.import_module("tvm.relax.frontend.nn.llm.tree_attn")
ROPE: dict = {}  # no rope scaling (what vtool passes for plain rope)
KERNELS = {
    "paged prefill": lambda: _prefill_kernels._attention_prefill_cpu(1, 4, 12, "float32", False, ROPE),
    "sliding paged prefill": lambda: _prefill_kernels._attention_prefill_cpu(1, 4, 12, "float32", True, ROPE),
    "tree attention with the paged cache": lambda: tree_attn.tree_attn_with_paged_kv_cache_cpu(2, 4, 12, "float32",
                                                                                              ROPE),
}


def scale_reads(func: tvm.tirx.PrimFunc) -> list[int | None]:
    """The index of every scale_O read (None: not a constant)."""
    found: list[int | None] = []

    def seen(load: tvm.ir.TensorLoad) -> None:
        if getattr(load.source, "name", None) == BUFFER:
            index = load.indices[0]
            found.append(index.value if isinstance(index, tvm.tirx.IntImm) else None)

    tvm_ffi.structural_walk(func, [(tvm.ir.TensorLoad, seen)])
    return found


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_every_rescale_read_is_element_zero(kernel):
    func = KERNELS[kernel]()
    before = scale_reads(func)
    assert None in before, f"TVM's {kernel} no longer reads scale_O at a variable index: is the fix still needed?"
    fixed = fix_rescale_reads(func)
    assert fixed is not None
    assert scale_reads(fixed) == [0] * len(before)
    assert fix_rescale_reads(fixed) is None  # nothing left to fix


def test_the_cpu_schedule_pass_applies_it():
    func = KERNELS["paged prefill"]()
    mod = tvm.IRModule({"batch_prefill_paged_kv_cpu_probe": func})
    with tvm.target.Target("llvm"):
        out = cpu_schedule_pass()(mod)
    assert set(scale_reads(out["batch_prefill_paged_kv_cpu_probe"])) == {0}


def test_kernels_without_the_buffer_are_left_alone():
    decode = tvm.relax.frontend.nn.llm._decode_kernels._attention_decode_cpu(1, 4, 12, "float32", False, ROPE)
    assert set(scale_reads(decode)) == {0}  # TVM's decode kernel reads element 0 already
    assert fix_rescale_reads(decode) is None
