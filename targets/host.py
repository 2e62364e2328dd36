"""Which x86 tier this machine can execute, read with llvmlite (LLVM's own host query,
which also checks that the OS saves the wide vector registers)."""
from __future__ import annotations

import functools
import platform

from vtool.targets.table import ROWS, TargetError

# Best first.
_X86_TIERS = ("x86-avx512", "x86-avx2", "x86-portable")


@functools.lru_cache(maxsize=1)
def host_cpu_features() -> frozenset[str]:
    import llvmlite.binding as llvm

    return frozenset(name for name, on in llvm.get_host_cpu_features().items() if on)


def best_host_target() -> str:
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        raise TargetError(f"no buildable CPU target for a {machine} host yet; buildable CPU targets are x86 tiers")
    have = host_cpu_features()
    rows = {r.name: r for r in ROWS}
    for name in _X86_TIERS:
        if set(rows[name].requires_cpu) <= have:
            return name
    return "x86-portable"
