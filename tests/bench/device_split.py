"""The command line of the kernel benchmarks that build here and run on the GPU machine:
`SCRIPT build OUT.so` compiles (with nvcc and the build-time driver stub), `SCRIPT run OUT.so`
loads the library with the runtime alone and measures."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable


def rerun_with_driver_stub() -> None:
    """Start this command again with the CUDA driver stub on the loader path (the build needs
    it where no GPU is), unless this is that second run."""
    if os.environ.get("TVM_CUDA_COMPILE_MODE") != "nvcc":
        from vtool.toolchain.cuda import worker_env

        sys.exit(subprocess.call([sys.executable, *sys.argv], env=worker_env()))


def build_or_run(doc: str, build: Callable[[str], None], run: Callable[[str], None]) -> None:
    args = sys.argv[1:]
    if args[:1] == ["build"] and len(args) == 2:
        rerun_with_driver_stub()
        build(args[1])
    elif args[:1] == ["run"] and len(args) == 2:
        run(args[1])
    else:
        raise SystemExit(doc)
