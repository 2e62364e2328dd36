"""The benches' CPU record (tests/bench/cpu_info.py) against util-linux's `lscpu`, an independent reader."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
from cpu_info import cpu_info, cpu_summary  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("lscpu") is None or not Path("/proc/cpuinfo").exists(),
                                reason="needs lscpu and /proc/cpuinfo")


def _lscpu() -> dict[str, str]:
    out = subprocess.run(["lscpu", "--json"], capture_output=True, text=True, check=True).stdout
    rows: dict[str, str] = {}

    def walk(entries: list[dict]) -> None:
        for entry in entries:
            rows.setdefault(entry["field"].rstrip(":"), entry.get("data") or "")
            walk(entry.get("children", []))

    walk(json.loads(out)["lscpu"])
    return rows


def test_name_family_and_flags_match_lscpu() -> None:
    theirs, ours = _lscpu(), cpu_info()
    assert ours["model_name"] == theirs["Model name"]
    if "CPU family" in theirs:
        assert ours["family"] == theirs["CPU family"]
    their_flags = set(theirs.get("Flags", "").split())
    assert set(ours["flags"]) == their_flags
    assert set(ours["simd_flags"]) <= their_flags
    assert ("avx2" in ours["simd_flags"]) == ("avx2" in their_flags)


def test_summary_says_whether_avx512_is_there() -> None:
    flags = set(_lscpu().get("Flags", "").split())
    summary = cpu_summary()
    assert ("no AVX-512" in summary) == ("avx512f" not in flags)
    assert _lscpu()["Model name"] in summary
