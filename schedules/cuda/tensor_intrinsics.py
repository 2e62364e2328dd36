"""Parse TVM's tensor-core intrinsics (tvm.s_tir.tensor_intrin) the light way.

Importing vtool.schedules.cuda needs them (the bf16 rule registers its own beside DLight's
fp16 ones), and TVM's own import of them costs 35-60 s on 2 cores; this module makes it a
few seconds, for every importer: builds, the CUDA compile worker, tuning and tests.
"""
from __future__ import annotations

import contextlib
import inspect
import linecache
import sys
from typing import Iterator


@contextlib.contextmanager
def light_inspect_stack() -> Iterator[None]:
    """inspect.stack() without its per-frame source lookups, while the block runs.

    TVMScript's @T.prim_func calls inspect.stack() once per function it parses, and
    importing tvm.s_tir.tensor_intrin (DLight's float16 tensor-core Matmul does) parses
    ~250. Inside an import, every <frozen importlib> frame on the stack sends
    inspect.getsourcefile to inspect.getmodule, which scans sys.modules: ~17 s of a tiny
    fp16 build. The parser reads only the frames themselves and the code line of the
    third (utils.is_defined_in_class), so this stack gives the code line for the first
    three frames and skips the lookups elsewhere.
    """
    original = inspect.stack

    def stack(context: int = 1) -> list[inspect.FrameInfo]:
        frames = []
        frame = sys._getframe(1)
        while frame is not None:
            code, lines, index = frame.f_code, None, None
            if context and len(frames) < 3:
                line = linecache.getline(code.co_filename, frame.f_lineno)
                if line:
                    lines, index = [line], 0
            frames.append(inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name, lines, index))
            frame = frame.f_back
        return frames

    inspect.stack = stack  # type: ignore[assignment]
    try:
        yield
    finally:
        inspect.stack = original  # type: ignore[assignment]


def preload_tensor_intrinsics() -> None:
    """Import tvm.s_tir.tensor_intrin with the light inspect.stack (see above)."""
    with light_inspect_stack():
        import tvm.s_tir.tensor_intrin  # noqa: F401
