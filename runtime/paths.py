"""Where vtool keeps what it fetches and builds."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """VTOOL_CACHE_DIR, else $XDG_CACHE_HOME/vtool, else ~/.cache/vtool."""
    if os.environ.get("VTOOL_CACHE_DIR"):
        return Path(os.environ["VTOOL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vtool"


def artifact_cache() -> Path:
    return cache_root() / "artifacts"
