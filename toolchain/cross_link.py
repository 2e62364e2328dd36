"""Linking a CPU library for another instruction set than this machine's (aarch64 on x86-64).

TVM's LLVM codegen already writes objects for any triple it knows; what a cross build
lacks is a linker and a C library to link against. Zig's `zig cc` is both: clang + lld
with stub glibc libraries for every Linux target, shipped as a wheel (`ziglang` on PyPI,
MIT, no network needed at link time). It is an optional dependency (`vtool[cross]`): the
default install stays light and links natively with the system compiler as before.

Libraries are linked against glibc 2.17, the first glibc for aarch64, so the symbol
versions they need (libm's, when a kernel calls expf) exist on every aarch64 Linux.
"""
from __future__ import annotations

import functools
import importlib.util
import subprocess
from pathlib import Path
from typing import Callable

from vtool import VtoolError
from vtool.runtime.artifact.library_arch import host_machine, normalize
from vtool.targets import TargetSpec

INSTALL_HINT = "pip install 'vtool[cross]'  (the ziglang package: zig cc links for aarch64)"
# ISA (the first part of an LLVM triple) -> the zig target a library for it is linked for.
ZIG_TARGETS = {"aarch64": "aarch64-linux-gnu.2.17", "x86_64": "x86_64-linux-gnu.2.17"}

Fcompile = Callable[..., None]


class CrossLinkError(VtoolError):
    """No linker for the target's instruction set, or the link itself failed."""


def host_isa() -> str:
    return host_machine()


def target_isa(target_spec: TargetSpec) -> str | None:
    """The instruction set of an LLVM (CPU) target's code; None for device targets."""
    if target_spec.tvm.get("kind") != "llvm":
        return None
    triple = str(target_spec.tvm.get("mtriple", ""))
    return normalize(triple.split("-", 1)[0]) if triple else host_isa()


def needs_cross_link(target_spec: TargetSpec) -> bool:
    isa = target_isa(target_spec)
    return isa is not None and isa != host_isa()


@functools.lru_cache(maxsize=1)
def zig_executable() -> Path:
    """The zig binary of the installed ziglang wheel, refused by name when missing."""
    spec = importlib.util.find_spec("ziglang")
    if spec is None or not spec.submodule_search_locations:
        raise CrossLinkError(f"cross-linking needs the zig toolchain, which is not installed: {INSTALL_HINT}")
    zig = Path(list(spec.submodule_search_locations)[0]) / "zig"
    if not zig.is_file():
        raise CrossLinkError(f"the installed ziglang package has no zig binary at {zig}; reinstall it: {INSTALL_HINT}")
    return zig


@functools.lru_cache(maxsize=1)
def zig_version() -> str:
    done = subprocess.run([str(zig_executable()), "version"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise CrossLinkError(f"{zig_executable()} version failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip()


def zig_linker(isa: str) -> Fcompile:
    """An export_library `fcompile` that links TVM's objects into a shared library for `isa`."""
    if isa not in ZIG_TARGETS:
        raise CrossLinkError(f"no cross linker for {isa}; vtool cross-links for {', '.join(ZIG_TARGETS)}")
    zig_target = ZIG_TARGETS[isa]
    zig = zig_executable()

    def fcompile(output: str, objects: list[str], options: list[str] | None = None) -> None:
        # -lm: kernels may call libm (expf); zig links it as-needed, so it is a dependency
        # only when used. TVM's runtime symbols stay undefined and resolve at load time, as
        # in a natively linked library.
        cmd = [str(zig), "cc", "-target", zig_target, "-shared", "-fPIC", "-o", output,
               *objects, *(options or []), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise CrossLinkError(f"linking for {isa} failed (exit {done.returncode}): "
                                 f"{(done.stderr or done.stdout).strip()[-2000:]}\ncommand: {' '.join(cmd)}")

    fcompile.output_format = "so"  # type: ignore[attr-defined]
    return fcompile


def fcompile_for(target_spec: TargetSpec) -> Fcompile | None:
    """The linker export_library needs for `target_spec`: None (TVM's default, the system
    compiler) for this machine's own instruction set, zig cc for another one."""
    if not needs_cross_link(target_spec):
        return None
    isa = target_isa(target_spec)
    assert isa is not None
    try:
        return zig_linker(isa)
    except CrossLinkError as err:
        raise CrossLinkError(f"target {target_spec.name!r} is {isa} code and this machine is {host_isa()}: "
                             f"{err}") from None


def record(target_spec: TargetSpec) -> dict[str, str]:
    """The manifest's / cache key's record of the cross linker ({} for a native link)."""
    if fcompile_for(target_spec) is None:  # refuses by name when the cross linker is missing
        return {}
    return {"linker": f"zig cc {zig_version()}", "link_target": ZIG_TARGETS.get(target_isa(target_spec) or "", "")}
