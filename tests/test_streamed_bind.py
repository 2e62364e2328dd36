"""Weights kept in GGUF blocks are bound a row chunk at a time (issue 16, peak memory of
`vtool run`: runtime/weights/block_rows.py, CompiledModel._bind_streamed): each chunk is read,
repacked and written into the runtime's tensor, so the whole tensor's bytes and its repacked
copy are never resident beside the bound weights. What is bound must not change: chunked
reads give the file's rows in HF order (llama.cpp's Q/K row permutation undone per chunk),
chunked repacking equals repacking the whole tensor, and a model bound with chunks of one
tile holds the same bytes as one bound the old way (whole tensors through _BlockCache).
"""
from __future__ import annotations

import numpy as np
import pytest
from quant_gguf import K_SHAPE, SHAPE, Q, gguf_name, hf_weights, quantize, write_tiny_gguf
from vtool.runtime.weights.block_rows import BlockRows
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.runtime.weights.ggml_blocks import TILE_ROWS
from vtool.runtime.weights.gguf_reader import GGUFCheckpoint
from vtool.runtime.weights.quant_blocks import repack

# Q/K permuted by the llama converter, several formats, 32- and 256-weight blocks.
MIXES = {
    "mixed": (lambda name: Q.Q8_0 if ".attn_v." in name else Q.Q4_1 if name != "output.weight" else Q.Q4_0,
              False, SHAPE),
    "q4_k_m": (lambda name: Q.Q6_K if ".attn_v." in name or ".ffn_down." in name or name == "output.weight"
               else Q.Q4_K, False, K_SHAPE),
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_chunked_reads_and_repacks_equal_the_whole(mix, tmp_path):
    qtype_of, tie, shape = MIXES[mix]
    path = write_tiny_gguf(tmp_path / "m.gguf", qtype_of, tie=tie, shape=shape)
    ck = open_checkpoint(path)
    hf = hf_weights(np.random.default_rng(0), tie, shape)
    checked = 0
    for name, w in hf.items():
        if w.ndim != 2:
            continue
        qtype = qtype_of(gguf_name(name))
        truth = quantize(w, qtype).reshape(w.shape[0], -1)  # HF rows, quantized row by row
        rows = ck.block_rows(name)
        assert (rows.kind, rows.rows, rows.row_bytes) == (qtype.name, truth.shape[0], truth.shape[1])
        assert (rows.order is not None) == (".q_proj." in name or ".k_proj." in name)
        whole = repack(rows.kind, truth, w.shape[1])
        for step in (TILE_ROWS, 3 * TILE_ROWS, 5 * TILE_ROWS, rows.rows):
            starts = range(0, rows.rows, step)
            chunks = [rows.read(s, min(rows.rows, s + step)) for s in starts]
            np.testing.assert_array_equal(np.concatenate(chunks), truth, err_msg=f"{name}, {step} rows a read")
            parts = [repack(rows.kind, c, w.shape[1]) for c in chunks]
            for part, value in whole.items():
                np.testing.assert_array_equal(np.concatenate([p[part] for p in parts]), value,
                                              err_msg=f"{name} {part}, {step} rows a chunk")
        np.testing.assert_array_equal(ck.load_blocks(name)[1], truth)
        checked += 1
    assert checked == len([w for w in hf.values() if w.ndim == 2])


def _bound(artifact, path) -> list[np.ndarray]:
    from vtool.runtime.artifact.library import CompiledModel

    model = CompiledModel(artifact, open_checkpoint(path))
    return [np.from_dlpack(p).copy() for p in model.params]


def test_streamed_binding_binds_what_the_whole_tensor_path_binds(tmp_path, monkeypatch):
    """The "mixed" file: a fused q|k (concat_rows of two permuted sources) in one format and v
    in another, a Q4_0 lm_head, Q4_1 layers, F32 norms."""
    from vtool.runtime.artifact import library
    from vtool.toolchain.build import build_artifact

    qtype_of, tie, shape = MIXES["mixed"]
    path = write_tiny_gguf(tmp_path / "m.gguf", qtype_of, tie=tie, shape=shape)
    artifact = build_artifact(path, "host", "float32", checkpoint=open_checkpoint(path), quantization="gguf")
    monkeypatch.setattr(library, "STREAM_CHUNK_BYTES", 1)  # one tile of rows per chunk
    asked: list[int] = []
    read = BlockRows.read

    def recorded(self, start, stop):
        asked.append(stop - start)
        return read(self, start, stop)

    def whole_tensor(self, name):
        raise AssertionError(f"{name} was read whole")

    with monkeypatch.context() as m:
        m.setattr(BlockRows, "read", recorded)
        m.setattr(GGUFCheckpoint, "load_blocks", whole_tensor)
        streamed = _bound(artifact, path)
    assert asked and max(asked) == TILE_ROWS  # every kept weight, one tile at a time
    monkeypatch.setattr(library, "_streams", lambda entry, source: False)  # whole tensors, _BlockCache
    whole = _bound(artifact, path)
    assert len(streamed) == len(whole)
    for i, (a, b) in enumerate(zip(streamed, whole)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"parameter {i}")
