"""Batched decode from CUDA graphs at padded batch sizes, against uncaptured batch_decode.

Where the compiler is (no GPU needed):

    .venv/bin/python tests/bench/decode_graphs.py prebuild --out .devcarry/cg

builds, for sm_90a: the tiny shapes tests/test_cuda_graph_buckets.py runs on a GPU (with
--cuda-graph-sizes 1,2,4,8,16) and the SmolLM2-135M-shaped bfloat16 model (default sizes),
and times the tiny bfloat16 build with and without the captured entry (index.json). Then on
the GPU machine, with the runtime staged (../shared/device/README.md):

    VTOOL_CUDA_GRAPH_ARTIFACTS=.devcarry/cg python3 -m pytest -q -s -n 0 -m gpu tests/test_cuda_graph_buckets.py
    python3 tests/bench/decode_graphs.py bench --root .devcarry/cg

`bench` makes a random-weight SmolLM2-135M-shaped checkpoint there (transformers, on the
GPU), and times one model step (embed, KV begin/end, the decode entry; no sampling; the host
synchronised once per loop) at each batch size, three ways in the same process: the model
runner with the captured entry padded to a size (decode_buckets), without it (batch_decode,
uncaptured), and the entry points called directly at batch 1. It also reports each size's
first (warm-up + capture) step and the GPU memory the graphs took.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "support"), str(HERE)]

SMOLLM2_135M = {  # HuggingFaceTB/SmolLM2-135M's config.json: the shape is what matters here
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 100000.0,
    "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "bfloat16",
}
TEST_SIZES = "1,2,4,8,16"  # tests/test_cuda_graph_buckets.py GPU_SIZES
TEST_CASES = {"llama-gqa": ("float32", "bfloat16"), "qwen2-bias": ("bfloat16",)}
BATCHES = (1, 5, 8, 32, 64, 100)


def prebuild(args: argparse.Namespace) -> None:
    from shape_checkpoint import write_shape_checkpoint
    from tiny_models import make_tiny_model
    from vtool.toolchain.build import build_artifact

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    index: dict = {"target": args.target, "tiny": {}, "build_seconds": {}}

    def build(key: str, folder: Path, dtype: str, sizes: str, dest: Path | None) -> Path:
        t = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            built = build_artifact(folder, args.target, dtype, output=dest or Path(tmp) / "a", force=True,
                                   cuda_graph_sizes=sizes, progress=lambda m: print(f"    {m}", flush=True))
            index["build_seconds"][key] = round(time.perf_counter() - t, 1)
        print(f"{key}: {index['build_seconds'][key]} s", flush=True)
        return built

    for name, dtypes in TEST_CASES.items():
        folder = make_tiny_model(name, out / "tiny" / name)
        entry = {"checkpoint": f"tiny/{name}", "artifacts": {}}
        for dtype in dtypes:
            build(f"{name}-{dtype} sizes {TEST_SIZES}", folder, dtype, TEST_SIZES, out / "art" / f"{name}-{dtype}")
            entry["artifacts"][dtype] = f"art/{name}-{dtype}"
        index["tiny"][name] = entry
    # the build-time cost of the captured entry: the same tiny bf16 build without it and with the default list
    tiny = out / "tiny" / "llama-gqa"
    build("llama-gqa-bfloat16 sizes none", tiny, "bfloat16", "none", None)
    build("llama-gqa-bfloat16 sizes auto", tiny, "bfloat16", "auto", None)
    (out / "smollm2_config.json").write_text(json.dumps(SMOLLM2_135M, indent=1))
    with tempfile.TemporaryDirectory() as tmp:
        shape = write_shape_checkpoint(out / "smollm2_config.json", Path(tmp) / "smollm2")
        build("smollm2-135m-bfloat16 sizes auto", shape, "bfloat16", "auto", out / "art" / "smollm2-bfloat16")
        build("smollm2-135m-bfloat16 sizes none", shape, "bfloat16", "none", None)
    index["smollm2"] = {"config": "smollm2_config.json", "artifact": "art/smollm2-bfloat16"}
    (out / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    print(json.dumps(index["build_seconds"], indent=1))


def bench(args: argparse.Namespace) -> None:
    import numpy as np

    from random_checkpoint import make_random_checkpoint
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.artifact.tvm_runtime import cuda_runtime, global_func
    from vtool.runtime.engine.decode_buckets import CAPTURED_ENTRY
    from vtool.runtime.engine.kv_cache import PagedKVCache
    from vtool.runtime.engine.runner import ModelRunner
    from vtool.runtime.engine.step_types import ScheduledSequence, SchedulerOutput
    from vtool.runtime.weights.checkpoint import open_checkpoint

    root = Path(args.root).resolve()
    index = json.loads((root / "index.json").read_text())
    ckpt_dir = Path(args.checkpoint)
    made = make_random_checkpoint(root / index["smollm2"]["config"], ckpt_dir)
    model = CompiledModel(root / index["smollm2"]["artifact"], open_checkpoint(ckpt_dir))
    sync = global_func("runtime.Device_StreamSync")
    results: list[dict] = []

    def record(**row) -> None:
        results.append(row)
        print(json.dumps(row), flush=True)

    record(step="setup", checkpoint_seconds=round(made, 1), gpu=cuda_runtime().gpu(0).describe(),
           entry_points=model.manifest["entry_points"],
           graphs=model.manifest["build"]["pipeline"].get("cuda_graph_batch"))
    max_batch = max(BATCHES) + 28  # room for 100 -> 128
    rng = np.random.default_rng(0)

    def fresh(graphs: bool, batch: int, prompt: int = 64):  # noqa: ANN202
        kv = PagedKVCache(model, 4096, 16, max_batch, 8192)
        runner = ModelRunner(model, kv, device_sampling=False)
        if not graphs:
            runner.decode_buckets = None
        for s in range(batch):
            kv.add(s)
        step = SchedulerOutput(tuple(ScheduledSequence(f"r{s}", s, tuple(int(t) for t in rng.integers(10, 40000, prompt)),
                                                       0, 1, False) for s in range(batch)))
        runner._forward(step)
        return kv, runner

    def decode_step(batch: int, pos: int) -> SchedulerOutput:
        return SchedulerOutput(tuple(ScheduledSequence(f"r{s}", s, (1000 + s,), pos, 1, False) for s in range(batch)))

    def timed(runner, batch: int, steps: int, pos: int) -> float:  # noqa: ANN001
        sync(model.device, 0)
        t = time.perf_counter()
        for i in range(steps):
            runner._forward(decode_step(batch, pos + i))
        sync(model.device, 0)
        return (time.perf_counter() - t) / steps

    free0 = model.device_memory()[0]
    for batch in BATCHES:
        row: dict = {"step": "runner", "batch": batch}
        for mode in ("eager", "graphs"):
            kv, runner = fresh(mode == "graphs", batch)
            free = model.device_memory()[0]
            first = timed(runner, batch, 1, 64)  # graphs: warm-up run + capture at this size
            row[f"{mode}_first_step_mib"] = round((free - model.device_memory()[0]) / 2**20, 1)
            timed(runner, batch, 3, 65)
            row[f"{mode}_ms"] = round(timed(runner, batch, args.steps, 68) * 1e3, 3)
            row[f"{mode}_first_ms"] = round(first * 1e3, 1)
            if mode == "graphs" and runner.decode_buckets is not None:
                plan = runner.decode_buckets.plan(list(range(batch)))
                row["padded_to"] = plan.size if plan else None
            del runner, kv
        row["speedup"] = round(row["eager_ms"] / row["graphs_ms"], 2)
        row["tok_s_eager"] = round(batch / row["eager_ms"] * 1e3)
        row["tok_s_graphs"] = round(batch / row["graphs_ms"] * 1e3)
        record(**row)
    record(step="graph_memory", mib_taken_since_start=round((free0 - model.device_memory()[0]) / 2**20, 1))

    # batch 1 through each entry point directly (the runner uses `decode` there either way)
    kv, runner = fresh(False, 1)
    S = model.ffi.Shape
    view = global_func("runtime.TVMTensorCreateView")
    embeds = view(model.function("embed")(model.upload(np.asarray([1000], np.int32)), model.params),
                  S([1, 1, model.hidden_size]), model.dtype, 0)
    row = {"step": "entries_batch1"}
    for entry in ("decode", "batch_decode", CAPTURED_ENTRY):
        fn = model.function(entry)

        def run(n: int) -> float:
            sync(model.device, 0)
            t = time.perf_counter()
            for _ in range(n):
                kv.begin_forward([0], [1])
                fn(embeds, kv.tvm, model.params)
                kv.end_forward()
            sync(model.device, 0)
            return (time.perf_counter() - t) / n

        run(3)
        row[f"{entry}_ms"] = round(run(args.steps) * 1e3, 3)
    record(**row)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prebuild")
    p.add_argument("--out", default=str(HERE.parents[1] / ".devcarry" / "cg"))
    p.add_argument("--target", default="sm_90a")
    p.set_defaults(func=prebuild)
    b = sub.add_parser("bench")
    b.add_argument("--root", required=True)
    b.add_argument("--checkpoint", default="/tmp/smollm2-random")
    b.add_argument("--steps", type=int, default=50)
    b.add_argument("--json", default=None)
    b.set_defaults(func=bench)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
