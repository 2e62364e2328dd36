"""Peak resident memory of `vtool run` against the size of the GGUF file it runs (issue 16:
<= 1.3x the file, the weights bound without a second copy).

    python tests/bench/rss_vs_file.py [FILE.gguf ...] [--artifact-dir DIR] [--max-tokens 16]
                                      [--stages] [--floor] [--limit 1.3] [--json out.json]

Without FILE: the default model (SmolLM2-135M-Instruct Q4_1). The real Q4_K_M files come from
`python tests/bench/coder_pair.py --dir DIR` (Qwen2.5-Coder-0.5B/1.5B-Instruct, sha256-pinned).

Each file is built first (`vtool build --model FILE --target host --output DIR/<name>`; an
existing folder is reused), so the measured command only runs: `vtool run --model FILE
--artifact DIR/<name> --prompt P --max-tokens N`, in a fresh wrapper process whose
RUSAGE_CHILDREN ru_maxrss is that command's peak RSS (Linux's VmHWM; what `/usr/bin/time -v`
prints as "Maximum resident set size"), as tests/test_rss.py measures it.

--stages also runs the same load in a child that prints its resident memory after each stage
(imports, tokenizer, TVM runtime, weights bound, engine with its KV cache reserved, the first
step, the last), so that where the memory goes is measured rather than guessed. The KV cache is
reserved for the whole context (`vtool run`: one sequence of max_model_len tokens) but its pages
become resident only as tokens are written: the table gives what is reserved and the share the
run's tokens touched, which the peak includes.

--floor measures what no change to vtool can remove: a child with only the interpreter, numpy,
tvm_ffi (without torch and ml_dtypes) and libtvm_runtime that allocates the artifact's parameter
bytes as TVM tensors and writes them (no tokenizer, no CLI, no model library, no KV cache).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import re
import subprocess
import sys
from pathlib import Path

PROMPT = "def quicksort(arr):"
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}
WRAPPER = ("import resource, subprocess, sys; "
           "done = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
           "sys.stderr.write(done.stderr); sys.stdout.write(done.stdout); "
           "print('HWM_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
           "sys.exit(done.returncode)")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "vtool.toolchain.cli", *args]


def build(model: Path, folder: Path) -> Path:
    if not (folder / "manifest.json").exists():
        subprocess.run(cli("build", "--model", str(model), "--target", "host", "--output", str(folder)), check=True,
                       stdout=subprocess.DEVNULL)
    return folder


def peak_kib(model: Path, artifact: Path, max_tokens: int) -> tuple[int, str]:
    cmd = [sys.executable, "-c", WRAPPER, *cli("run", "--model", str(model), "--artifact", str(artifact),
                                               "--prompt", PROMPT, "--max-tokens", str(max_tokens))]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"vtool run failed on {model}:\n{done.stderr[-3000:]}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("HWM_KIB")][-1]
    return int(line.split()[1]), done.stdout.split("HWM_KIB")[0].strip()


# ------------------------------------------------------------------ --stages: the child's side

def _status() -> dict[str, float]:
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"^{k}:\s+(\d+)", text, re.MULTILINE).group(1)) / 1024
            for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def stages_child(model: str, artifact: str, max_tokens: int) -> None:
    """The load `vtool run` does (runtime/run_cmd.py), with the resident memory after each stage."""
    import dataclasses

    rows = []

    def mark(stage: str, **extra: float) -> None:
        rows.append({"stage": stage, **_status(), **extra})

    mark("start")
    import vtool.toolchain.cli  # noqa: F401  (what the command imports)
    from vtool.runtime.cli import runtime_process

    runtime_process(None)  # as the run command: the thread count, torch kept out, tvm_ffi without ml_dtypes
    from vtool.runtime import session as S
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.artifact.tvm_runtime import ffi
    from vtool.runtime.engine.engine import Engine, EngineConfig, kv_bytes_per_block
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.weights.checkpoint import open_checkpoint

    mark("imports")

    class Instrumented(CompiledModel):  # open_session's own steps, marked where the weights start and end
        def __init__(self, *args, **kwargs):
            mark("tokenizer")
            ffi()
            mark("TVM runtime")
            super().__init__(*args, **kwargs)
            mark("weights bound")

    S.CompiledModel = Instrumented
    session = S.open_session(Path(artifact), open_checkpoint(model))
    mark("session")
    config = dataclasses.replace(EngineConfig(), max_num_seqs=1, enable_prefix_caching=False)
    engine = Engine(session, config)
    per_block = kv_bytes_per_block(session.model.manifest, config.block_size)
    reserved = engine.kv.blocks.num_blocks * per_block / 2**20
    mark("engine (KV reserved)", kv_reserved_mib=reserved)
    ids = session.encode_prompt(PROMPT)
    engine.add_request("r", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 1:
            mark("first step (prefill)")
    tokens = len(ids) + max_tokens
    touched = -(-tokens // config.block_size) * per_block / 2**20
    mark(f"after {max_tokens} tokens", kv_touched_mib=touched)
    bound = sum(math.prod(e["shape"]) * ITEMSIZE[e["dtype"]] for e in session.model.manifest["params"]) / 2**20
    print("STAGES", json.dumps({"rows": rows, "params_mib": bound}))


def floor_child(artifact: str) -> None:
    """The floor under any CPython process that holds this artifact's weights in TVM tensors:
    the interpreter, numpy, tvm_ffi (without torch and ml_dtypes) and libtvm_runtime, then the
    parameters' bytes allocated as TVM tensors and written; nothing of vtool's own but the loader."""
    import sys

    rows = []

    def mark(stage: str) -> None:
        rows.append({"stage": stage, **_status()})

    mark("python")
    import numpy as np

    mark("numpy")
    sys.modules["torch"] = sys.modules["ml_dtypes"] = None  # type: ignore[assignment]
    import tvm_ffi

    del sys.modules["ml_dtypes"]
    mark("tvm_ffi")
    from vtool.runtime.artifact.tvm_runtime import ffi, global_func

    ffi()
    mark("libtvm_runtime")
    params = json.loads((Path(artifact) / "manifest.json").read_text())["params"]
    alloc, cpu, held = global_func("runtime.TVMTensorAllocWithScope"), tvm_ffi.device("cpu", 0), []
    for e in params:
        held.append(alloc(tvm_ffi.Shape([math.prod(e["shape"]) * ITEMSIZE[e["dtype"]]]), "uint8", cpu, None))
        np.from_dlpack(held[-1])[:] = 1
    mark("weights (written)")
    print("STAGES", json.dumps({"rows": rows, "params_mib": sum(int(t.shape[0]) for t in held) / 2**20}))


def stages(model: Path, artifact: Path, max_tokens: int, mode: str = "--child-stages") -> dict:
    done = subprocess.run([sys.executable, __file__, mode, str(model), str(artifact), str(max_tokens)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"--stages failed on {model}:\n{done.stderr[-3000:]}")
    return json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("STAGES ")][-1][len("STAGES "):])


def print_stages(data: dict) -> None:
    print(f"  {'stage':24s} {'RSS':>8s} {'+':>8s} {'peak':>8s} {'anon':>8s} {'file':>8s}  (MiB)")
    last = 0.0
    for r in data["rows"]:
        extra = "".join(f"  {k} {v:.1f}" for k, v in r.items() if k.endswith("_mib"))
        print(f"  {r['stage']:24s} {r['VmRSS']:8.1f} {r['VmRSS'] - last:+8.1f} {r['VmHWM']:8.1f} {r['RssAnon']:8.1f} "
              f"{r['RssFile']:8.1f}{extra}")
        last = r["VmRSS"]
    print(f"  compiled parameters (the manifest's shapes): {data['params_mib']:.1f} MiB")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child-stages":
        stages_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--child-floor":
        floor_child(sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path, help="GGUF files (default: the default model)")
    ap.add_argument("--artifact-dir", type=Path, default=Path("/tmp/vtool-rss-artifacts"),
                    help="where each file's build goes (reused when present)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--stages", action="store_true", help="also print the resident memory after each load stage")
    ap.add_argument("--floor", action="store_true",
                    help="also print the floor: python + numpy + tvm_ffi + libtvm_runtime + the weights' bytes alone")
    ap.add_argument("--limit", type=float, default=None, help="exit 1 when a peak / file ratio exceeds this")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    files = args.files
    if not files:
        from vtool.runtime.weights.default_model import default_model_path

        files = [default_model_path()]
    results, over = [], []
    for model in files:
        artifact = build(model, args.artifact_dir / model.stem)
        kib, text = peak_kib(model, artifact, args.max_tokens)
        size = model.stat().st_size
        ratio = kib * 1024 / size
        print(f"{model.name}: file {size / 2**20:.1f} MiB ({size:,} B), peak RSS of vtool run {kib:,} kB "
              f"({kib / 1024:.1f} MiB) = {ratio:.3f}x the file   [{text[:60]!r}]", flush=True)
        row = {"file": str(model), "file_bytes": size, "peak_kib": kib, "ratio": round(ratio, 4),
               "max_tokens": args.max_tokens}
        if args.stages:
            row["stages"] = stages(model, artifact, args.max_tokens)
            print_stages(row["stages"])
        if args.floor:
            row["floor"] = stages(model, artifact, args.max_tokens, "--child-floor")
            peak = row["floor"]["rows"][-1]["VmHWM"]
            print(f"  floor: {peak:.1f} MiB = {peak * 2**20 / size:.3f}x the file")
            print_stages(row["floor"])
        results.append(row)
        if args.limit is not None and ratio > args.limit:
            over.append(f"{model.name} {ratio:.3f}x")
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                         "python": platform.python_version(), "results": results}, indent=1))
    if over:
        raise SystemExit(f"over the limit {args.limit}x: {', '.join(over)}")


if __name__ == "__main__":
    main()
