"""Two builders of one artifact folder (or of one cached native object): the second waits for
the first and takes its build.

Two `vtool serve` processes started together on one model, or parallel test workers, used to
compile the same library twice, and the later one removed the folder the earlier one had just
loaded (toolchain/build.py). Now a file lock beside the folder lets one builder in: the other
waits on it and then finds the artifact complete."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from filelock import FileLock

from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.toolchain.build import _build_into, build_from_plan
from vtool.toolchain.plan import resolve_plan


def test_a_second_builder_waits_and_takes_the_first_ones_artifact(tiny_model_dir, tmp_path):
    ckpt = open_checkpoint(tiny_model_dir)
    plan = resolve_plan(ckpt, "host")
    folder = tmp_path / "artifact"
    notes: list[str] = []
    result: dict[str, Path | BaseException] = {}

    def second_builder() -> None:
        try:
            result["folder"] = build_from_plan(plan, ckpt, output=folder, progress=notes.append)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            result["folder"] = e

    # The first builder holds the lock (as build_from_plan does) for the whole build.
    with FileLock(folder.parent / f".{folder.name}.lock"):
        waiter = threading.Thread(target=second_builder)
        waiter.start()
        time.sleep(0.5)  # the second builder finds no artifact and waits on the lock
        assert waiter.is_alive() and not notes, f"the second builder did not wait: {notes}"
        _build_into(folder, plan.cache_key(), plan, ckpt, lambda _msg: None, None)
        library = os.stat(folder / "model.so")
    waiter.join(timeout=300)
    assert result["folder"] == folder
    assert notes == [f"using cached build {folder} (another process built it meanwhile)"]
    after = os.stat(folder / "model.so")
    assert (after.st_ino, after.st_mtime_ns) == (library.st_ino, library.st_mtime_ns), "the artifact was rebuilt"


def test_parallel_builders_compile_a_native_object_once(tmp_path, monkeypatch):
    """toolchain/native_objects.py: builds asking at once for the same cached object (block_mma.cu
    for sm_90a, ~90 s of nvcc) used to compile it each; now one compiles, the others wait and take
    its object."""
    from concurrent.futures import ThreadPoolExecutor

    from vtool.toolchain.native_objects import cached_object

    monkeypatch.setenv("VTOOL_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "answer.c"
    source.write_text("int vtool_test_answer(void) { return 42; }\n")
    runs = tmp_path / "runs"

    def command(out: str) -> list[str]:  # the system C compiler, slowed so that the four overlap
        return ["sh", "-c", f'echo run >> "{runs}"; sleep 1; cc -c -fPIC "{source}" -o "{out}"']

    with ThreadPoolExecutor(4) as pool:
        objects = list(pool.map(lambda _: cached_object(source, "test-objects", "key", command), range(4)))
    assert len(set(objects)) == 1 and objects[0].stat().st_size > 0
    assert runs.read_text().count("run") == 1, "the object was compiled more than once"
    assert [p.name for p in objects[0].parent.iterdir() if p.suffix == ".o"] == [objects[0].name]
