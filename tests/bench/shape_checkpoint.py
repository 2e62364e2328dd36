"""A checkpoint with the right names, dtypes and shapes but no data: a safetensors header
over a sparse file. `vtool build` reads only config and shapes, so a large model (the
8B-shaped benchmark) can be compiled here without writing 16 GB.

    python tests/bench/shape_checkpoint.py CONFIG.json OUT_DIR
"""
from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

from vtool.models.config import parse_hf_config
from vtool.models.weights import expected_source_shapes


def write_shape_checkpoint(config_path: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_path, out / "config.json")
    shapes = expected_source_shapes(parse_hf_config(json.loads(config_path.read_text())))
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2
        for d in shape:
            size *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)  # sparse: no data blocks are written
    return out


if __name__ == "__main__":
    print(write_shape_checkpoint(Path(sys.argv[1]), Path(sys.argv[2])))
