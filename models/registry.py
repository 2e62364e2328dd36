"""The model families vtool builds, by architecture name.

config.json's `architectures[0]` (a GGUF file's general.architecture becomes one in
runtime/weights/gguf_reader.py) picks a family (models/family.py ModelFamily): its config
normalisation, its nn.Module, its weight plan and the llama.cpp architecture of its GGUF files.
Adding a family: one file, models/<family>.py with its FAMILY, and one row in FAMILIES.
"""
from __future__ import annotations

from vtool.models import bert, gemma, gpt2, llama, olmo2, phi3, qwen2, qwen3
from vtool.models import gemma_encoder, mixtral, qwen3_moe
from vtool.models.config import ConfigError
from vtool.models.family import ModelFamily

FAMILIES: tuple[ModelFamily, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    phi3.FAMILY,
    olmo2.FAMILY,
    olmo2.OLMO3,  # OLMo-2's layout with sliding-window layers
    qwen3_moe.FAMILY,  # mixture of experts (models/moe.py)
    mixtral.FAMILY,
    gemma.GEMMA2,  # the decoder with Gemma's hooks: sandwich norms, sliding-window layers, soft-capping
    gemma.GEMMA3,
    gpt2.FAMILY,  # learned positions, LayerNorm, GELU: its own module (models/gpt2_model.py)
    bert.FAMILY,  # an encoder: task "embed"
    gemma_encoder.FAMILY,  # Gemma-3's layers, bidirectional (EmbeddingGemma): task "embed"
)

# architecture -> its family, in FAMILIES order (refusals list them so)
ARCHITECTURES: dict[str, ModelFamily] = {arch: family for family in FAMILIES for arch in family.architectures}


def model_family(architecture: str) -> ModelFamily:
    """The family that builds `architecture`; another is refused, naming the registered ones."""
    family = ARCHITECTURES.get(architecture)
    if family is None:
        raise ConfigError(f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    return family
