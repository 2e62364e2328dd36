"""The runtime loads and runs an artifact with tvm_ffi + libtvm_runtime.so alone: the
compiler (the `tvm` package, libtvm_compiler.so) and vtool's build-side packages are never
imported. A separate process proves it."""
from __future__ import annotations

import json
import subprocess
import sys


PROBE = r"""
import json, sys
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.runtime.engine.engine import Engine
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.session import open_session
checkpoint = open_checkpoint(sys.argv[2])
session = open_session(sys.argv[1], checkpoint, max_model_len=128)
engine = Engine(session)
engine.add_request("r", session.tokenizer.encode("Hello"), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
tokens = []
while engine.has_unfinished():
    for out in engine.step():
        tokens += out.new_token_ids
maps = open("/proc/self/maps").read()
print(json.dumps({
    "tokens": tokens,
    "compiler_mapped": "libtvm_compiler" in maps,
    "runtime_mapped": "libtvm_runtime.so" in maps,
    "imported": sorted(m for m in sys.modules if m == "tvm" or m.startswith("tvm.")
                       or m.split(".")[:2] in (["vtool", "toolchain"], ["vtool", "models"], ["vtool", "schedules"])),
}))
"""


def test_runtime_never_loads_the_compiler(tiny_model_dir, tiny_artifact):
    folder, artifact = tiny_model_dir, tiny_artifact
    done = subprocess.run([sys.executable, "-c", PROBE, str(artifact), str(folder)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["tokens"]) == 5
    assert report["runtime_mapped"] and not report["compiler_mapped"]
    assert report["imported"] == []
