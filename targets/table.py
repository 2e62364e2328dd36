"""The target table: every name `vtool build --target` knows, its TVM target and feature set.

A row that this build cannot produce yet stays in the table (so `vtool build` can say
"known, not buildable yet" instead of "unknown") and carries the reason.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from vtool import VtoolError


class TargetError(VtoolError):
    """Unknown or unbuildable target; the message lists what is accepted."""


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    name: str
    family: str  # "x86" | "cuda" | "rocm" | "vulkan" | "metal" | "arm"
    tvm: dict[str, Any]  # the JSON form of tvm.target.Target (CLI strings are refused by TVM 0.27)
    features: tuple[str, ...]  # what kernels compiled for this row may use
    # CPU feature flags (Linux /proc/cpuinfo spelling, equal to LLVM's for these) a machine
    # needs to execute the code; the runtime refuses an artifact whose flags are missing.
    requires_cpu: tuple[str, ...] = ()
    buildable: bool = True
    not_buildable_reason: str = ""
    # CUDA only: the real architectures the fatbin holds SASS for (nvcc spelling, e.g.
    # "sm_90a"), oldest first; the library also carries PTX for `ptx` (the newest one's
    # family-portable virtual arch) so that newer GPUs can JIT it.
    archs: tuple[str, ...] = ()

    @property
    def ptx(self) -> str:
        """The virtual arch whose PTX rides along (CUDA only): compute_<newest, without a/f>."""
        return f"compute_{sm_number(self.archs[-1])}" if self.archs else ""

    def describe(self) -> dict[str, Any]:
        out = {"name": self.name, "family": self.family, "tvm": self.tvm, "features": list(self.features),
               "requires_cpu": list(self.requires_cpu)}
        if self.family == "cuda":
            out["archs"] = list(self.archs)
            out["ptx"] = self.ptx
        return out


def _x86(name: str, mcpu: str, features: tuple[str, ...], requires: tuple[str, ...]) -> TargetSpec:
    tvm = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": mcpu}
    return TargetSpec(name, "x86", tvm, features, requires)


def _arm(name: str, mattr: list[str], features: tuple[str, ...], requires: tuple[str, ...]) -> TargetSpec:
    tvm = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "generic", "mattr": mattr}
    return TargetSpec(name, "arm", tvm, features, requires)


def sm_number(arch: str) -> int:
    """90 for "sm_90", "sm_90a", "compute_90"; the a/f suffix names an arch-specific or
    family-specific variant of the same compute capability."""
    digits = arch.split("_", 1)[1].rstrip("af")
    return int(digits)


def _cuda_tvm(arch: str) -> dict[str, Any]:
    # TVM's target carries the plain "sm_NN": DLight's Matmul rule parses the number with
    # isdigit() and turns tensor cores off for "sm_90a". The a/f suffix only matters to nvcc
    # (arch-specific SASS), which vtool drives itself (toolchain/cuda.py).
    return {"kind": "cuda", "arch": f"sm_{sm_number(arch)}", "max_threads_per_block": 1024,
            "max_num_threads": 1024, "max_shared_memory_per_block": 49152, "thread_warp_size": 32,
            "registers_per_block": 65536}


def _cuda(sm: str, features: tuple[str, ...]) -> TargetSpec:
    arch = sm if sm.startswith("sm_") else f"sm_{sm}"
    return TargetSpec(arch, "cuda", _cuda_tvm(arch), features, archs=(arch,))


_AMPERE = ("tensor-core-mma", "bf16", "fp16", "tf32", "cp.async", "ldmatrix")
_ADA = _AMPERE + ("fp8-e4m3", "fp8-e5m2")
_HOPPER = _ADA + ("wgmma", "tma", "thread-block-clusters")
_BLACKWELL = _HOPPER[:-3] + ("tcgen05", "tma", "thread-block-clusters", "fp6", "fp4-nvfp4", "fp4-mxfp4")
_BLACKWELL_CONSUMER = _ADA + ("mma-fp4", "fp6", "fp4-nvfp4", "fp4-mxfp4", "tma")

ROWS: tuple[TargetSpec, ...] = (
    # x86: the portable row runs on any x86-64 CPU (the psABI baseline is SSE2, so the
    # sse2 row compiles the same instructions and exists for the name people ask for).
    _x86("x86-portable", "x86-64", ("sse2",), ("sse2",)),
    _x86("x86-sse2", "x86-64", ("sse2",), ("sse2",)),
    _x86("x86-avx2", "haswell", ("sse2", "avx", "avx2", "fma", "f16c", "bmi2"), ("avx", "avx2", "fma", "f16c")),
    _x86("x86-avx512", "skylake-avx512",
         ("sse2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
         ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq")),
    # AVX-512 with VNNI (vpdpbusd): Cascade Lake, Ice Lake and later Xeons, Zen 4/5. The
    # decode GEMVs over GGUF blocks multiply 8-bit quants with it (schedules/cpu/int8_gemv.py).
    _x86("x86-avx512-vnni", "cascadelake",
         ("sse2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq",
          "avx512vnni"),
         ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")),
    _cuda("sm_80", _AMPERE),
    _cuda("sm_86", _AMPERE),
    _cuda("sm_87", _AMPERE),
    _cuda("sm_89", _ADA),
    _cuda("sm_90a", _HOPPER),
    _cuda("sm_100a", _BLACKWELL),
    _cuda("sm_103a", _BLACKWELL),
    # Thor: CUDA 13 renamed sm_101 to sm_110 (nvcc 13 refuses sm_101).
    _cuda("sm_110a", _BLACKWELL),
    _cuda("sm_120a", _BLACKWELL_CONSUMER),
    _cuda("sm_121a", _BLACKWELL_CONSUMER),
    TargetSpec("rocm", "rocm", {"kind": "rocm", "mcpu": "gfx942"}, ("mfma", "bf16", "fp16"), (), False,
               "the apache-tvm wheel has no ROCm runtime (USE_ROCM=OFF); it needs a TVM built from source"),
    TargetSpec("vulkan", "vulkan", {"kind": "vulkan"}, ("spirv", "fp16"), (), False,
               "the apache-tvm wheel has no SPIR-V codegen (USE_VULKAN=OFF)"),
    TargetSpec("metal", "metal", {"kind": "metal"}, ("simdgroup-matrix", "fp16", "bf16"), (), False,
               "the apache-tvm wheel has no Metal runtime and this machine cannot link for macOS"),
    # aarch64 Linux: built here with LLVM and linked by zig cc (toolchain/cross_link.py,
    # the `cross` extra); the CPU schedules are the x86 ones at 4 float32 lanes (128-bit NEON).
    # requires_cpu in Linux's /proc/cpuinfo "Features" spelling (asimd = Advanced SIMD).
    _arm("aarch64-neon", ["+neon"], ("neon", "fp16"), ("asimd",)),
)

_BY_NAME = {row.name: row for row in ROWS}
# Spellings people use for the same row.
ALIASES = {"sm_90": "sm_90a", "sm_100": "sm_100a", "sm_103": "sm_103a", "sm_110": "sm_110a", "sm_101": "sm_110a",
           "sm_101a": "sm_110a", "sm_120": "sm_120a", "sm_121": "sm_121a", "neon": "aarch64-neon",
           "x86": "x86-portable"}


def buildable_names() -> list[str]:
    return ["host"] + [r.name for r in ROWS if r.buildable]


def lookup(name: str) -> TargetSpec:
    """The row for a target name; `host` resolves to the best tier this CPU can execute;
    a comma-separated list of CUDA rows ("sm_80,sm_90a") is one multi-arch target."""
    if "," in name:
        return _multi_arch(name)
    if name == "host":
        from vtool.targets.host import best_host_target

        return _BY_NAME[best_host_target()]
    row = _BY_NAME.get(ALIASES.get(name, name))
    if row is None:
        known = ", ".join(["host"] + [r.name for r in ROWS])
        raise TargetError(f"unknown target {name!r}; known targets: {known}")
    return row


def _multi_arch(name: str) -> TargetSpec:
    """One library for several CUDA archs: SASS for each, PTX of the newest; the kernels are
    generated for the oldest (so they are valid on all) and may use only the features every
    listed arch has."""
    parts = [p.strip() for p in name.split(",") if p.strip()]
    rows: dict[str, TargetSpec] = {}
    for part in parts:
        row = lookup(part)
        if row.family != "cuda":
            raise TargetError(f"a multi-arch target combines CUDA rows only; {part!r} is a {row.family} target "
                              f"(CUDA rows: {', '.join(r.name for r in ROWS if r.family == 'cuda')})")
        rows[row.name] = row
    ordered = sorted(rows.values(), key=lambda r: (sm_number(r.name), r.name))
    if len(ordered) == 1:
        return ordered[0]
    features = tuple(f for f in ordered[0].features if all(f in r.features for r in ordered[1:]))
    unbuildable = [r for r in ordered if not r.buildable]
    return TargetSpec(",".join(r.name for r in ordered), "cuda", _cuda_tvm(ordered[0].name), features,
                      buildable=not unbuildable,
                      not_buildable_reason="; ".join(f"{r.name}: {r.not_buildable_reason}" for r in unbuildable),
                      archs=tuple(r.name for r in ordered))


def buildable(name: str) -> TargetSpec:
    """The row for `name`, refusing by name a target this build cannot produce yet."""
    row = lookup(name)
    if not row.buildable:
        raise TargetError(
            f"target {row.name!r} cannot be built yet: {row.not_buildable_reason}; "
            f"buildable targets: {', '.join(buildable_names())}"
        )
    return row
