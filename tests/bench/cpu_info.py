"""What CPU a benchmark ran on: its name, family/model and SIMD flags, read from /proc/cpuinfo.

Every CPU figure is recorded beside the CPU and its vector extensions (the same model name,
"AMD EPYC" or "Intel(R) Xeon(R) Processor", covers AVX2-only and AVX-512 parts), so the
benches share this one reader instead of each keeping its own.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# Flag prefixes that decide which kernels run (x86 and Arm).
SIMD_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "neon", "asimd", "sve")


def _first_processor() -> dict[str, str]:
    """The key: value lines of the first processor in /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_name() -> str:
    """The model name ("AMD EPYC"), else what platform says."""
    return _first_processor().get("model name") or platform.processor() or platform.machine()


def cpu_info() -> dict[str, Any]:
    """Model name, family/model/stepping (x86), core count, SIMD flags and every flag."""
    fields = _first_processor()
    flags = (fields.get("flags") or fields.get("Features") or "").split()
    return {"model_name": cpu_name(), "family": fields.get("cpu family"), "model": fields.get("model"),
            "stepping": fields.get("stepping"), "cores": os.cpu_count(),
            "simd_flags": [f for f in flags if f.startswith(SIMD_PREFIXES)], "flags": flags}


def cpu_summary() -> str:
    """One line for a log or a table: name, family/model, cores, and whether AVX-512 is there."""
    info = cpu_info()
    where = f" (family {info['family']}, model {info['model']})" if info["family"] else ""
    simd = set(info["simd_flags"])
    wide = "AVX-512" if "avx512f" in simd else "no AVX-512"
    extra = [f for f in ("avx512_vnni", "avx_vnni", "amx_int8") if f in simd]
    isa = "avx2" if "avx2" in simd else ("neon/asimd" if simd & {"neon", "asimd"} else "no AVX2")
    return f"{info['model_name']}{where}, {info['cores']} cores, {isa}, {wide}" + (
        f" ({', '.join(extra)})" if extra else "")


if __name__ == "__main__":
    print(cpu_summary())
