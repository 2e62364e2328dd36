"""Pooling: an embedding model's hidden states -> one vector per input, on the host in numpy.

The compiled library of an embedding model stops at the last layer's hidden states
(entry point `encode`, manifest task "embed"); what comes after is the checkpoint's
sentence-transformers configuration, read from its folder here, the way sentence-transformers
and vLLM read it:

  modules.json                  the pipeline: Transformer, Pooling, Dense..., Normalize
  <Pooling path>/config.json    pooling_mode_cls_token | pooling_mode_mean_tokens | pooling_mode_lasttoken
  <Dense path>/config.json      in_features, out_features, bias, activation_function (Identity, Tanh)
  <Dense path>/model.safetensors  linear.weight [out, in], linear.bias [out]
  sentence_bert_config.json     max_seq_length (caps the context, as vLLM does)
  config.json                   matryoshka_dimensions / is_matryoshka (whether `dimensions` may truncate)

Without modules.json the family's default pooling applies (the manifest's default_pooling: CLS
for BERT, as vLLM's default), normalized. Anything else (max or weighted-mean pooling, several
pooling modes at once, include_prompt false, another module type, Dense weights only in
pytorch_model.bin) is refused by name, never approximated.

Order (vLLM's EmbeddingPoolerHead): pool -> Dense layers -> Matryoshka truncation to `dimensions`
-> L2 normalization (when Normalize is in modules.json). Nothing here is model-specific, so any
embedding model whose library returns hidden states [b, n, H] plugs in.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from vtool import VtoolError

POOLING_MODES = ("cls", "mean", "last")
# sentence-transformers' Pooling config key -> our mode
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
_ST_REFUSED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ACTIVATIONS = {"torch.nn.modules.linear.Identity": None, "torch.nn.modules.activation.Tanh": np.tanh}
_MODULE = "sentence_transformers.models."


class PoolingError(VtoolError):
    """A pooling configuration vtool cannot apply, or a request it cannot serve (`dimensions`)."""


@dataclasses.dataclass(frozen=True)
class Dense:
    weight: np.ndarray  # [out, in] float32
    bias: np.ndarray | None
    activation: str  # the sentence-transformers class name, for describe()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        fn = _ACTIVATIONS[self.activation]
        return fn(y) if fn is not None else y


@dataclasses.dataclass(frozen=True)
class Pooler:
    mode: str  # POOLING_MODES
    normalize: bool
    dense: tuple[Dense, ...] = ()
    hidden_size: int = 0
    matryoshka: bool = False  # `dimensions` may truncate (config.json says the model was trained for it)
    matryoshka_dimensions: tuple[int, ...] | None = None  # the sizes it was trained for, when it lists them
    max_seq_length: int | None = None  # sentence_bert_config.json's
    source: str = ""  # where the configuration came from

    @property
    def dim(self) -> int:
        """The length of the vectors (before any `dimensions` truncation)."""
        return self.dense[-1].weight.shape[0] if self.dense else self.hidden_size

    def describe(self) -> dict[str, Any]:
        return {"pooling": self.mode, "normalize": self.normalize,
                "dense": [[int(d.weight.shape[1]), int(d.weight.shape[0]), d.activation.rsplit(".", 1)[-1]]
                          for d in self.dense],
                "dim": self.dim, "matryoshka": self.matryoshka_dimensions or self.matryoshka, "source": self.source}

    # -- requests ------------------------------------------------------------------------------
    def check_dimensions(self, dimensions: int | None, model_name: str) -> None:
        """Refuse `dimensions` the model cannot give, with vLLM's words."""
        if dimensions is None:
            return
        if not self.matryoshka:
            raise PoolingError(f'Model "{model_name}" does not support matryoshka representation, changing output '
                               "dimensions will lead to poor results.")
        if self.matryoshka_dimensions is not None:
            if dimensions not in self.matryoshka_dimensions:
                raise PoolingError(f'Model "{model_name}" only supports {list(self.matryoshka_dimensions)} matryoshka '
                                   "dimensions, use other output dimensions will lead to poor results.")
        elif dimensions < 1:
            raise PoolingError("Dimensions must be greater than 0")
        if dimensions > self.dim:
            raise PoolingError(f"dimensions={dimensions} is more than the model's {self.dim}")

    # -- the math --------------------------------------------------------------------------------
    def pool(self, hidden: np.ndarray, lengths: Sequence[int]) -> np.ndarray:
        """hidden [b, n, H] of right-padded sequences of `lengths` -> [b, H] float32."""
        rows = []
        for i, n in enumerate(lengths):
            h = hidden[i, :n]
            if self.mode == "cls":
                rows.append(h[0])
            elif self.mode == "last":
                rows.append(h[n - 1])
            else:  # mean over the tokens (float64 sum: the order does not change the result)
                rows.append(h.astype(np.float64).mean(axis=0))
        return np.stack(rows).astype(np.float32)

    def finish(self, pooled: np.ndarray, dimensions: int | None = None) -> np.ndarray:
        """Dense layers, then truncation to `dimensions` (checked already), then normalization."""
        x = pooled.astype(np.float32)
        with one_blas_thread():
            for layer in self.dense:
                x = layer(x).astype(np.float32)
        if dimensions is not None:
            x = x[:, :dimensions]
        if self.normalize:
            norm = np.linalg.norm(x.astype(np.float64), axis=-1, keepdims=True)
            x = (x / np.maximum(norm, 1e-12)).astype(np.float32)
        return np.ascontiguousarray(x)


