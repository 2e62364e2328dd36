"""Target table (vtool.targets.table) and host detection (vtool.targets.host)."""
from vtool.targets.table import ROWS, TargetError, TargetSpec, buildable, buildable_names, lookup

__all__ = ["ROWS", "TargetError", "TargetSpec", "buildable", "buildable_names", "lookup"]
