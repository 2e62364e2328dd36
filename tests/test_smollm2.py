"""The embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF): vtool's float32 build
against transformers running the same dequantized weights through its own GGUF loader.
The blocks stay quantized (the default) with float activations (`--activations none`), the
exact path; the default Q8_0 decode activations are held to their own oracle in
test_quant_smollm2.py."""
from __future__ import annotations

import numpy as np
import pytest

from hf_oracle import greedy, load_gguf_model, load_gguf_tokenizer
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.runtime.weights.default_model import default_model_path
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.session import open_session
from vtool.toolchain.build import build_artifact

pytestmark = pytest.mark.slow  # builds the real default model and runs it through transformers

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
]
STEPS = 32


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def session(gguf_path):
    checkpoint = open_checkpoint(gguf_path)
    artifact = build_artifact(gguf_path, "host", "float32", checkpoint=checkpoint, activations="none")
    return open_session(artifact, checkpoint, max_model_len=2048)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_match_transformers(session, gguf_path, prompt):
    hf_tokenizer = load_gguf_tokenizer(gguf_path)
    prompt_ids = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    _, ref_tokens, ref_logits = greedy(load_gguf_model(gguf_path), prompt_ids, STEPS)
    seen: list[np.ndarray] = []
    result = session.generator.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=STEPS),
                                        on_logits=seen.append)
    assert result.token_ids == ref_tokens, (
        f"{prompt!r}: vtool {hf_tokenizer.decode(result.token_ids)!r} vs transformers {hf_tokenizer.decode(ref_tokens)!r}")
    worst = max(float(np.abs(a - b).max()) for a, b in zip(seen, ref_logits))
    assert worst < 2e-3, f"{prompt!r}: logits differ by up to {worst}"


def test_chat_answers_paris(session):
    prompt_ids = session.encode_prompt("What is the capital of France?", chat=True)
    result = session.generator.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=24), session.stop_ids)
    text = session.tokenizer.decode(result.token_ids)
    assert "Paris" in text, text
    assert result.finish_reason == "stop", "the chat turn should end on <|im_end|>"


def test_our_tokenizer_and_template_match_transformers(session, gguf_path):
    """The prompt vtool builds for chat is token-for-token what transformers builds."""
    hf_tokenizer = load_gguf_tokenizer(gguf_path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ref, "keys"):  # transformers 5 returns a BatchEncoding
        ref = ref["input_ids"]
    assert session.encode_prompt(messages[0]["content"], chat=True) == list(ref)


def test_artifact_refuses_another_config(gguf_path, tmp_path):
    """An artifact is bound to the config it was built for: a tiny model is refused by name."""
    from tiny_models import make_tiny_model
    from vtool.runtime.artifact.manifest import ManifestError

    checkpoint = open_checkpoint(gguf_path)
    artifact = build_artifact(gguf_path, "host", "float32", checkpoint=checkpoint, activations="none")
    other = open_checkpoint(make_tiny_model("llama-gqa", tmp_path / "tiny"))
    with pytest.raises(ManifestError, match="built for another config.*hidden_size"):
        CompiledModel(artifact, other)
