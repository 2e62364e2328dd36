"""The draft cache's CUDA kernels (schedules/cuda/draft_chain.py) on a GPU: a CUDA build's
draft_extend / draft_step, draft_step captured in a CUDA graph, must draft what the same library's
paged-cache greedy decode (Generator) gives, round after round.

Artifacts: built here when the compiler is installed, else from VTOOL_GPU_DRAFT_CHAIN, a folder
made on a machine with the compiler by

    python tests/test_gpu_draft_chain.py --prepare DIR

(one <shape>-<dtype>/ folder per case, holding `model/` and `artifact/`).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ENV = "VTOOL_GPU_DRAFT_CHAIN"
CASES = [("qwen2-bias", "float32"), ("llama-gqa", "float32"), ("qwen2-bias", "bfloat16")]
CACHE_LEN = 256


def prepare(root: Path, shape: str, dtype: str) -> tuple[Path, Path]:
    from tiny_models import make_tiny_model
    from vtool.toolchain.build import build_artifact

    case = root / f"{shape}-{dtype}"
    model = make_tiny_model(shape, case / "model", seed=3)
    artifact = build_artifact(model, "sm_90a", dtype, output=case / "artifact", draft_cache_len=CACHE_LEN)
    return model, artifact


def case_paths(shape: str, dtype: str, tmp_path_factory) -> tuple[Path, Path]:
    root = os.environ.get(ENV)
    if root:
        case = Path(root) / f"{shape}-{dtype}"
        if not (case / "artifact").is_dir():
            pytest.fail(f"{ENV}={root} has no {case.name}/artifact: run `python tests/test_gpu_draft_chain.py "
                        "--prepare DIR` where the compiler is installed")
        return case / "model", case / "artifact"
    try:
        import tvm  # noqa: F401
    except ImportError:
        pytest.skip(f"no compiler here and {ENV} unset: nothing to run")
    return prepare(tmp_path_factory.mktemp("draftchain"), shape, dtype)


@pytest.mark.parametrize("shape, dtype", CASES)
def test_the_chain_drafts_the_greedy_continuation_on_the_gpu(shape, dtype, tmp_path_factory):
    from vtool.runtime.engine.draft_chain import DraftChain
    from vtool.runtime.engine.generate import Generator
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint

    model_dir, artifact = case_paths(shape, dtype, tmp_path_factory)
    model = CompiledModel(artifact, open_checkpoint(model_dir))  # (a tiny random model: no tokenizer)
    assert model.on_gpu
    gen = Generator(model, CACHE_LEN)

    def greedy(ids: list[int], n: int) -> list[int]:
        return list(gen.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)).token_ids)

    chain = DraftChain(model)
    rng = np.random.default_rng(7)
    same = total = 0
    for prompt_len, k in ((1, 3), (2, 5), (37, 4), (120, 8)):
        ids = [int(t) for t in rng.integers(1, 400, prompt_len)]
        request = f"p{prompt_len}"
        for _ in range(5):
            drafts = chain.propose(request, ids, k)
            want = greedy(ids, k)
            same += sum(a == b for a, b in zip(drafts, want))
            total += k
            if dtype == "float32":
                assert drafts == want, (shape, ids, k)
            kept = int(rng.integers(0, k + 1))
            ids = ids + want[:kept] + [int(rng.integers(1, 400))]
    # bfloat16: the draft attention sums in another order than the paged cache's kernels, so a
    # near tie may go the other way now and then; drafts only need to be mostly right
    assert same / total >= (1.0 if dtype == "float32" else 0.9), (same, total)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
    if len(sys.argv) != 3 or sys.argv[1] != "--prepare":
        sys.exit("usage: python tests/test_gpu_draft_chain.py --prepare DIR")
    for shape, dtype in CASES:
        print(prepare(Path(sys.argv[2]), shape, dtype))
