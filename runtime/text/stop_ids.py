"""Which token ids end generation: config.json's eos_token_id merged with generation_config.json's.

Instruct models often list extra stop ids only in generation_config.json (e.g. Llama 3's <|eot_id|>),
so both are read. generation_config.json is optional and advisory: missing or malformed, it is ignored.
"""
from __future__ import annotations

from typing import Any, Mapping

from vtool import VtoolError


def _ids(value: Any) -> list[int] | None:
    """eos_token_id as a list, or None when it is neither an int nor a list of ints."""
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                for v in value):
        return list(value)
    return None


def stop_token_ids(config: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None) -> list[int]:
    """config's eos ids first, then generation_config's new ones; no duplicates, order kept."""
    from_config = _ids(config.get("eos_token_id"))
    if from_config is None:
        raise VtoolError(f"config.json: eos_token_id is {config.get('eos_token_id')!r}; "
                         "expected an integer id or a list of them")
    extra = _ids(generation_config.get("eos_token_id")) if isinstance(generation_config, Mapping) else None
    merged: list[int] = []
    for i in from_config + (extra or []):
        if i not in merged:
            merged.append(i)
    return merged
