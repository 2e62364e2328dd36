"""The allowed import graph between the rooms (docs/BUILD.md draws it).

Every `import` in the package is read with ast, including the ones inside functions (a
lazy import still breaks a runtime-only install); imports under `if TYPE_CHECKING:` are
type hints only and are skipped. A new edge that the table does not allow fails here with
the file and line, so the rooms stay what docs/BUILD.md says they are.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent

# Modules any room may import: the build/run contract and plain paths.
CONTRACTS = {"vtool", "vtool.runtime.artifact.manifest", "vtool.runtime.weights.ggml_blocks",
             "vtool.runtime.weights.fp8_layout", "vtool.runtime.paths", "vtool.runtime.artifact.draft_state"}

COMPILER_ROOMS = ("vtool.toolchain", "vtool.models", "vtool.schedules")

# room -> the rooms it may import (besides itself and CONTRACTS). A room is a top-level
# folder, or for runtime/ its subpackage or top-level module.
ALLOWED: dict[str, set[str]] = {
    "vtool.targets": set(),
    "vtool.runtime": set(),
    "vtool.runtime.paths": set(),
    "vtool.models": {"vtool.targets", "tvm"},
    "vtool.schedules": {"vtool.targets", "tvm"},
    "vtool.runtime.artifact": {"vtool.runtime.weights", "vtool.targets.host"},
    "vtool.runtime.weights": set(),
    "vtool.runtime.text": {"vtool.runtime.weights"},
    "vtool.runtime.sampling": {"vtool.runtime.artifact"},
    "vtool.runtime.engine": {"vtool.runtime.artifact", "vtool.runtime.sampling", "vtool.runtime.text"},
    "vtool.runtime.session": {"vtool.runtime.artifact", "vtool.runtime.weights", "vtool.runtime.text",
                              "vtool.runtime.engine"},
    # The engine core process (serving/engine_core.py) opens the model like any runtime command.
    "vtool.runtime.serving": {"vtool.runtime.engine", "vtool.runtime.sampling", "vtool.runtime.text",
                              "vtool.runtime.session", "vtool.runtime.weights", "vtool.runtime.artifact"},
    # The load generator is a client: it speaks HTTP and reads a tokenizer, nothing of the engine.
    "vtool.runtime.bench": {"vtool.runtime.text"},
    "vtool.runtime.run_cmd": {"vtool.runtime.engine", "vtool.runtime.sampling", "vtool.runtime.session",
                              "vtool.runtime.weights", "vtool.runtime.artifact", "vtool.runtime.text"},
    "vtool.runtime.cli": {"vtool.runtime." + r for r in ("artifact", "weights", "text", "sampling", "engine",
                                                          "session", "serving", "bench", "run_cmd")},
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("vtool", *parts))


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "vtool":
        return parts[0]
    if len(parts) >= 3 and parts[1] == "runtime":
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(path: pathlib.Path) -> list[tuple[str, int]]:
    """(imported module, line) for every absolute or relative import outside TYPE_CHECKING."""
    tree = ast.parse(path.read_text(), str(path))
    hints = _type_checking_lines(tree)
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in hints:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, node.lineno))
            # `from vtool.runtime.weights import quant_blocks` imports a module too
            found += [(f"{name}.{alias.name}", node.lineno) for alias in node.names]
    return found


def package_files() -> list[pathlib.Path]:
    rooms = ("targets", "models", "schedules", "runtime", "toolchain")
    return sorted(p for room in rooms for p in (PACKAGE / room).rglob("*.py"))


def _is_ours_or_tvm(name: str) -> bool:
    top = name.split(".")[0]
    return top in ("vtool", "tvm")


def _edge_allowed(source_room: str, target: str) -> bool:
    if target in CONTRACTS or any(target.startswith(c + ".") for c in CONTRACTS if c != "vtool"):
        return True
    target_room = room_of(target)
    if target_room == source_room:
        return True
    allowed = ALLOWED[source_room]
    return target_room in allowed or any(target == a or target.startswith(a + ".") for a in allowed)


def violations() -> list[str]:
    out = []
    for path in package_files():
        source = module_name(path)
        room = room_of(source)
        if room == "vtool.toolchain":
            continue  # the compiler may import everything
        if room not in ALLOWED:
            out.append(f"{path.relative_to(PACKAGE)}: room {room} has no row in the allowed-import table")
            continue
        for name, line in imports_of(path):
            if not _is_ours_or_tvm(name):
                continue
            if name == "vtool" or (name.startswith("vtool.") and name.count(".") == 1 and name[6:] in
                                   ("VtoolError", "__version__")):
                continue
            if not _edge_allowed(room, name):
                out.append(f"{path.relative_to(PACKAGE)}:{line}: {room} imports {name}")
    return out


def test_rooms_import_only_what_the_table_allows():
    assert violations() == []


def test_runtime_imports_no_compiler_room_and_no_tvm():
    bad = []
    for path in (PACKAGE / "runtime").rglob("*.py"):
        for name, line in imports_of(path):
            if name.split(".")[0] == "tvm" or name.startswith(COMPILER_ROOMS):
                bad.append(f"{path.relative_to(PACKAGE)}:{line}: {name}")
    assert bad == []


def test_no_runtime_library_room_imports_the_bench_client():
    bad = []
    for path in (PACKAGE / "runtime").rglob("*.py"):
        room = room_of(module_name(path))
        if room in ("vtool.runtime.bench", "vtool.runtime.cli"):
            continue
        bad += [f"{path.relative_to(PACKAGE)}:{line}" for name, line in imports_of(path)
                if name.startswith("vtool.runtime.bench")]
    assert bad == []


@pytest.mark.parametrize("source, target, allowed", [
    ("vtool.runtime.engine.engine", "vtool.toolchain.build", False),
    ("vtool.runtime.engine.engine", "tvm", False),
    ("vtool.runtime.serving.app", "vtool.runtime.engine.engine", True),
    ("vtool.runtime.engine.runner", "vtool.runtime.serving.app", False),
    ("vtool.runtime.text.tokenizer", "vtool.runtime.artifact.manifest", True),
    ("vtool.models.decoder", "vtool.schedules.cpu", False),
    ("vtool.models.decoder", "vtool.runtime.weights.ggml_blocks", True),
    ("vtool.models.decoder", "vtool.runtime.weights.gguf_reader", False),
    ("vtool.runtime.bench.command", "vtool.runtime.engine.engine", False),
])
def test_the_checker_itself_tells_allowed_from_forbidden(source, target, allowed):
    # The rules above mean something only if the checker can say no.
    assert _edge_allowed(room_of(source), target) is allowed
