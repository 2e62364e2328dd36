"""The model families vtool builds, by architecture name.

config.json's `architectures[0]` (a GGUF file's general.architecture becomes one in
runtime/weights/gguf_reader.py) picks a family (models/family.py ModelFamily): its config
normalisation, its nn.Module, its weight plan and the llama.cpp architecture of its GGUF files.
Adding a family: one file, models/<family>.py with its FAMILY, and one row in FAMILIES.
"""
from __future__ import annotations

from vtool.models import llama, olmo2, phi3, qwen2, qwen3
from vtool.models.config import ConfigError
from vtool.models.family import ModelFamily

FAMILIES: tuple[ModelFamily, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    phi3.FAMILY,
    olmo2.FAMILY,
)

# architecture -> its family, in FAMILIES order (refusals list them so)
ARCHITECTURES: dict[str, ModelFamily] = {arch: family for family in FAMILIES for arch in family.architectures}


def model_family(architecture: str) -> ModelFamily:
    """The family that builds `architecture`; another is refused, naming the registered ones."""
    family = ARCHITECTURES.get(architecture)
    if family is None:
        raise ConfigError(f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    return family
