"""The CUDA compile subprocess: `python -m vtool.toolchain.cuda_worker REQUEST.json RESULT.json`.

Started by vtool.toolchain.cuda.run_worker with the build-time libcuda.so.1 stub on
LD_LIBRARY_PATH, so that `import tvm` here loads TVM's CUDA runtime and codegen embeds
the nvcc fatbin. The request names the model config, target, dtype and library path;
the result holds what the manifest needs (parameter plan, entry points, CUDA build info).
Progress lines go to stdout with cuda.PROGRESS_PREFIX; a VtoolError ends the process
with one "vtool-error: ..." line.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


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
        from vtool.schedules.cuda.tensor_intrinsics import preload_tensor_intrinsics

        # Before any TVM module imports the tensor-core intrinsics the slow way.
        preload_tensor_intrinsics()
        from vtool.toolchain.build import compile_cuda_here

        request = json.loads(Path(request_path).read_text())
        result = compile_cuda_here(ModelConfig.from_dict(request["config"]), lookup(request["target"]),
                                   request["dtype"], Path(request["library"]), progress, in_subprocess=True,
                                   gemm=request.get("gemm", "tir"), attention=request.get("attention", "tir"),
                                   records=request.get("records", True),
                                   cuda_graph_sizes=tuple(request.get("cuda_graph_sizes", ())),
                                   formats=request.get("formats") or None,
                                   draft_cache_len=int(request.get("draft_cache_len", 0)))
    except VtoolError as err:
        print("vtool-error: " + str(err).replace("\n", "\\n"), flush=True)
        return 2
    Path(result_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
