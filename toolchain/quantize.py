"""Build-time quantization of a float checkpoint: `--quantization q4_0|q4_1|q8_0|q4_k|q6_k`.

The schemes are GGML block formats that vtool's CPU and CUDA kernels already run, so a
safetensors (bf16/f16/f32) model gets the same kernels as a GGUF file of that type:

  q8_0  w = d*q, q int8                    8.5 bits per weight
  q4_0  w = d*(q-8), q 0..15               4.5 bits
  q4_1  w = d*q + m, q 0..15, a per-group min   5 bits: the int4 group-quantized scheme
        (MLC-LLM's q4f16_1 and llama.cpp's Q4_1 are the same idea; a min follows a group's
        range better than a symmetric scale)
  q4_k  llama.cpp's Q4_K: 256-weight super-blocks of 8 groups of 32, each group a 6-bit
        scale and min of the super-block's float16 d and dmin, fitted by weighted least
        squares             4.5 bits; the 4-bit type of llama.cpp's Q4_K_M files
  q6_k  llama.cpp's Q6_K: 256-weight super-blocks of 16 groups of 16, an int8 scale per
        group of the float16 d, 6-bit quants    6.56 bits; near lossless

The Q8_0/Q4_0/Q4_1/Q5_0 blocks are made by gguf-py's reference quantizer
(gguf.quants.quantize, bit for bit llama.cpp's quantize_row_*_ref); gguf-py cannot make
K-quants, so Q4_K's and Q6_K's come from toolchain/q4_k_quantizer.py and q6_k_quantizer.py,
numpy ports of quantize_row_q4_K_ref and quantize_row_q6_K_ref (their blocks equal
llama-quantize's: tests/bench/k_quants_vs_llama_quantize.py).
One tensor at a time: gguf-py widens 16 rows at a time to float32 (the K-quant ports too), so
neither a float32 copy of the model nor of one tensor is ever held, and the source tensors
are read through the checkpoint's memory map.

Which weight gets which format (`plan_formats`) follows llama.cpp's rule for its Q4_0/Q4_1
files: every linear weight takes the scheme's type except the output matrix (lm_head, or
the token embedding when it is tied and serves as lm_head), which llama.cpp keeps at Q6_K
and vtool at Q8_0 (the finest format with a kernel here, and the one gguf-py can
produce; llama.cpp's own fallback for rows that do not fit Q6_K). Logits feel the output
matrix's error directly, and it is one matrix of many, so it costs little. An untied input
embedding follows the scheme, as in llama.cpp: only one row of it is read per token.
A weight whose shape does not fit the kernels' tiles (rows a multiple of 4, columns of 32)
stays float; norms and biases are always float.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from vtool import VtoolError
from vtool.models.config import ModelConfig
from vtool.runtime.weights.ggml_blocks import keepable
from vtool.models.weights import weight_modules
from vtool.runtime.weights.checkpoint import Checkpoint
from vtool.runtime.weights.default_model import sha256_of
from vtool.runtime.weights.weights_file import STORED_DTYPES, WEIGHTS_NAME, source_fingerprint
from vtool.toolchain.q4_k_quantizer import quantize_q4_k
from vtool.toolchain.q6_k_quantizer import quantize_q6_k

# --quantization value -> the GGML type of its linear weights
SCHEMES: dict[str, str] = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0", "q4_k": "Q4_K", "q6_k": "Q6_K"}
# a weight whose columns do not fit the scheme's type takes this one (llama.cpp's rules)
FALLBACK: dict[str, str] = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}
OUTPUT_FORMAT = "Q8_0"  # lm_head / tied embedding (see the module docstring)
K_QUANT_ROWS = 16  # rows widened to float32 at a time by the K-quant ports (their arrays stay in cache)
GGUF_ARCH = "vtool-weights"  # general.architecture: not a model llama.cpp could load (HF names)


class QuantizeError(VtoolError):
    """A checkpoint that cannot be quantized at build time."""


def plan_formats(c: ModelConfig, shapes: dict[str, tuple[int, ...]], scheme: str) -> tuple[dict[str, str], list[str]]:
    """(kept: module -> GGML type, left_float: modules whose shape does not fit the tiles)."""
    base = SCHEMES[scheme]
    kept: dict[str, str] = {}
    left: list[str] = []
    for module, sources in weight_modules(c).items():
        output = module == "lm_head" or (module == "model.embed_tokens" and c.tie_word_embeddings)
        fmt = OUTPUT_FORMAT if output else base
        if not all(keepable(fmt, *shapes[s]) for s in sources) and fmt in FALLBACK:
            fmt = FALLBACK[fmt]
        if all(keepable(fmt, *shapes[s]) for s in sources):
            kept[module] = fmt
        else:
            left.append(module)
    return kept, left


def quantized_sources(c: ModelConfig, kept: dict[str, str]) -> dict[str, str]:
    """HF tensor name -> GGML type, for every source tensor of a kept module."""
    modules = weight_modules(c)
    return {name: fmt for module, fmt in kept.items() for name in modules[module]}


def source_key(ckpt: Checkpoint, sources: dict[str, str]) -> str:
    """What the build cache key adds for weights quantized into the artifact: the content
    fingerprint (runtime/weights/weights_file.py) and each data file's size and modification time,
    so that no edit of the checkpoint ever reuses blocks made from its old weights."""
    h = hashlib.sha256(source_fingerprint(ckpt, sources).encode())
    for f in sorted(Path(ckpt.path).glob("*.safetensors*")):
        st = f.stat()
        h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def write_weights(ckpt: Checkpoint, sources: dict[str, str], scheme: str, folder: Path,
                  progress: Callable[[str], None]) -> dict[str, Any]:
    """Quantize `sources` (HF name -> GGML type) into folder/WEIGHTS_NAME, one tensor at a
    time; returns the manifest's `weights_file` record."""
    import gguf

    infos = ckpt.tensors()
    path = Path(folder) / WEIGHTS_NAME
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH)
    writer.add_string("vtool.quantization", scheme)
    writer.add_string("vtool.quantizer", _quantizer())
    for name, fmt in sources.items():
        info = infos[name]
        if info.dtype not in STORED_DTYPES:
            raise QuantizeError(f"{ckpt.path}: tensor {name!r} is stored as {info.dtype}; --quantization {scheme} "
                                f"quantizes float tensors ({', '.join(STORED_DTYPES)})")
        qtype = gguf.GGMLQuantizationType[fmt]
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = math.prod(info.shape[:-1]) * (info.shape[-1] // block) * type_size
        writer.add_tensor_info(name, info.shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    progress(f"quantizing {len(sources)} weights to {scheme}")
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, fmt in sources.items():
            # The stored dtype: a view of the mapped file, widened 16 rows at a time by gguf-py.
            data = ckpt.load(name, STORED_DTYPES[infos[name].dtype])
            writer.write_tensor_data(quantize_blocks(data, fmt))
            del data
    finally:
        writer.close()
    counts: dict[str, int] = {}
    for fmt in sources.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    return {"file": WEIGHTS_NAME, "scheme": scheme, "bytes": path.stat().st_size, "sha256": sha256_of(path),
            "tensors": counts, "source_format": ckpt.format, "sources": sorted(sources),
            "source_fingerprint": source_fingerprint(ckpt, sources), "quantizer": _quantizer()}


def quantize_blocks(data: np.ndarray, fmt: str) -> np.ndarray:
    """A float [..., K] tensor as GGML `fmt` blocks: gguf-py's quantizer, or vtool's ports for
    the K-quants gguf-py cannot make."""
    import gguf

    port = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}.get(fmt)
    if port is not None:
        rows = data.reshape(-1, data.shape[-1])
        out = np.concatenate([port(rows[i:i + K_QUANT_ROWS]) for i in range(0, len(rows), K_QUANT_ROWS)])
        return out.reshape(*data.shape[:-1], out.shape[-1])
    return gguf.quants.quantize(data, gguf.GGMLQuantizationType[fmt])


def _quantizer() -> str:
    return (f"gguf-py {_gguf_version()} gguf.quants.quantize; Q4_K, Q6_K: vtool's ports of quantize_row_q4_K_ref, "
            "quantize_row_q6_K_ref")


def _gguf_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
