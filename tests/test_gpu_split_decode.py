"""`decode` in two calls on a GPU (issue 13): a CUDA build exports decode_hidden (the layers) and
decode_logits (the final norm and lm_head) beside `decode` (models/decoder.py, toolchain/build.py
`splits_decode`), and a chained one-sequence step runs them with the KV cache's fence between, so
the next step waits for the layers only. Their logits must be `decode`'s bit for bit, step after
step across a KV page boundary: the same kernels, split at a function boundary.
test_chained_engine_cpu.py holds a host build (the entries forced) to the same check.

Artifacts: built here when the compiler and nvcc are at hand, else from VTOOL_GPU_SPLIT_DECODE, a
folder made where the compiler is by

    python tests/test_gpu_split_decode.py --prepare DIR

(one <shape>-<dtype>/ folder per case, holding `model/` and `artifact/`).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from gpu_fixtures import sm90_gpu  # noqa: E402,F401  (fixture)

pytestmark = pytest.mark.gpu

ENV = "VTOOL_GPU_SPLIT_DECODE"
TARGET = "sm_90a"
CASES = [("llama-gqa", "float32"), ("llama-gqa", "bfloat16"), ("qwen2-bias", "bfloat16")]


def prepare(root: Path, shape: str, dtype: str) -> tuple[Path, Path]:
    from tiny_models import make_tiny_model
    from vtool.toolchain.build import build_artifact

    case = root / f"{shape}-{dtype}"
    model = make_tiny_model(shape, case / "model", seed=5)
    return model, build_artifact(model, TARGET, dtype, output=case / "artifact")


def case_paths(shape: str, dtype: str, tmp_path_factory) -> tuple[Path, Path]:  # noqa: ANN001
    from gpu_fixtures import prepared_case

    return prepared_case(ENV, "test_gpu_split_decode.py", f"{shape}-{dtype}",
                         lambda root: prepare(root, shape, dtype), tmp_path_factory)


@pytest.mark.parametrize("shape, dtype", CASES)
def test_decode_in_two_calls_gives_decodes_logits_on_the_gpu(sm90_gpu, shape, dtype, tmp_path_factory):  # noqa: F811
    from two_call_decode import assert_two_calls_give_decodes_logits
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint

    model_dir, artifact = case_paths(shape, dtype, tmp_path_factory)
    model = CompiledModel(artifact, open_checkpoint(model_dir))  # a tiny random model: no tokenizer
    assert model.on_gpu
    assert_two_calls_give_decodes_logits(model, prompt_len=29, steps=8)  # 29 + 8 tokens: a third page at step 3


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--prepare":
        sys.exit("usage: python tests/test_gpu_split_decode.py --prepare DIR")
    for shape, dtype in CASES:
        print(prepare(Path(sys.argv[2]), shape, dtype))
