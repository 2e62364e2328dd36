"""Which instruction set an artifact's code is for, checked before its library is loaded.

dlopen of another architecture's ELF fails with a bare "wrong ELF class" or, worse for a
same-class file, "cannot open shared object"; vtool refuses first and says why. Two checks:
the manifest's target (its LLVM triple) against this machine, with the target's name; and
the library file's own ELF header, so a library that does not match its manifest is never
dlopen'ed either.
"""
from __future__ import annotations

import platform
import struct
from pathlib import Path
from typing import Any

from vtool.runtime.artifact.manifest import ManifestError

# ELF e_machine values (the System V gABI's registry) for the machines vtool builds for.
_ELF_MACHINES = {3: "i386", 40: "arm", 62: "x86_64", 183: "aarch64", 243: "riscv64"}
_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


def normalize(machine: str) -> str:
    machine = machine.lower()
    return _ALIASES.get(machine, machine)


def host_machine() -> str:
    return normalize(platform.machine())


def target_machine(target: dict[str, Any]) -> str | None:
    """The ISA of a manifest target's host code: the LLVM triple's first part for a CPU
    target; None where the manifest does not say (CUDA: its host code is the build machine's)."""
    tvm = target.get("tvm") or {}
    if tvm.get("kind") != "llvm" or not tvm.get("mtriple"):
        return None
    return normalize(str(tvm["mtriple"]).split("-", 1)[0])


def elf_machine(path: Path) -> str:
    """The machine an ELF file's code is for, from its header (e_machine at offset 18)."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError as err:
        raise ManifestError(f"cannot read {path}: {err}") from None
    if len(head) < 20 or head[:4] != b"\x7fELF":
        raise ManifestError(f"{path} is not an ELF shared library")
    order = "<" if head[5] == 1 else ">"  # EI_DATA: 1 little-endian, 2 big-endian
    (machine,) = struct.unpack_from(order + "H", head, 18)
    return _ELF_MACHINES.get(machine, f"ELF machine {machine}")


def check_target_runs_here(target: dict[str, Any]) -> None:
    """Refuse, by the target's name, an artifact whose code is for another ISA."""
    isa, host = target_machine(target), host_machine()
    if isa is not None and isa != host:
        raise ManifestError(
            f"artifact targets {target.get('name')}, {isa} code, and this machine is {host}: it cannot run "
            f"here. Copy the artifact folder to an {isa} Linux machine with vtool installed (the TVM runtime "
            f"is enough there), or build for --target host on this one")


def check_library_runs_here(path: Path) -> None:
    """Refuse a library file whose ELF header names another machine than this one."""
    machine, host = elf_machine(path), host_machine()
    if machine != host:
        raise ManifestError(f"{path} holds {machine} code and this machine is {host}: it cannot be loaded here; "
                            "rebuild the artifact for --target host")
