"""Attention logit soft-capping in vtool's own attention kernels (Gemma-2's attn_logit_softcapping).

models/softcap.py caps TVM's KV-cache attention kernels and marks each with the function
attribute ATTR = cap. The rules that put vtool's kernels in place of TVM's (schedules/cpu/
attention.py; schedules/cuda/decode_attention.py and short_prefill_attention.py) read the cap
from the kernel they replace (`softcap_of`) and cap their scores the same way (`capped`):
scores are in log2 units there too (x = q.k * sm_scale * log2(e)), so the natural-scale cap
cap * tanh(s / cap) is c * tanh(x / c) with c = cap * log2(e), applied where a score is
complete, before the mask and the running maximum. A kernel without the attribute has no cap,
and the kernels generated for it are exactly those of a build without this module.
"""
from __future__ import annotations

import math
from typing import Callable

from tvm import tirx

# The attribute models/softcap.py writes (a test holds the two names equal).
ATTR = "vtool.attn_logit_softcap"
LOG2E = math.log2(math.e)


def softcap_of(func: tirx.PrimFunc) -> float:
    """The cap a (TVM) attention kernel was made with; 0.0: none."""
    value = func.attrs.get(ATTR) if func.attrs is not None else None
    return 0.0 if value is None else float(getattr(value, "value", value))


def capped(x: tirx.PrimExpr, cap: float) -> tirx.PrimExpr:
    """c * tanh(x / c), c = cap * log2(e), for a log2-unit score x (scalar or vector); x itself when cap is 0."""
    if not cap:
        return x
    c, dtype = cap * LOG2E, str(x.ty.dtype)
    return tirx.const(c, dtype) * tirx.tanh(x * tirx.const(1.0 / c, dtype))


def capper(cap: float) -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    """`capped` with the cap bound, for a kernel's TVMScript (the identity when cap is 0)."""
    return lambda x: capped(x, cap)
