"""vtool's K-quant quantizers (toolchain/q4_k_quantizer.py, q6_k_quantizer.py) against
llama.cpp's own: a tiny llama GGUF with float32 weights (columns multiples of 256) is
quantized by `llama-quantize --pure ... Q4_K` (or Q6_K; the llama.cpp of the llama-cpp-python sdist, built by tests/bench/llamacpp.py) and
every tensor's blocks are compared with vtool's quantization of the same floats: how many of
the 144-byte super-blocks are identical, and where not, how the two dequantized tensors'
errors compare (llama.cpp's build contracts `a*b + c` into FMA where the CPU has it, a
rounding numpy does not make, so a rare tie can go the other way).

    python tests/bench/k_quants_vs_llama_quantize.py [--type Q4_K|Q6_K] [--seeds 3] [--build] [--digest]
    python tests/bench/k_quants_vs_llama_quantize.py --type Q4_K --speed   # seconds against llama-quantize

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


def quantizer(qtype: str):  # noqa: ANN201 - (bytes a super-block, the quantize function)
    if qtype == "Q4_K":
        from vtool.toolchain.q4_k_quantizer import BLOCK_BYTES, quantize_q4_k

        return BLOCK_BYTES, quantize_q4_k
    from vtool.toolchain.q6_k_quantizer import BLOCK_BYTES, quantize_q6_k

    return BLOCK_BYTES, quantize_q6_k


def compare(seed: int, tool: Path, work: Path, corners: bool, qtype: str = "Q4_K") -> dict:
    import gguf

    block_bytes, quantize = quantizer(qtype)

    from k_quant_cases import source_file

    Q = gguf.GGMLQuantizationType
    src = source_file(seed, work, corners)
    out = work / f"{qtype}-{seed}-{int(corners)}.gguf"
    subprocess.run([str(tool), "--pure", str(src), str(out), qtype], check=True, capture_output=True)
    floats = {t.name: np.asarray(t.data, dtype=np.float32) for t in gguf.GGUFReader(src).tensors}
    same = total = 0
    worse = 0
    for t in gguf.GGUFReader(out).tensors:
        if t.tensor_type != Q[qtype]:
            continue
        theirs = np.asarray(t.data).reshape(-1, block_bytes)
        x = floats[t.name]
        ours = quantize(x).reshape(-1, block_bytes)
        equal = np.all(theirs == ours, axis=1)
        same += int(equal.sum())
        total += len(equal)
        if not equal.all():  # is ours any worse where it differs?
            err = {}
            for who, blocks in (("theirs", theirs), ("ours", ours)):
                y = gguf.quants.dequantize(blocks.reshape(-1), Q[qtype]).reshape(-1, 256)
                err[who] = ((y - x.reshape(-1, 256)) ** 2).sum(axis=1)[~equal].sum()
            worse += int(err["ours"] > err["theirs"] * 1.001)
    return {"type": qtype, "seed": seed, "corners": corners, "blocks": total, "identical": same, "fraction": round(same / max(total, 1), 6),
            "tensors_where_ours_is_worse": worse}


def digest(seed: int, tool: Path, work: Path, corners: bool, qtype: str = "Q4_K") -> str:
    """sha256 of llama-quantize's `qtype` blocks of one source file, tensors by name."""
    import hashlib

    import gguf
    from k_quant_cases import source_file

    src = source_file(seed, work, corners)
    out = work / f"digest-{qtype}-{seed}-{int(corners)}.gguf"
    subprocess.run([str(tool), "--pure", str(src), str(out), qtype], check=True, capture_output=True)
    h = hashlib.sha256()
    for t in sorted(gguf.GGUFReader(out).tensors, key=lambda t: t.name):  # llama-quantize reorders them
        if t.tensor_type == gguf.GGMLQuantizationType[qtype]:
            h.update(t.name.encode())
            h.update(np.asarray(t.data).tobytes())
    return h.hexdigest()


SPEED_SHAPE = dict(hidden=1024, inter=2816, layers=4, heads=8, kv=4, vocab=4096)  # ~63 M weights


def speed(tool: Path, work: Path, qtype: str, threads: int = 2) -> dict:
    """Seconds to quantize one float32 GGUF of SPEED_SHAPE: llama-quantize (`threads` threads,
    file in and out) against vtool's port on the same 2-D tensors (one thread, in memory)."""
    import time

    import gguf
    from quant_gguf import write_tiny_gguf

    from vtool.toolchain.quantize import quantize_blocks

    src = write_tiny_gguf(work / "speed-f32.gguf", lambda _name: gguf.GGMLQuantizationType.F32, tie=False,
                          shape=SPEED_SHAPE)
    t0 = time.perf_counter()
    subprocess.run([str(tool), "--pure", str(src), str(work / "speed-out.gguf"), qtype, str(threads)], check=True,
                   capture_output=True)
    theirs = time.perf_counter() - t0
    tensors = [np.asarray(t.data, dtype=np.float32) for t in gguf.GGUFReader(src).tensors if len(t.data.shape) == 2]
    t0 = time.perf_counter()
    for data in tensors:
        quantize_blocks(data, qtype)
    ours = time.perf_counter() - t0
    weights = sum(t.size for t in tensors)
    return {"type": qtype, "weights": weights, "llama_quantize_s": round(theirs, 2), "threads": threads,
            "vtool_s": round(ours, 2), "vtool_m_weights_per_s": round(weights / ours / 1e6, 1),
            "ratio": round(ours / theirs, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", default="Q4_K", choices=["Q4_K", "Q6_K"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--build", action="store_true", help="build llama-quantize first if missing")
    ap.add_argument("--speed", action="store_true", help="time both quantizers on one larger file")
    ap.add_argument("--digest", action="store_true",
                    help="print the sha256 of llama-quantize's blocks of each seed's files (tests/test_k_quantizers.py holds them)")
    a = ap.parse_args()
    from llamacpp import build, build_dir, llamacpp_root

    root = llamacpp_root()
    tool = build_dir(root) / "bin" / "llama-quantize"
    if not tool.exists():
        if not a.build:
            raise SystemExit(f"{tool} is not built: run with --build (or tests/bench/llamacpp.py)")
        build(root, jobs=2)
    rows = []
    if a.speed:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(speed(tool, Path(tmp), a.type)))
        return
    if a.digest:
        with tempfile.TemporaryDirectory() as tmp:
            for seed in range(a.seeds):
                for corners in (False, True):
                    print(json.dumps({"type": a.type, "seed": seed, "corners": corners,
                                      "sha256": digest(seed, tool, Path(tmp), corners, a.type)}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(a.seeds):
            for corners in (False, True):
                rows.append(compare(seed, tool, Path(tmp), corners, a.type))
                print(json.dumps(rows[-1]), flush=True)
    same, total = sum(r["identical"] for r in rows), sum(r["blocks"] for r in rows)
    print(json.dumps({"blocks": total, "identical": same, "fraction": round(same / total, 6)}))
    sys.exit(0 if same >= 0.99 * total else 1)


if __name__ == "__main__":
    main()
