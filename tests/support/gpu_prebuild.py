"""Prepare tests/test_gpu_parity.py for a GPU machine that has only the TVM runtime.

On the build machine (apache-tvm + nvcc, no GPU needed):

    .venv/bin/python tests/support/gpu_prebuild.py build --target sm_90a

writes .devcarry/gpu-tests/ (what VTOOL_GPU_ARTIFACTS points at):
    index.json                      the target, versions, and where everything is
    tiny/<shape>/                   the tiny random checkpoints, made here once and carried
                                    (tiny/bert/: a random BertModel with all-MiniLM-L6-v2's
                                    tokenizer and pooling, when that asset is here)
                                    (torch/transformers versions differ there, so re-making
                                    them from the seed is not guaranteed to give equal weights)
    artifacts/<shape>-<dtype>/      CUDA artifacts, float32 and bfloat16, for every tiny shape
    artifacts/smollm2-bfloat16/     SmolLM2-135M-Instruct (the embedded GGUF) in bfloat16
    wheels/                         gguf (pure Python; the GPU machine lacks it: both vtool's
                                    GGUF reader and transformers' GGUF loader need it)
and, since one device call carries at most 64 MiB and the GGUF alone is 98 MB, packs all of
it plus the GGUF (as smollm2/<name>.gguf) into a tar.gz split over .devcarry/gpu-pack-1..N
(--chunk-mib each, default 48). It prints the device calls to make, one per part, back to
back (a machine stays held for 30 s after a call): every call but the last copies its part to
~/stage; the last one carries .devcarry/rt and the last part, and runs

    python3 tests/support/gpu_prebuild.py unpack --to ~/gpu-tests ~/stage .devcarry/gpu-pack-N

(stdlib only: it joins the parts in name order and extracts them) before pytest.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent  # tests/support
ROOT = HERE.parents[1]  # the repository
DTYPES = ("float32", "bfloat16")
PART_PREFIX = "part_"


# what --shapes takes besides the tiny decoder shapes
EXTRAS = ("bert", "embeddinggemma", "moe-probe")


def build(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    import importlib.metadata

    from tiny_models import GPU_DIAGNOSTIC_SHAPES, TINY_SHAPES, make_tiny_model
    from vtool.runtime.artifact.library import installed_versions
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.runtime.weights.default_model import FILENAME, SHA256, default_model_path
    from vtool.toolchain.build import build_artifact

    out = Path(args.out).resolve()
    previous = json.loads((out / "index.json").read_text()) if args.reuse and (out / "index.json").exists() else None
    if out.exists() and previous is None:
        shutil.rmtree(out)
    (out / "artifacts").mkdir(parents=True, exist_ok=True)
    # A build that fails is recorded (the GPU test then fails with its message) and the rest go on.
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    index: dict = {"target": args.target, "versions": installed_versions(), "tiny": {}, "errors": {},
                   "dtypes": dtypes}

    def progress(msg: str) -> None:
        print(f"    {msg}", flush=True)

    def attempt(key: str, make) -> str | None:
        print(f"{key} -> {args.target}", flush=True)
        try:
            return str(make().relative_to(out))
        except Exception as e:  # noqa: BLE001 -- recorded and reported, the other builds go on
            index["errors"][key] = f"{type(e).__name__}: {str(e)[-1500:]}"
            print(f"    FAILED: {type(e).__name__}: {str(e)[-400:]}", flush=True)
            return None

    known = [*sorted(TINY_SHAPES), *sorted(GPU_DIAGNOSTIC_SHAPES)]
    shapes = known if not args.shapes else [s.strip() for s in args.shapes.split(",")
                                            if s.strip() and s.strip() not in EXTRAS]
    unknown = [s for s in shapes if s not in known]
    if unknown:
        sys.exit(f"--shapes: {', '.join(unknown)} not in tests/support/tiny_models.py TINY_SHAPES or "
                 "GPU_DIAGNOSTIC_SHAPES")
    if previous is not None:  # --reuse: what an earlier run built stays, unless built again now
        index["tiny"] = {k: v for k, v in previous.get("tiny", {}).items() if k not in shapes}
        index["embed"] = dict(previous.get("embed", {}))
        index["kernels"] = dict(previous.get("kernels", {}))
        extras = [e for e in EXTRAS if not args.shapes or e in args.shapes.split(",")]
        rebuilt = (*shapes, *extras)
        index["errors"] = {k: v for k, v in previous.get("errors", {}).items()
                           if k not in extras and not any(k.startswith(f"{n}-") for n in rebuilt)}
    def tiny_entry(name: str, make) -> dict:
        """A fresh tiny checkpoint (make(folder) writes it) and its artifacts per dtype."""
        for stale in (out / "tiny" / name, *(out / "artifacts" / f"{name}-{d}" for d in DTYPES)):
            if stale.exists():
                shutil.rmtree(stale)
        folder = make(out / "tiny" / name)
        entry = {"checkpoint": str(folder.relative_to(out)), "artifacts": {}}
        for dtype in dtypes:
            built = attempt(f"{name}-{dtype}", lambda: build_artifact(
                folder, args.target, dtype, output=out / "artifacts" / f"{name}-{dtype}", progress=progress))
            if built:
                entry["artifacts"][dtype] = built
        return entry

    for name in shapes:
        index["tiny"][name] = tiny_entry(name, lambda folder: make_tiny_model(name, folder))

    if not args.shapes or "bert" in args.shapes.split(","):
        # a tiny random BertModel with all-MiniLM-L6-v2's tokenizer and pooling (embedding parity)
        import assets
        from embed_oracle import make_tiny_bert

        try:
            donor = assets.minilm_dir()
        except Exception as err:  # noqa: BLE001 -- no network, no cache: the GPU test then skips, saying so
            donor = None
            print(f"WARNING: all-MiniLM-L6-v2 is not available here ({err}): no tiny BERT for the GPU", flush=True)
        if donor is not None:
            index.setdefault("embed", {})["bert"] = tiny_entry("bert", lambda folder: make_tiny_bert(folder, donor))

    if not args.shapes or "embeddinggemma" in args.shapes.split(","):
        # a tiny random EmbeddingGemma (bidirectional Gemma-3 + its pooling head) at its head_dim of 256
        from embed_oracle import make_tiny_embeddinggemma

        index.setdefault("embed", {})["embeddinggemma"] = tiny_entry(
            "embeddinggemma", lambda folder: make_tiny_embeddinggemma(folder, head_dim=256))

    if not args.shapes or "moe-probe" in args.shapes.split(","):
        # models/moe.py's kernels alone against numpy (tests/support/moe_probe.py)
        import moe_probe

        lib = out / "kernels" / "moe_probe.so"
        if attempt("moe-probe", lambda: (moe_probe.build(lib, args.target), lib)[1]):
            index.setdefault("kernels", {})["moe"] = str(lib.relative_to(out))

    gguf = None
    if not args.no_smollm2:
        gguf = default_model_path()
        built = attempt("smollm2-bfloat16", lambda: build_artifact(
            gguf, args.target, "bfloat16", output=out / "artifacts" / "smollm2-bfloat16",
            checkpoint=open_checkpoint(gguf), progress=progress))
        index["smollm2"] = {"artifact": built, "gguf": f"smollm2/{FILENAME}", "sha256": SHA256}
        version = importlib.metadata.version("gguf")
        wheels = out / "wheels"
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                               "-d", str(wheels), f"gguf=={version}"], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"WARNING: could not fetch the gguf=={version} wheel ({done.stderr.strip()[-300:]}); "
                  "the SmolLM2 tests need gguf installed on the GPU machine", flush=True)
    (out / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    print(f"wrote {out} ({_size(out) / 2**20:.1f} MiB)")
    if args.chunk_mib > 0:
        pack(out, gguf, Path(args.pack_dir).resolve(), args.chunk_mib)
    if index["errors"]:
        sys.exit(f"{len(index['errors'])} build(s) failed: {', '.join(index['errors'])} (recorded in index.json)")


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def pack(out: Path, gguf: Path | None, pack_dir: Path, chunk_mib: int) -> None:
    for old in pack_dir.glob("gpu-pack-*"):
        shutil.rmtree(old)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "gpu-tests.tar.gz"
        with tarfile.open(archive, "w:gz", compresslevel=6) as tar:
            tar.add(out, arcname=".")
            if gguf is not None:
                tar.add(gguf, arcname=f"smollm2/{gguf.name}")
        chunk = chunk_mib << 20
        digest = hashlib.sha256()
        parts = []
        with open(archive, "rb") as f:
            while True:
                data = f.read(chunk)
                if not data:
                    break
                digest.update(data)
                folder = pack_dir / f"gpu-pack-{len(parts) + 1}"
                folder.mkdir(parents=True)
                (folder / f"{PART_PREFIX}{len(parts):03d}").write_bytes(data)
                parts.append(folder)
    (parts[-1] / "SHA256").write_text(digest.hexdigest())
    rel = [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in parts]
    print(f"packed into {len(parts)} part(s) of at most {chunk_mib} MiB: {', '.join(rel)}")
    print("\nOn the GPU machine, back to back (each call within 30 s of the previous):")
    for i, folder in enumerate(rel[:-1], 1):
        print(f"  call {i}: carry [\"{folder}\"]\n    mkdir -p ~/stage && cp {folder}/{PART_PREFIX}* ~/stage/")
    print(f"  call {len(rel)}: carry [\".devcarry/rt\", \"{rel[-1]}\"]\n"
          f"    python3 tests/support/gpu_prebuild.py unpack --to ~/gpu-tests ~/stage {rel[-1]} && ... "
          "(see the module docstring of tests/test_gpu_parity.py)")


def unpack(args: argparse.Namespace) -> None:
    """Join every part_* of the given folders in name order, check the digest, extract."""
    parts = sorted((p for d in args.dirs for p in Path(d).glob(f"{PART_PREFIX}*")), key=lambda p: p.name)
    if not parts:
        sys.exit(f"no {PART_PREFIX}* files in {', '.join(args.dirs)}")
    names = [p.name for p in parts]
    expected = [f"{PART_PREFIX}{i:03d}" for i in range(len(parts))]
    if names != expected:
        sys.exit(f"parts {names} are not {expected}: one is missing or doubled")
    sums = [Path(d) / "SHA256" for d in args.dirs if (Path(d) / "SHA256").exists()]
    to = Path(args.to)
    if to.exists():
        shutil.rmtree(to)
    to.mkdir(parents=True)
    archive = to.parent / (to.name + ".tar.gz")
    digest = hashlib.sha256()
    with open(archive, "wb") as f:
        for p in parts:
            data = p.read_bytes()
            digest.update(data)
            f.write(data)
    if sums and sums[0].read_text().strip() != digest.hexdigest():
        sys.exit(f"the joined parts do not match {sums[0]}: a part is stale or damaged")
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(to, filter="data")
    archive.unlink()
    print(f"unpacked {len(parts)} part(s) into {to} ({_size(to) / 2**20:.1f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build every artifact the GPU tests need (needs apache-tvm and nvcc)")
    b.add_argument("--target", default="sm_90a", help="vtool CUDA target (default sm_90a: H100/H200)")
    b.add_argument("--out", default=str(ROOT / ".devcarry" / "gpu-tests"))
    b.add_argument("--no-smollm2", action="store_true", help="tiny models only (nothing over the carry limit)")
    b.add_argument("--dtypes", default=",".join(DTYPES),
                   help="tiny-model dtypes to build (the tests of a dtype left out skip, saying so)")
    b.add_argument("--shapes", default="",
                   help="tiny shapes to build, comma-separated; `bert` and `embeddinggemma` for the tiny embedding "
                        "models, `moe-probe` for the MoE kernels alone (default: all)")
    b.add_argument("--reuse", action="store_true",
                   help="keep what an earlier run built into --out; only --shapes (and SmolLM2) are built again")
    b.add_argument("--pack-dir", default=str(ROOT / ".devcarry"))
    b.add_argument("--chunk-mib", type=int, default=48, help="part size for carrying; 0: do not pack")
    b.set_defaults(func=build)
    u = sub.add_parser("unpack", help="on the GPU machine: join the carried parts and extract them")
    u.add_argument("--to", required=True)
    u.add_argument("dirs", nargs="+", help="folders holding the part_* files")
    u.set_defaults(func=unpack)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
