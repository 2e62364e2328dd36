"""Peak resident memory of `vtool run` on the default model (issue #5): below twice the GGUF file.

The weights stay in their GGUF blocks (98 MB bound for a 98 MB file), so what else a run keeps
resident must fit in the other 98 MB: the interpreter, numpy, the TVM runtime, the tokenizer.
Measured as the child's peak RSS (getrusage RUSAGE_CHILDREN in a fresh wrapper process, i.e.
Linux's VmHWM of `vtool run`), in a subprocess so that nothing this test process imported
counts. Two paths: with a prebuilt `--artifact` (a runtime-only machine), and the plain
command (which also looks the build up in the cache).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vtool.runtime.weights.default_model import default_model_path

pytestmark = pytest.mark.slow  # builds the real default model and runs `vtool run` on it twice

WRAPPER = ("import resource, subprocess, sys; "
           "done = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
           "sys.stderr.write(done.stderr); sys.stdout.write(done.stdout); "
           "print('HWM_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
           "sys.exit(done.returncode)")


def _peak_kib(args: list[str]) -> tuple[int, str]:
    cmd = [sys.executable, "-c", WRAPPER, sys.executable, "-m", "vtool.toolchain.cli", "run", "--max-tokens", "8",
           *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("HWM_KIB")][-1]
    return int(line.split()[1]), done.stdout


@pytest.fixture(scope="module")
def model_and_artifact() -> tuple[Path, Path]:
    from vtool.toolchain.build import build_artifact

    model = default_model_path()
    return model, build_artifact(model, "host", "float32", quantization="gguf")


@pytest.mark.parametrize("path", ["artifact", "cached-build"])
def test_vtool_run_peak_rss_below_twice_the_gguf(model_and_artifact, path):
    model, artifact = model_and_artifact
    args = ["--artifact", str(artifact)] if path == "artifact" else []
    peak, out = _peak_kib(args)
    limit = 2 * model.stat().st_size / 1024
    assert "Paris" in out  # it really ran
    assert peak < limit, f"vtool run ({path}) peaked at {peak / 1024:.1f} MiB, limit {limit / 1024:.1f} MiB"
