"""How many instructions a kernel's main loop issues, by opcode, from its machine code.

    python tests/bench/sass_loop.py LIB.so PATTERN [PATTERN ...] [--cuobjdump PATH]

For every function of `cuobjdump -sass LIB.so` whose (mangled) name matches a PATTERN (a regular
expression), the loop is the span from the target of its last backward branch to that branch:
the step loop of toolchain/native/block_mma.cu's kernels, whose per-step instruction count is what
an issue-bound kernel's time follows (docs/BENCHMARKS.md counts it before and after a change).
Prints one line per function: the count and the opcodes (without modifiers), most frequent first.
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import sys
from pathlib import Path

from sass_diff import functions, sass_text

# an instruction line: its offset comment, an optional predicate, the opcode with modifiers, operands
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def loop_opcodes(lines: list[str]) -> list[str]:
    """Opcodes (modifiers dropped) from the last backward branch's target to the branch; [] if the
    function has no backward branch."""
    parsed = []
    for line in lines:
        found = _INSTRUCTION.search(line)
        if found:
            parsed.append((int(found.group(1), 16), found.group(2), found.group(3).strip()))
    back = [(at, operands) for at, op, operands in parsed
            if op.split(".")[0] == "BRA" and re.match(r"0x[0-9a-f]+", operands)
            and int(operands.split()[0], 16) < at]
    if not back:
        return []
    end, operands = back[-1]
    start = int(operands.split()[0], 16)
    return [op.split(".")[0] for at, op, _ in parsed if start <= at <= end]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("library", type=Path)
    ap.add_argument("patterns", nargs="+")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    args = ap.parse_args()
    funcs = functions(sass_text(args.library, args.cuobjdump), keep_offsets=True)
    matched = 0
    for name, lines in funcs.items():
        if any(re.search(p, name) for p in args.patterns):
            matched += 1
            ops = loop_opcodes(lines)
            mix = ", ".join(f"{op} {n}" for op, n in collections.Counter(ops).most_common())
            print(f"{len(ops)} instructions: {name}\n    {mix}")
    if not matched:
        print("no function matches", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
