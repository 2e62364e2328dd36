"""Bytes read per batch-1 decode step of a mixture-of-experts model, and its decode time, on this CPU.

    .venv/bin/python tests/bench/moe_bytes.py [--hidden 768] [--expert 768] [--experts 8] [--top-k 2]
                                              [--layers 4] [--steps 32] [--repeats 3]

1. Analytic: the gather-GEMV kernel (models/moe.py gather_gemv, scheduled by schedules/cpu/moe.py) is
   read for its weight access; its only load of the weight must be w[idx[t, j], n, c] (the expert a
   load from the routing ids), so one decode step (t = 1) touches top_k x rows x cols weights per
   projection. Summed with the dense parameters every step reads in full (attention, router, norms,
   lm_head, one embedding row), that is the step's weight bytes, against the model's total.
2. Measured: three random float32 checkpoints of the same attention and vocabulary, built for the
   host and decoded greedily for --steps tokens after a short prompt (best of --repeats, interleaved):
     moe      Qwen3-MoE, top_k of E experts
     all      the same weights with num_experts_per_tok = E (every expert computed each step)
     dense    Qwen3 with one MLP of E x expert rows: the same total bytes, all read every step
Prints a Markdown table for docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

ITEM = 4  # float32


def gemv_weight_reads(top_k: int, rows: int, cols: int, experts: int) -> int:
    """Weight elements one decode step's gather-GEMV reads, from the kernel's indexing: the block's
    read region of the weight must be w[idx[t, j], n, c] (the expert a load of the routing ids, one
    row and one column per iteration), so for t = 1 it reads (extent of j) x (of n) x (of c) elements."""
    import tvm
    from tvm import s_tir

    from vtool.models.moe import GEMV_BLOCK, gather_gemv

    func = gather_gemv(1, top_k, rows, cols, experts, "float32", "float32")
    sch = s_tir.Schedule(func)
    block = sch.get(sch.get_sblock(GEMV_BLOCK))
    (w_region,) = [r for r in block.reads if r.source.name == "w"]
    first, row, col = (rng.min for rng in w_region.region)
    assert isinstance(first, tvm.ir.expr.TensorLoad) and first.source.name == "idx", \
        f"the weight's expert index is {first}, not a load of the routing ids"
    assert all(int(rng.extent) == 1 for rng in w_region.region)
    t, j, n, c = block.iter_vars
    assert row.same_as(n.var) and col.same_as(c.var)
    return int(j.dom.extent) * int(n.dom.extent) * int(c.dom.extent)


def write_checkpoint(folder: Path, raw: dict, seed: int = 0) -> Path:
    """config.json + random model.safetensors with every tensor the family's plan needs."""
    from safetensors.numpy import save_file

    from vtool.models.config import parse_hf_config
    from vtool.models.weights import expected_source_shapes

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_source_shapes(parse_hf_config(raw)).items():
        if "norm" in name:
            tensors[name] = np.ones(shape, np.float32)
        else:
            tensors[name] = (rng.standard_normal(shape, np.float32) / np.sqrt(shape[-1])).astype(np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def decode_seconds(gen, steps: int) -> float:
    from vtool.runtime.sampling.params import SamplingParams

    prompt = [1, 5, 17, 42, 99, 7, 3, 250]
    t0 = time.perf_counter()
    gen.generate(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    t1 = time.perf_counter()
    out = gen.generate(prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    t2 = time.perf_counter()
    assert len(out.token_ids) == steps + 1
    return ((t2 - t1) - (t1 - t0)) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--expert", type=int, default=768)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from vtool.models.config import parse_hf_config
    from vtool.models.weights import expected_source_shapes
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.engine.generate import Generator
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.toolchain.build import build_artifact

    h, i, e, k, L = args.hidden, args.expert, args.experts, args.top_k, args.layers
    common = dict(vocab_size=args.vocab, hidden_size=h, num_hidden_layers=L, num_attention_heads=12,
                  num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    moe = dict(common, architectures=["Qwen3MoeForCausalLM"], intermediate_size=i, moe_intermediate_size=i,
               num_experts=e, num_experts_per_tok=k, norm_topk_prob=True)
    configs = {"moe": moe, "all": dict(moe, num_experts_per_tok=e),
               "dense": dict(common, architectures=["Qwen3ForCausalLM"], intermediate_size=e * i)}

    # 1. bytes per step, from the kernel's indexing
    c = parse_hf_config(moe)
    total = sum(int(np.prod(s)) for s in expected_source_shapes(c).values()) * ITEM
    experts_total = L * e * 3 * h * i * ITEM
    dense_rest = total - experts_total - args.vocab * h * ITEM + h * ITEM  # the embedding: one row a step
    per_step = {name: dense_rest + L * ITEM * (gemv_weight_reads(kk, 2 * i, h, e) + gemv_weight_reads(kk, h, i, e))
                for name, kk in (("moe", k), ("all", e))}
    per_step["dense"] = dense_rest + L * 3 * h * e * i * ITEM

    # 2. measured decode time
    gens = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, raw in configs.items():
            folder = write_checkpoint(Path(tmp) / name, raw)
            t = time.perf_counter()
            artifact = build_artifact(folder, "host", "float32")
            print(f"built {name} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
            gens[name] = Generator(CompiledModel(artifact, open_checkpoint(folder)), max_model_len=256)
        best = {name: float("inf") for name in gens}
        for _ in range(args.repeats):
            for name, gen in gens.items():
                best[name] = min(best[name], decode_seconds(gen, args.steps))

    print(f"\nQwen3-MoE shape: hidden {h}, {L} layers, {e} experts of {i}, top-{k}, vocab {args.vocab}, float32; "
          f"total weights {total / 2**20:.1f} MiB (experts {experts_total / 2**20:.1f} MiB)\n")
    print("| model | weight bytes read per decode step (analytic) | ms per decode step (best of "
          f"{args.repeats}, {args.steps} steps) | vs moe |")
    print("| --- | --- | --- | --- |")
    for name, label in (("moe", f"MoE top-{k} of {e}"), ("all", f"same weights, all {e} experts computed"),
                        ("dense", "dense Qwen3 of equal total size")):
        print(f"| {label} | {per_step[name] / 2**20:.1f} MiB | {best[name] * 1e3:.2f} | "
              f"{best[name] / best['moe']:.2f}x |")


if __name__ == "__main__":
    main()
