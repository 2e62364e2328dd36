"""Peak resident memory of `vtool run` on the default model (issues #5, #16): below 1.9x the GGUF file.

The weights stay in their GGUF blocks (92.1 MiB bound for a 93.8 MiB file), so what else a run
keeps resident must fit beside them: the interpreter, numpy, click and rich, the TVM runtime
(tvm_ffi without ml_dtypes: tvm_runtime.lean_ffi_import), the tokenizer. Measured on a 2-core
Xeon: 168-171 MiB with `--artifact`, 171-173 MiB through the build cache (1.79-1.84x), from
177-181 MiB (1.88-1.93x) before ml_dtypes was kept out, which this bound fails most of the
time; the floor of any CPython + numpy + tvm_ffi process holding these weights is 136 MiB
(1.45x), so issue 16's 1.3x is out of reach for this file (docs/BENCHMARKS.md, tests/bench/rss_vs_file.py).
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

# peak RSS / file size; measured 1.79-1.84x (2-3 MiB apart run to run): 5.6 MiB of margin
LIMIT = 1.9

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


def test_run_process_imports_tvm_ffi_without_ml_dtypes():
    """The run command's setup keeps ml_dtypes (~8 MiB resident) out of tvm_ffi's import, and a
    later `import ml_dtypes` (a bfloat16 checkpoint) still works."""
    code = ("import sys; from vtool.runtime.cli import runtime_process; runtime_process(None); "
            "from vtool.runtime.artifact.tvm_runtime import ffi; ffi(); "
            "print('ml_dtypes' in sys.modules, 'tvm_ffi' in sys.modules); "
            "from vtool.runtime.weights.checkpoint import numpy_dtype; print(numpy_dtype('bfloat16'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "bfloat16"]


def test_cli_consoles_print_emoji_codes_as_text():
    """A completion's "arr[1:x:2]" is printed as is (rich's emoji codes would make it "arr[1❌2]")."""
    from vtool.runtime.cli import console, out

    for c in (out, console):
        with c.capture() as captured:
            c.print("arr[1:x:2] :ok:", highlight=False, markup=False, soft_wrap=True)
        assert captured.get().strip() == "arr[1:x:2] :ok:"


@pytest.fixture(scope="module")
def model_and_artifact() -> tuple[Path, Path]:
    from vtool.toolchain.build import build_artifact

    model = default_model_path()
    return model, build_artifact(model, "host", "float32", quantization="gguf")


@pytest.mark.slow  # builds the real default model and runs `vtool run` on it twice
@pytest.mark.parametrize("path", ["artifact", "cached-build"])
def test_vtool_run_peak_rss_below_1_9x_the_gguf(model_and_artifact, path):
    model, artifact = model_and_artifact
    args = ["--artifact", str(artifact)] if path == "artifact" else []
    peak, out = _peak_kib(args)
    limit = LIMIT * model.stat().st_size / 1024
    assert "Paris" in out  # it really ran
    assert peak < limit, f"vtool run ({path}) peaked at {peak / 1024:.1f} MiB, limit {limit / 1024:.1f} MiB"
