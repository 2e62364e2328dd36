"""The default model (SmolLM2-135M-Instruct, Q4_1 layers + Q8_0 tied embedding) with its
blocks kept in memory (`--quantization gguf`, what `auto` picks on a CPU) and dequantized
at load (`none`): greedy tokens equal to transformers running the same GGUF through its
own loader, logits within 2e-3 (as test_smollm2.py), and the bound weights about the
file's size."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hf_oracle import greedy, load_gguf_model, load_gguf_tokenizer
from vtool.runtime.checkpoint import open_checkpoint
from vtool.runtime.default_model import default_model_path
from vtool.runtime.sampling_params import SamplingParams
from vtool.runtime.session import open_session
from vtool.toolchain.build import build_artifact

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
STEPS = 32


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module", params=["gguf", "none"])
def built(request, gguf_path):
    checkpoint = open_checkpoint(gguf_path)
    artifact = build_artifact(gguf_path, "host", "float32", checkpoint=checkpoint, quantization=request.param)
    return request.param, artifact, open_session(artifact, checkpoint, max_model_len=1024)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_match_transformers(built, gguf_path, prompt):
    quantization, _, session = built
    tokenizer = load_gguf_tokenizer(gguf_path)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    _, ref_tokens, ref_logits = greedy(load_gguf_model(gguf_path), ids, STEPS)
    seen: list[np.ndarray] = []
    result = session.generator.generate(ids, SamplingParams(temperature=0, max_tokens=STEPS), on_logits=seen.append)
    assert result.token_ids == ref_tokens, (
        f"{quantization} {prompt!r}: vtool {tokenizer.decode(result.token_ids)!r} "
        f"vs transformers {tokenizer.decode(ref_tokens)!r}")
    worst = max(float(np.abs(a - b).max()) for a, b in zip(seen, ref_logits))
    assert worst < 2e-3, f"{quantization} {prompt!r}: logits differ by up to {worst}"


def test_weights_stay_about_the_file_size(built, gguf_path):
    quantization, artifact, _ = built
    manifest = json.loads((artifact / "manifest.json").read_text())
    total = sum(int(np.prod(e["shape"])) * np.dtype(e["dtype"]).itemsize for e in manifest["params"])
    size = gguf_path.stat().st_size
    if quantization == "gguf":
        assert manifest["quantized_weights"]["kept"] == {"Q4_1": 120, "Q8_0": 1}
        assert total < 1.2 * size, f"{total / 2**20:.0f} MiB bound for a {size / 2**20:.0f} MiB file"
    else:
        assert total > 5 * size  # float32: the dequantized model
