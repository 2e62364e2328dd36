"""The float32 inputs on which vtool's K-quant quantizers are held to llama.cpp's
(tests/bench/k_quants_vs_llama_quantize.py runs llama-quantize on them; tests/test_k_quantizers.py
holds the digests it printed): a tiny llama GGUF of tests/support/quant_gguf.py with float32
weights, and the same file with its 2-D weights' first rows crafted to reach the quantizer's
corners."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def crafted(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Rows that reach the quantizer's corners: zeros, constants, all positive (the min capped
    at 0), heavy tails, tiny and large magnitudes, a lone outlier; the rest normal."""
    rows, cols = shape
    x = rng.standard_normal(shape).astype(np.float32) * 0.02
    kinds = [np.zeros(cols), np.full(cols, 0.37), rng.uniform(0.1, 0.9, cols), rng.standard_t(2, cols) * 0.05,
             rng.standard_normal(cols) * 1e-6, rng.standard_normal(cols) * 300.0, np.where(np.arange(cols) == 5, 9.0, 0.01),
             -rng.uniform(0.0, 1.0, cols)]
    for i in range(min(rows, 4 * len(kinds))):
        x[i] = kinds[i % len(kinds)]
    return x.astype(np.float32)


def source_file(seed: int, work: Path, corners: bool) -> Path:
    """A tiny float32 llama GGUF (tests/support/quant_gguf.py), its 2-D weights replaced by
    crafted() rows when `corners`."""
    import gguf
    from quant_gguf import K_SHAPE, write_tiny_gguf

    Q = gguf.GGMLQuantizationType
    src = write_tiny_gguf(work / f"f32-{seed}.gguf", lambda _name: Q.F32, tie=False, seed=seed, shape=K_SHAPE)
    if not corners:
        return src
    reader = gguf.GGUFReader(src)
    out = work / f"corners-{seed}.gguf"
    writer = gguf.GGUFWriter(str(out), str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():  # every key/value but gguf-py's own
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    rng = np.random.default_rng(seed)
    for t in reader.tensors:
        data = np.asarray(t.data, dtype=np.float32)
        writer.add_tensor(t.name, crafted(data.shape, rng) if data.ndim == 2 else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
