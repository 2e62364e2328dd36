"""The CUDA compile subprocess: `python -m vtool.toolchain.cuda_worker REQUEST.json RESULT.json`.

Started by vtool.toolchain.cuda.run_worker with the build-time libcuda.so.1 stub on
LD_LIBRARY_PATH, so that `import tvm` here loads TVM's CUDA runtime and codegen embeds
the nvcc fatbin. The request names the model config, target, dtype and library path;
the result holds what the manifest needs (parameter plan, entry points, CUDA build info).
Progress lines go to stdout with cuda.PROGRESS_PREFIX; a VtoolError ends the process
with one "vtool-error: ..." line.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import linecache
import sys
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def _light_inspect_stack() -> Iterator[None]:
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
    with _light_inspect_stack():
        import tvm.s_tir.tensor_intrin  # noqa: F401


def main(argv: list[str]) -> int:
    request_path, result_path = argv
    # tvm_ffi imports torch when it can (about 1 s); nothing here needs it.
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    from vtool import VtoolError
    from vtool.toolchain.cuda import PROGRESS_PREFIX

    def progress(msg: str) -> None:
        print(PROGRESS_PREFIX + msg, flush=True)

    try:
        from vtool.models.config import ModelConfig
        from vtool.targets import lookup
        from vtool.toolchain.build import compile_cuda_here

        request = json.loads(Path(request_path).read_text())
        # vtool.schedules.cuda imports the tensor-core intrinsics for every dtype (the bf16
        # rule registers its own beside DLight's fp16 ones): parse them the light way.
        preload_tensor_intrinsics()
        result = compile_cuda_here(ModelConfig.from_dict(request["config"]), lookup(request["target"]),
                                   request["dtype"], Path(request["library"]), progress, in_subprocess=True,
                                   gemm=request.get("gemm", "tir"), attention=request.get("attention", "tir"),
                                   records=request.get("records", True))
    except VtoolError as err:
        print("vtool-error: " + str(err).replace("\n", "\\n"), flush=True)
        return 2
    Path(result_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
