"""A fix to TVM 0.27's CPU paged prefill attention for sliding-window layers.

`batch_prefill_paged_kv_cpu_sliding_window` (relax/frontend/nn/llm/_prefill_kernels.py) keeps the
running maximum of each query row's online softmax in `new_m`, which it writes only for keys
the mask lets through, and reads for every key. The causal mask of the full-attention kernel
hides only keys after the visible ones, so `new_m` is always written first there; the
sliding-window mask (models/decoder.py: per-layer "mha_sliding" layers, Gemma) hides the
cached keys *before* the window, so the first keys read an uninitialized `new_m` and the row's
output is garbage or NaN. Setting `new_m` to the row's starting maximum (-5e4, the value
`m_val` starts from) where `m_val` is initialized makes every masked key a no-op again (its
weight exp2(-5e4 - m) vanishes once a visible key raises the maximum).

Where the head dim is a multiple of 16, schedules/cpu/attention.py replaces this kernel (and the
sliding-window decode one) outright by a parallel one, tried first; this fix keeps the others'
(the tiny test models' head dims of 12) correct.

The kernel is patched in its TVMScript text and parsed back (TVM's Python API has no TIR
statement mutator), and only if the text round-trips to the same function and holds exactly
one such initialization; anything else is left as it is.
"""
from __future__ import annotations

import re

import tvm
from tvm import tirx
from tvm.script import parser

NAME = "batch_prefill_paged_kv_cpu_sliding_window"
_INIT = re.compile(r"^(?P<indent>[ \t]*)m_val\[0\] = T\.float32\(-50000\.0\)$", re.MULTILINE)


def fix_sliding_prefill(name: str, func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """TVM's CPU sliding-window paged prefill with `new_m` initialized per row, or None when
    `func` is not that kernel (or not in the form this fix knows)."""
    if name != NAME:
        return None
    text = func.script()
    if len(_INIT.findall(text)) != 1 or "new_m[0] = T.float32(-50000.0)" in text:
        return None
    try:
        tvm.ir.assert_structural_equal(parser.parse(text), func)  # the text is the whole kernel
        patched = _INIT.sub(lambda m: f"{m[0]}\n{m['indent']}new_m[0] = T.float32(-50000.0)", text)
        return parser.parse(patched)
    except Exception:  # noqa: BLE001 - a TVMScript form this fix does not know: leave the kernel alone
        return None
