"""vtool's Q4_K quantizer (toolchain/q4_k_quantizer.py) against llama.cpp's own: a tiny llama
GGUF with float32 weights (columns multiples of 256) is quantized by `llama-quantize --pure
... Q4_K` (the llama.cpp of the llama-cpp-python sdist, built by tests/bench/llamacpp.py) and
every tensor's blocks are compared with vtool's quantization of the same floats: how many of
the 144-byte super-blocks are identical, and where not, how the two dequantized tensors'
errors compare (llama.cpp's build contracts `a*b + c` into FMA where the CPU has it, a
rounding numpy does not make, so a rare tie can go the other way).

    python tests/bench/q4_k_vs_llama_quantize.py [--seeds 3] [--build]

Each seed runs twice: the tiny model's normal weights, and rows crafted to reach the
quantizer's corners (zeros, constants, all positive, heavy tails, 1e-6 and 300 scales, a lone
outlier). One JSON line per run and a summary; exit status 1 when fewer than 99% of the blocks match.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def compare(seed: int, tool: Path, work: Path, corners: bool) -> dict:
    import gguf

    from vtool.toolchain.q4_k_quantizer import BLOCK_BYTES, quantize_q4_k

    from q4_k_cases import source_file

    Q = gguf.GGMLQuantizationType
    src = source_file(seed, work, corners)
    out = work / f"q4k-{seed}-{int(corners)}.gguf"
    subprocess.run([str(tool), "--pure", str(src), str(out), "Q4_K"], check=True, capture_output=True)
    floats = {t.name: np.asarray(t.data, dtype=np.float32) for t in gguf.GGUFReader(src).tensors}
    same = total = 0
    worse = 0
    for t in gguf.GGUFReader(out).tensors:
        if t.tensor_type != Q.Q4_K:
            continue
        theirs = np.asarray(t.data).reshape(-1, BLOCK_BYTES)
        x = floats[t.name]
        ours = quantize_q4_k(x).reshape(-1, BLOCK_BYTES)
        equal = np.all(theirs == ours, axis=1)
        same += int(equal.sum())
        total += len(equal)
        if not equal.all():  # is ours any worse where it differs?
            err = {}
            for who, blocks in (("theirs", theirs), ("ours", ours)):
                y = gguf.quants.dequantize(blocks.reshape(-1), Q.Q4_K).reshape(-1, 256)
                err[who] = ((y - x.reshape(-1, 256)) ** 2).sum(axis=1)[~equal].sum()
            worse += int(err["ours"] > err["theirs"] * 1.001)
    return {"seed": seed, "corners": corners, "blocks": total, "identical": same, "fraction": round(same / max(total, 1), 6),
            "tensors_where_ours_is_worse": worse}


def digest(seed: int, tool: Path, work: Path, corners: bool) -> str:
    """sha256 of llama-quantize's Q4_K blocks of one source file, tensors by name."""
    import hashlib

    import gguf
    from q4_k_cases import source_file

    src = source_file(seed, work, corners)
    out = work / f"digest-{seed}-{int(corners)}.gguf"
    subprocess.run([str(tool), "--pure", str(src), str(out), "Q4_K"], check=True, capture_output=True)
    h = hashlib.sha256()
    for t in sorted(gguf.GGUFReader(out).tensors, key=lambda t: t.name):  # llama-quantize reorders them
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_K:
            h.update(t.name.encode())
            h.update(np.asarray(t.data).tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--build", action="store_true", help="build llama-quantize first if missing")
    ap.add_argument("--digest", action="store_true",
                    help="print the sha256 of llama-quantize's Q4_K blocks of each seed's files (tests/test_q4_k_quantizer.py holds them)")
    a = ap.parse_args()
    from llamacpp import build, build_dir, llamacpp_root

    root = llamacpp_root()
    tool = build_dir(root) / "bin" / "llama-quantize"
    if not tool.exists():
        if not a.build:
            raise SystemExit(f"{tool} is not built: run with --build (or tests/bench/llamacpp.py)")
        build(root, jobs=2)
    rows = []
    if a.digest:
        with tempfile.TemporaryDirectory() as tmp:
            for seed in range(a.seeds):
                for corners in (False, True):
                    print(json.dumps({"seed": seed, "corners": corners, "sha256": digest(seed, tool, Path(tmp), corners)}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(a.seeds):
            for corners in (False, True):
                rows.append(compare(seed, tool, Path(tmp), corners))
                print(json.dumps(rows[-1]), flush=True)
    same, total = sum(r["identical"] for r in rows), sum(r["blocks"] for r in rows)
    print(json.dumps({"blocks": total, "identical": same, "fraction": round(same / total, 6)}))
    sys.exit(0 if same >= 0.99 * total else 1)


if __name__ == "__main__":
    main()
