"""The KV cache's rotary embedding on the CPU (schedules/cpu/attention.py `schedule_fused_rope`):
TVM's kernel with its loops reordered, one position (a decode step's) on one thread and more
in parallel, the expressions untouched, so q, k and v come out bit for bit as from the
unscheduled kernel."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from vtool.schedules.cpu.attention import schedule_fused_rope  # noqa: E402
from vtool.targets import buildable  # noqa: E402

TARGET = tvm.target.Target(buildable("host").tvm)


@pytest.mark.parametrize("rope_scaling, rotary_dim", [
    ({}, None),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, None),
    ({}, 32),  # a partial rotary (the last half of each head passed through)
])
def test_scheduled_rope_equals_tvms_bit_for_bit(rope_scaling, rotary_dim):
    from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map

    func = llama_rope_with_position_map(100000.0, 1.0, 64, 9, 3, "float32", rope_scaling, rotary_dim).with_attr(
        "global_symbol", "main")
    scheduled = schedule_fused_rope(func)
    assert scheduled is not None
    text = scheduled.script()
    assert "T.parallel" in text and "== 1" in text  # one position serial, more in parallel
    libs = [tvm.compile(tvm.IRModule({"main": f}), target=TARGET)["main"] for f in (func, scheduled)]
    rng = np.random.default_rng(0)
    for n in (1, 5, 37):
        qkv = tvm.runtime.tensor(rng.standard_normal((n, 15, 64)).astype("float32"))
        pos = tvm.runtime.tensor(rng.integers(0, 4000, n).astype("int32"))
        outs = []
        for lib in libs:
            q, k, v = (tvm.runtime.tensor(np.full((n, h, 64), np.nan, "float32")) for h in (9, 3, 3))
            lib(qkv, pos, q, k, v, 1)
            outs.append([t.numpy() for t in (q, k, v)])
        for a, b in zip(*outs):
            np.testing.assert_array_equal(a, b)


def test_other_kernels_are_left_alone():
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode_cpu

    assert schedule_fused_rope(_attention_decode_cpu(2, 8, 64, "float32", False, {})) is None
