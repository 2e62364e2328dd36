"""A model family: what the registry (models/registry.py) holds for each architecture.

A family is one file, models/<family>.py, defining FAMILY = ModelFamily(...), and one row in
the registry. Every part is pure Python, so the registry loads without the compiler (a
cached build never imports TVM); `module` imports TVM when it is called.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from vtool.models.config import ModelConfig
from vtool.models.weights import WeightPlan


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str  # the manifest's "family"
    architectures: tuple[str, ...]  # the config.json `architectures[0]` values it builds
    # (HF config dict, its architecture) -> the normalized ModelConfig; refuses by name
    normalize: Callable[[dict[str, Any], str], ModelConfig]
    # (ModelConfig, dtype, tvm Target, formats=None, *, int8_activations="decode",
    # int8_kernels=None) -> the tvm.relax.frontend.nn module a build exports
    module: Callable[..., Any]
    weights: WeightPlan  # HF tensor names -> compiled parameters, with named transforms
    # general.architecture of its GGUF files. llama.cpp's tensor names and metadata keys are the
    # file format's, shared by every family, so runtime/weights/gguf_reader.py holds them (the
    # runtime reads a GGUF file before it has an artifact); None: no GGUF form.
    gguf_architecture: str | None
    # what the compiled model is for: "generate" (a decoder: text out) or "embed" (an encoder
    # whose hidden states are pooled into one vector per input, runtime/engine/pooling.py); the
    # manifest records it and the runtime's entry points follow it
    task: str = "generate"
    # an embedding model's pooling when its checkpoint has no sentence-transformers config
    # (modules.json): "cls", "mean" or "last" (vLLM's default per architecture); None for "generate"
    default_pooling: str | None = None
