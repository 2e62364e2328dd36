"""`--hf-overrides`: config.json fields replaced at build time, as vLLM's flag of that name.

A user gives a JSON object, e.g. `{"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
"original_max_position_embeddings": 32768}, "max_position_embeddings": 131072}` (Qwen2.5's
long-context recipe without editing its config.json, or for a GGUF file, whose config vtool
reads from llama.cpp's keys). Each top-level key replaces the checkpoint's value whole (a nested
object is not merged into the old one); null sets the field to null (`"sliding_window": null`
removes a window). The build records the object in the manifest, and the runtime applies the
same object to the checkpoint's config wherever it reads it, so an artifact and its weights
agree without the overrides given again.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from vtool import VtoolError


class HfOverridesError(VtoolError):
    pass


def parse_hf_overrides(text: str | None) -> dict[str, Any]:
    """The --hf-overrides JSON object ({} for None or ""); anything else is refused by name."""
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise HfOverridesError(f"--hf-overrides is not JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise HfOverridesError(f"--hf-overrides must be a JSON object of config.json fields, got {type(value).__name__}: "
                               f"{text!r}")
    return value


def canonical(overrides: Mapping[str, Any]) -> str:
    """One spelling of an overrides object (sorted keys, no spaces): for the cache key."""
    return json.dumps(dict(overrides), sort_keys=True, separators=(",", ":"))


def apply_hf_overrides(config: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The checkpoint's config with each top-level field of `overrides` put in its place."""
    merged = dict(config)
    merged.update(overrides or {})
    return merged

