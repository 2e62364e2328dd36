"""One read-only view of model weights, whatever file they came in.

A Checkpoint hands out a Hugging Face config.json-style dict and tensors under their
Hugging Face names, in Hugging Face (torch) layout, so everything downstream has one
input shape. Two formats sit behind it: safetensors folders (safetensors_reader) and
GGUF files (gguf_reader). Nothing here imports TVM or the compiler.
"""
from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from vtool import VtoolError

# dtype names load() accepts (numpy dtypes through numpy_dtype)
LOAD_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn")  # e4m3: an FP8 checkpoint's weights as stored


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name; bfloat16 is ml_dtypes', imported only then: the import
    registers a dozen dtypes and their ufunc loops, ~8 MiB of resident memory that a run
    without bfloat16 never uses (issue 16, `tests/test_rss.py`)."""
    if name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


class CheckpointError(VtoolError):
    """A checkpoint vtool refuses to read; names the file or tensor, what was seen and what is accepted."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str  # Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
    shape: tuple[int, ...]  # torch order, e.g. (out_features, in_features)
    dtype: str  # dtype as stored in the file: "F32", "F16", "BF16", "Q4_1", ...


class Checkpoint(abc.ABC):
    """Weights plus config of one model. Subclasses read lazily: opening is cheap."""

    path: Path
    format: str  # "safetensors" | "gguf"

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """A Hugging Face config.json-style dict."""

    @abc.abstractmethod
    def generation_config(self) -> dict[str, Any] | None:
        """generation_config.json when the checkpoint has a usable one, else None."""

    @abc.abstractmethod
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor, keyed by its Hugging Face name."""

    @abc.abstractmethod
    def _load_raw(self, name: str) -> np.ndarray:
        """The tensor in HF layout, in whatever float dtype is cheapest to produce."""

    def load(self, name: str, dtype: str = "float32") -> np.ndarray:
        """Tensor `name` in HF layout, cast to `dtype` ("float32" | "float16" | "bfloat16").

        The result may be a read-only view of a memory-mapped file: copy it before writing.
        """
        if dtype not in LOAD_DTYPES:
            raise CheckpointError(f"cannot load as dtype {dtype!r}; supported: {', '.join(LOAD_DTYPES)}")
        if name not in self.tensors():
            raise CheckpointError(f"{self.path}: no tensor named {name!r}")
        return cast(self._load_raw(name), numpy_dtype(dtype))

    def load_blocks(self, name: str) -> tuple[str, np.ndarray]:
        """A quantized tensor as it is stored: (GGML type name, raw block bytes
        [rows, row_bytes] uint8) in HF row order. Only GGUF files hold blocks."""
        raise CheckpointError(f"{self.path}: a {self.format} checkpoint holds no quantized blocks ({name!r})")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.format} {self.path}>"


def cast(arr: np.ndarray, target: np.dtype) -> np.ndarray:
    if arr.dtype == target:
        return arr
    if arr.dtype != np.float32 and target != np.float32:
        # bf16 <-> f16 through f32: the widening is exact, so there is one rounding only
        arr = arr.astype(np.float32)
    return arr.astype(target)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a safetensors model folder (config.json + model.safetensors or a sharded
    model.safetensors.index.json) or a .gguf file. Anything else is refused by name."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            from vtool.runtime.weights.gguf_reader import GGUFCheckpoint

            return GGUFCheckpoint(p)
        raise CheckpointError(
            f"{p} is not a checkpoint vtool reads; expected a .gguf file or a folder with "
            "config.json and model.safetensors (or model.safetensors.index.json)"
        )
    from vtool.runtime.weights.safetensors_reader import SafetensorsCheckpoint

    return SafetensorsCheckpoint(p)
