"""Which CUDA kernels differ between two compiled libraries, by their machine code.

    python tests/bench/sass_diff.py OLD.so NEW.so [--cuobjdump PATH]

A kernel change meant for some launches only (a template instance, a launch bound) should leave
every other kernel's SASS as it was; then a step that runs only unchanged kernels keeps its old
timing, and only the changed ones need the GPU. `cuobjdump -sass` (from the CUDA toolkit, no GPU
needed) disassembles both; each function's instructions are compared with addresses and the
per-build hash of anonymous namespaces stripped (with the length nvcc mangles it with, which
follows the source's file name: two builds of a kernel from differently named files compare).
cuobjdump runs `nvdisasm` for -sass: the one beside the given cuobjdump is found first (the CUDA
toolkit's bin/ and the nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm wheels put them together).
Prints one line per function that differs or exists on one side only, then a count; exits 1 when
any differ, 2 when a library cannot be disassembled.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# nvcc's per-file namespace name, with its mangled length (_ZN45_GLOBAL__N__d3bca25d_12_block_mma_cu_5b585b65...)
_ANON = re.compile(r"\d*_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}")
_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")  # the instruction's offset comment


def functions(sass: str, keep_offsets: bool = False) -> dict[str, list[str]]:
    """Function name -> its instructions, from `cuobjdump -sass` output (with their offset
    comments when keep_offsets: tests/bench/sass_loop.py follows the branches by them)."""
    out: dict[str, list[str]] = {}
    body: list[str] | None = None
    for line in sass.splitlines():
        found = re.match(r"\s*Function : (\S+)", line)
        if found:
            body = out.setdefault(_ANON.sub("ANON", found.group(1)), [])
            continue
        if body is not None:
            text = _ANON.sub("ANON", line if keep_offsets else _ADDRESS.sub("", line)).strip()
            if text:
                body.append(text)
    return out


def sass_text(library: Path, cuobjdump: str) -> str:
    """`cuobjdump -sass` of a library (exits 2 when it cannot be disassembled)."""
    beside = str(Path(cuobjdump).resolve().parent) if os.sep in cuobjdump else ""
    env = {**os.environ, "PATH": os.pathsep.join(p for p in (beside, os.environ.get("PATH", "")) if p)}
    try:
        done = subprocess.run([cuobjdump, "-sass", str(library)], capture_output=True, text=True, env=env)
    except FileNotFoundError:
        raise SystemExit(f"sass_diff: no cuobjdump at {cuobjdump!r} (--cuobjdump PATH)") from None
    if done.returncode:
        print(f"sass_diff: cuobjdump -sass {library} failed: {done.stderr.strip()}", file=sys.stderr)
        raise SystemExit(2)
    return done.stdout


def disassemble(library: Path, cuobjdump: str) -> dict[str, list[str]]:
    return functions(sass_text(library, cuobjdump))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    args = ap.parse_args()
    old, new = disassemble(args.old, args.cuobjdump), disassemble(args.new, args.cuobjdump)
    changed = 0
    for name in sorted(set(old) | set(new)):
        if name not in new or name not in old:
            print(f"only in {'old' if name in old else 'new'}: {name}")
            changed += 1
        elif old[name] != new[name]:
            print(f"differs ({len(old[name])} -> {len(new[name])} lines): {name}")
            changed += 1
    print(f"{len(set(old) | set(new))} functions, {changed} differ")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
