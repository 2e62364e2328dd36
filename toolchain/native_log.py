"""Keep the compiler's own chatter off the terminal while vtool shows its progress.

TVM's C++ side logs warnings straight to file descriptor 2 (for example "Fast mode
segfaults when there are out-of-bounds indices" from a lowering pass during a first
build), which Python's logging cannot filter. During a build, descriptor 2 points at a
log file in the cache, and vtool's progress goes to a console on the real terminal. On
failure the error names the log so nothing is lost.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Iterator

from rich.console import Console

from vtool.runtime.paths import cache_root


def _log_path(name: str) -> Path:
    folder = cache_root() / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


@contextlib.contextmanager
def native_output_to_log(name: str) -> Iterator[tuple[Console, Path]]:
    """(a console on the real stderr, the log file that descriptor 2 is sent to)."""
    log_path = _log_path(name)
    sys.stderr.flush()
    saved = os.dup(2)
    terminal_file = os.fdopen(os.dup(saved), "w", buffering=1)
    terminal = Console(file=terminal_file, stderr=True, emoji=False)  # as vtool.runtime.cli's consoles
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield terminal, log_path
        except BaseException:
            sys.stderr.flush()
            if log_path.stat().st_size:  # a refusal before any compiling leaves it empty
                terminal.print(f"[dim]what the compiler printed: {log_path}[/]", highlight=False)
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            terminal_file.close()
    if not log_path.stat().st_size:
        log_path.unlink()
