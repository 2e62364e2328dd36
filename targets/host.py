"""Which CPU tier (x86-64, or aarch64 on an Arm host) this machine can execute: the CPU
flags Linux reports (the kernel leaves out what the OS does not save, such as AVX-512
state), else LLVM's own host query through llvmlite. /proc/cpuinfo comes first because
loading LLVM costs 36 MB of resident memory on every `vtool run`, and the x86 tier names
the table requires are spelled the same way in both."""
from __future__ import annotations

import functools
import platform
from pathlib import Path

from vtool.targets.table import ROWS, TargetError

# Best first.
_X86_TIERS = ("x86-avx512-vnni", "x86-avx512", "x86-avx2", "x86-portable")
_ARM_TIERS = ("aarch64-neon",)


@functools.lru_cache(maxsize=1)
def host_cpu_features() -> frozenset[str]:
    flags = linux_cpu_flags()
    if flags:
        return flags
    import llvmlite.binding as llvm

    # LLVM spells most flags as Linux does; VNNI is the exception the table needs.
    spelling = {"avx512vnni": "avx512_vnni"}
    return frozenset(spelling.get(name, name) for name, on in llvm.get_host_cpu_features().items() if on)


def linux_cpu_flags() -> frozenset[str]:
    """CPU feature flags as Linux reports them in /proc/cpuinfo (empty elsewhere): the
    "flags" line on x86, "Features" on aarch64. The runtime's tier check reads them too
    (runtime/artifact/library.py)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def best_host_target() -> str:
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        tiers = _ARM_TIERS
    elif machine in ("x86_64", "amd64"):
        tiers = _X86_TIERS
    else:
        raise TargetError(f"no buildable CPU target for a {machine} host yet; buildable CPU targets are "
                          "x86-64 and aarch64 tiers")
    have = host_cpu_features()
    rows = {r.name: r for r in ROWS}
    for name in tiers:
        if set(rows[name].requires_cpu) <= have:
            return name
    return tiers[-1]