_BLAS: Any = None  # threadpoolctl's controller, made on first use (it scans the loaded libraries)


def one_blas_thread() -> Any:
    """A context in which numpy's BLAS runs on one thread. The dense layers are a few rows each
    (milliseconds alone), but right after the encoder TVM's pool threads still spin on the other
    cores, and a multi-threaded BLAS call then waited for them: EmbeddingGemma's two dense layers
    over 4 short texts took 58 ms inside LLM.embed, 1.2 ms alone (2-core Xeon)."""
    global _BLAS
    if _BLAS is None:
        from threadpoolctl import ThreadpoolController

        _BLAS = ThreadpoolController()
    return _BLAS.limit(limits=1, user_api="blas")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PoolingError(f"{path}: not readable JSON ({e})") from None


def _st_pooling(folder: Path) -> str:
    cfg = _read_json(folder / "config.json")
    on = [key for key, value in cfg.items() if key.startswith("pooling_mode_") and value]
    refused = [key for key in on if key in _ST_REFUSED or key not in _ST_MODES]
    if refused:
        raise PoolingError(f"{folder / 'config.json'}: {', '.join(refused)} is not supported; supported pooling: "
                           f"{', '.join(_ST_MODES)}")
    if len(on) != 1:
        raise PoolingError(f"{folder / 'config.json'}: needs exactly one pooling mode, got {on or 'none'} "
                           f"(supported: {', '.join(_ST_MODES)})")
    if cfg.get("include_prompt", True) is False:
        raise PoolingError(f"{folder / 'config.json'}: include_prompt false (an instruction excluded from the "
                           "pooling) is not supported")
    return _ST_MODES[on[0]]


