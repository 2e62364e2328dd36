"""`vtool run --model DIR --quantization Q` as a user types it, checked against the API: the CLI
builds the artifact the API then finds in the cache, and prints the API's greedy text on it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any


def cli_run_matches_the_api(folder: Path, quantization: str, prompt: str, steps: int) -> tuple[Path, Any, list[int]]:
    """Run the CLI, then the same build and greedy generation through the API; assert they agree.
    Returns (the artifact, its session, the prompt's ids) for the caller's own checks."""
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.toolchain.build import build_artifact

    done = subprocess.run([sys.executable, "-m", "vtool.toolchain.cli", "run", "--model", str(folder),
                           "--quantization", quantization, "--prompt", prompt, "--max-tokens", str(steps)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    notes: list[str] = []
    ckpt = open_checkpoint(folder)
    artifact = build_artifact(folder, "host", "float32", checkpoint=ckpt, quantization=quantization,
                              progress=notes.append)
    assert any(n.startswith("using cached build") for n in notes), "the CLI's build is not the API's"
    session = open_session(artifact, ckpt, max_model_len=256)
    ids = session.encode_prompt(prompt, chat=False)
    result = session.generator.generate(ids, SamplingParams(temperature=0, max_tokens=steps), session.stop_ids)
    assert done.stdout.strip() == session.tokenizer.decode(result.token_ids).strip()
    return artifact, session, ids
