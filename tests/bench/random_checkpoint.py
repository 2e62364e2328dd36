"""A random-weight checkpoint of a given config, made by transformers on the GPU, for speed
benchmarks (the weights do not change the speed).

    python tests/bench/random_checkpoint.py CONFIG.json OUT_DIR [--tokenizer DIR]

The config file is written over transformers' own config.json, so the artifact built here
from the same file (tests/bench/shape_checkpoint.py) matches it key for key.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def make_random_checkpoint(config_path: Path, out: Path, tokenizer: Path | None = None) -> float:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (out / "config.json").exists():
        raw = json.loads(config_path.read_text())
        config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items()
                                                          if k not in ("model_type", "architectures", "torch_dtype")})
        torch.manual_seed(0)
        t = time.perf_counter()
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        model.save_pretrained(out, max_shard_size="4GB")
        shutil.copy(config_path, out / "config.json")
        del model
        torch.cuda.empty_cache()
        seconds = time.perf_counter() - t
    else:
        seconds = 0.0
    if tokenizer is not None:
        for f in tokenizer.iterdir():
            shutil.copy(f, out / f.name)
    return seconds


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("config", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path)
    a = ap.parse_args()
    print(f"made {a.out} in {make_random_checkpoint(a.config, a.out, a.tokenizer):.1f} s")
