"""Checkpoint readers (GGUF, safetensors, build-quantized weights), quantized blocks, named transforms
and the embedded default model: everything between a file on disk and a weight array."""
