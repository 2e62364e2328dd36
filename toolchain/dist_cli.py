"""`vtool dist`: release files. runtime-wheel (the vtool-runtime wheel), archive (an artifact
folder as a verified .tar.gz) and verify (refuse a damaged or tampered archive, by file).
The work is in toolchain/dist.py and runtime/artifact/archive.py; this is the click layer."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Callable, Iterator

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from vtool import VtoolError

# No emoji codes: a path or name holding ":...:" would be printed as an emoji (as runtime/cli.py).
console = Console(stderr=True, emoji=False)
out = Console(emoji=False)


class _DistGroup(click.Group):
    """A VtoolError is one clear line and exit 2, also when the group runs on its own."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except VtoolError as err:
            console.print(f"[bold red]error:[/] {err}", highlight=False)
            sys.exit(2)


@contextlib.contextmanager
def _bytes_bar(label: str) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar over bytes, on stderr, gone when done."""
    with Progress(TextColumn(label), BarColumn(), DownloadColumn(), TimeRemainingColumn(), console=console,
                  transient=True) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


@click.group(cls=_DistGroup)
def dist() -> None:
    """Release files: the runtime-only wheel and verified artifact archives."""


@dist.command("runtime-wheel")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="folder to write the wheel into")
def runtime_wheel(output: str) -> None:
    """Write the vtool-runtime wheel: vtool's runtime with TVM's runtime libraries, no compiler."""
    from vtool.toolchain.dist import build_runtime_wheel

    with console.status("writing the runtime wheel") as status:
        wheel = build_runtime_wheel(Path(output), progress=status.update)
    out.print(str(wheel), highlight=False, soft_wrap=True)


@dist.command()
@click.argument("artifact_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--output", required=True, type=click.Path(dir_okay=False), help="the .tar.gz to write")
def archive(artifact_dir: str, output: str) -> None:
    """Pack ARTIFACT_DIR into a .tar.gz with SHA256SUMS and provenance.json."""
    from vtool.runtime.artifact.archive import ARCHIVE_SUFFIXES
    from vtool.toolchain.dist import write_archive

    if not output.endswith(ARCHIVE_SUFFIXES):
        raise VtoolError(f"--output {output}: an artifact archive is a {' or '.join(ARCHIVE_SUFFIXES)} file")
    with _bytes_bar("archiving") as progress:
        info = write_archive(Path(artifact_dir), Path(output), progress)
    _report(info, "wrote")


@dist.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
def verify(file: str) -> None:
    """Check an archive's sums, manifest and provenance; exit 2 naming the first file that is wrong."""
    from vtool.runtime.artifact.archive import verify_archive

    with _bytes_bar("verifying") as progress:
        info = verify_archive(Path(file), progress)
    _report(info, "verified")


def _report(info, verb: str) -> None:  # noqa: ANN001 - an archive.ArchiveInfo
    p = info.provenance
    host = p.get("build_host") or {}
    out.print(f"{verb} {info.path}: {len(info.files)} files, sha256 {info.sha256}", highlight=False, soft_wrap=True)
    out.print(f"  {info.manifest.get('arch')} for {p['target']['name']} ({info.manifest.get('dtype')}, "
              f"quantization {info.manifest.get('quantization')}); built {p.get('built_at')} on "
              f"{host.get('hostname')} ({host.get('cpu')}) with vtool {p['versions'].get('vtool')}, "
              f"TVM {p['versions'].get('tvm')}; checkpoint {p['checkpoint'].get('name')} "
              f"sha256 {p['checkpoint'].get('sha256', '')[:16]}...", highlight=False, soft_wrap=True)