def _load_safetensors(file: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return {name: value.astype(np.float32) for name, value in load_file(str(file)).items()}
    except Exception as e:  # noqa: BLE001 - the library raises plain errors (bfloat16 has no numpy type)
        raise PoolingError(f"{file}: Dense weights not readable as float32/float16 safetensors ({e})") from None


def _st_dense(folder: Path) -> Dense:
    cfg = _read_json(folder / "config.json")
    act = cfg.get("activation_function", "torch.nn.modules.linear.Identity")
    if act not in _ACTIVATIONS:
        raise PoolingError(f"{folder / 'config.json'}: activation_function {act!r} is not supported; supported: "
                           f"{', '.join(_ACTIVATIONS)}")
    file = folder / "model.safetensors"
    if not file.is_file():
        found = sorted(p.name for p in folder.iterdir())
        raise PoolingError(f"{folder}: Dense weights must be in model.safetensors (found: {', '.join(found)}; "
                           "pytorch_model.bin is not read)")
    tensors = _load_safetensors(file)
    if "linear.weight" not in tensors:
        raise PoolingError(f"{file}: no 'linear.weight' (has {sorted(tensors)})")
    weight = tensors["linear.weight"]
    want = (int(cfg.get("out_features", weight.shape[0])), int(cfg.get("in_features", weight.shape[1])))
    if weight.shape != want:
        raise PoolingError(f"{file}: linear.weight is {list(weight.shape)}, config.json says {list(want)}")
    bias = tensors.get("linear.bias") if cfg.get("bias", True) else None
    return Dense(np.ascontiguousarray(weight), bias, act)


def _matryoshka(model_config: dict[str, Any]) -> tuple[bool, tuple[int, ...] | None]:
    dims = model_config.get("matryoshka_dimensions")
    if dims is not None and (not isinstance(dims, list) or not all(isinstance(d, int) and d > 0 for d in dims)):
        raise PoolingError(f"config.json: matryoshka_dimensions must be a list of positive integers, got {dims!r}")
    return bool(dims) or bool(model_config.get("is_matryoshka", False)), (tuple(dims) if dims else None)


def sentence_max_seq_length(folder: Path) -> int | None:
    """sentence_bert_config.json's max_seq_length, None when the folder has none."""
    file = Path(folder) / "sentence_bert_config.json"
    if not file.is_file():
        return None
    value = _read_json(file).get("max_seq_length")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def load_pooler(folder: Path | None, hidden_size: int, default_pooling: str | None,
                model_config: dict[str, Any] | None = None) -> Pooler:
    """The pooling a checkpoint folder's sentence-transformers files say (module docstring); the
    family's `default_pooling`, normalized, when there are none (a GGUF file, a bare HF folder)."""
    model_config = model_config or {}
    matryoshka, dims = _matryoshka(model_config)
    modules_file = folder / "modules.json" if folder is not None and folder.is_dir() else None
    max_seq = sentence_max_seq_length(folder) if modules_file is not None else None
    if modules_file is None or not modules_file.is_file():
        if default_pooling not in POOLING_MODES:
            raise PoolingError(f"no sentence-transformers modules.json and no default pooling for this model "
                               f"(got {default_pooling!r}; supported: {', '.join(POOLING_MODES)})")
        return Pooler(default_pooling, True, (), hidden_size, matryoshka, dims, max_seq, "default")
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise PoolingError(f"{modules_file}: must be a list of modules")
    mode, normalize, dense = None, False, []
    for entry in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(entry.get("type", ""))
        path = folder / str(entry.get("path", ""))
        name = kind[len(_MODULE):] if kind.startswith(_MODULE) else kind
        if name == "Transformer" or kind.endswith(".Transformer"):
            continue
        if name == "Pooling":
            mode = _st_pooling(path)
        elif name == "Dense":
            dense.append(_st_dense(path))
        elif name == "Normalize":
            normalize = True
        else:
            raise PoolingError(f"{modules_file}: module {kind!r} is not supported; supported: Transformer, Pooling, "
                               "Dense, Normalize")
    if mode is None:
        raise PoolingError(f"{modules_file}: no Pooling module")
    width = hidden_size
    for d in dense:
        if d.weight.shape[1] != width:
            raise PoolingError(f"{modules_file}: a Dense layer takes {d.weight.shape[1]} features, its input has {width}")
        width = d.weight.shape[0]
    return Pooler(mode, normalize, tuple(dense), hidden_size, matryoshka, dims, max_seq, str(modules_file))


def to_base64(vector: np.ndarray) -> str:
    """encoding_format "base64": the little-endian float32 bytes, base64 (as OpenAI and vLLM)."""
    import base64

    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
