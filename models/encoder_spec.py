"""The one entry point every embedding model's compiled module exports (models/bert.py,
models/gemma_encoder.py), as runtime/engine/embed.py calls it:

  encode(input_ids[b, n] int32, attention_mask[b, n] int32) -> hidden states [b, n, H] float32

Imports TVM when called, like the families' `module` functions.
"""
from __future__ import annotations


def encode_spec() -> dict:
    """get_default_spec()'s value for an encoder module: `encode` over a padded batch."""
    from tvm.relax.frontend import nn

    ids = nn.spec.Tensor(["batch_size", "seq_len"], "int32")
    mask = nn.spec.Tensor(["batch_size", "seq_len"], "int32")
    return {"encode": {"input_ids": ids, "attention_mask": mask, "$": {"param_mode": "packed", "effect_mode": "none"}}}
