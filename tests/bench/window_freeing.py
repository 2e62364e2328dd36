"""The KV cache that frees what a sliding window passed (models/window_cache.py) against the
per-layer window cache, on one random Mistral-shaped model (window 512, 4 layers, hidden 512,
8/2 heads of 64), float32 on the CPU: a long prompt's prefill, decode steps past the window,
and the greedy tokens of both (they should agree: the same attention, rotated in the kernel
or before the cache).

    python tests/bench/window_freeing.py [--prompt 800] [--steps 128] [--rounds 2] [--tvm-kernels]

Prints one line per cache and the ratios; run it on a quiet machine. --tvm-kernels also times
the freeing cache on TVM's own serial inline-rope kernels (a second build in a scratch cache
with schedules/cpu/rope_attention.py's rule turned off): what the cache ran before that rule.

On a GPU (a machine with only the TVM runtime): build here, run there.

    python tests/bench/window_freeing.py --target sm_90a --dtype bfloat16 --build-to DIR
    python tests/bench/window_freeing.py --from DIR          # on the GPU machine
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_info import cpu_summary  # noqa: E402

CONFIG = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=4096,
              sliding_window=512, rope_theta=1e4, tie_word_embeddings=False)


def make_model(folder: Path) -> Path:
    """A random model of CONFIG (--config may change it) at float32."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**CONFIG)).to(torch.float32).eval()
    with torch.no_grad():  # a spread of weights, so greedy tokens wander (tests/support/tiny_models.py)
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, (0.3 if "embed" in name else 3.0 / p.shape[-1] ** 0.5))
    model.save_pretrained(folder)
    return folder



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=800)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tvm-kernels", action="store_true", help="also time TVM's serial inline-rope kernels")
    parser.add_argument("--config", default="{}", help="JSON overrides of CONFIG (e.g. a real model's shape)")
    parser.add_argument("--target", default="host")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--build-to", help="only build the artifact (and its bench_config.json) into this folder")
    parser.add_argument("--from", dest="source", help="run the model and artifact --build-to made")
    args = parser.parse_args()
    CONFIG.update(json.loads(args.config))

    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.artifact.tvm_runtime import global_func
    from vtool.runtime.engine.generate import Generator
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.weights.checkpoint import open_checkpoint

    if args.build_to:  # the artifact only: the library depends on the config, not on the weights
        from vtool.toolchain.build import build_artifact  # the compiler only where one builds

        with tempfile.TemporaryDirectory() as tmp:
            build_artifact(make_model(Path(tmp) / "mistral-w512"), args.target, args.dtype,
                           output=Path(args.build_to) / "artifact")
        (Path(args.build_to) / "bench_config.json").write_text(json.dumps(CONFIG))
        return
    if args.source:
        CONFIG.update(json.loads((Path(args.source) / "bench_config.json").read_text()))
    with tempfile.TemporaryDirectory() as tmp:
        # with --from the weights are made again here from the seed (torch there may draw others: no matter)
        folder = make_model(Path(tmp) / "mistral-w512")
        if args.source:
            artifact = Path(args.source) / "artifact"
        else:
            from vtool.toolchain.build import build_artifact

            artifact = build_artifact(folder, args.target, args.dtype)
        model = CompiledModel(artifact, open_checkpoint(folder))
        prompt = np.random.default_rng(0).integers(3, CONFIG["vocab_size"], args.prompt).tolist()
        runs = [("per-layer window", model, False, args.rounds), ("freeing, inline rope", model, True, args.rounds)]
        if args.tvm_kernels:
            runs.append(("freeing, TVM's kernels", tvm_kernels_model(folder, Path(tmp) / "cache"), True, 1))
        results = []
        available = global_func("vm.builtin.attention_kv_cache_get_num_available_pages")
        for name, compiled, frees, rounds in runs:
            gen = Generator(compiled, args.prompt + args.steps + 16, free_window=frees)
            gen._fresh_sequence(args.prompt + args.steps)  # the cache each run reuses, its pages all free
            empty = int(available(gen._kv))
            prefill, decode, tokens = [], [], []
            for _ in range(rounds):
                out = gen.generate(prompt, SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True))
                prefill.append(out.prefill_seconds)
                decode.append(out.decode_seconds / max(len(out.token_ids) - 1, 1))
                tokens = out.token_ids
            results.append((min(prefill), min(decode), tokens))
            print(f"{name:>24}: prefill {args.prompt} tokens {min(prefill) * 1e3:9.1f} ms, "
                  f"decode {min(decode) * 1e3:7.2f} ms/step over {args.steps} steps, "
                  f"{empty - int(available(gen._kv))} blocks held at the end", flush=True)
        p0, d0, t0 = results[0]
        for (name, *_), (p1, d1, t1) in zip(runs[1:], results[1:]):
            same = sum(a == b for a, b in zip(t0, t1))
            print(f"{name} / per-layer: prefill {p1 / p0:.2f}x, decode {d1 / d0:.2f}x the time; "
                  f"greedy tokens equal {same}/{len(t0)}")
        print(f"{model.manifest['target']['name']} {model.dtype}, on the {'GPU' if model.on_gpu else 'CPU'}; "
              f"CPU: {cpu_summary()}")


def tvm_kernels_model(folder: Path, cache: Path):  # noqa: ANN201 - a CompiledModel
    """The same model built with the inline-rope rule off (TVM's serial kernels for the freeing
    cache), into a scratch cache: the rule is not part of the build's cache key."""
    import os

    import vtool.schedules.cpu as cpu_rules
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.toolchain.build import build_artifact

    os.environ["VTOOL_CACHE_DIR"] = str(cache)
    rule = cpu_rules.rewrite_inline_rope
    cpu_rules.rewrite_inline_rope = lambda *_: None
    try:
        return CompiledModel(build_artifact(folder, "host", "float32"), open_checkpoint(folder))
    finally:
        cpu_rules.rewrite_inline_rope = rule
        del os.environ["VTOOL_CACHE_DIR"]

if __name__ == "__main__":
    main()
