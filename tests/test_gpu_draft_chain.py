"""The draft cache's CUDA kernels (schedules/cuda/draft_chain.py) on a GPU: a CUDA build's
draft_extend / draft_step, draft_step captured in a CUDA graph, must draft what the same library's
paged-cache greedy decode (Generator) gives, round after round.

Artifacts: built here when the compiler is installed, else from VTOOL_GPU_DRAFT_CHAIN, a folder
made on a machine with the compiler by

    python tests/test_gpu_draft_chain.py --prepare DIR

(one <shape>-<dtype>/ folder per case, holding `model/` and `artifact/`).
"""
from __future__ import annotations

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


def case_paths(shape: str, dtype: str, tmp_path_factory) -> tuple[Path, Path]:  # noqa: ANN001
    from gpu_fixtures import prepared_case

    return prepared_case(ENV, "test_gpu_draft_chain.py", f"{shape}-{dtype}",
                         lambda root: prepare(root, shape, dtype), tmp_path_factory)


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


# -- the engine's way on a GPU: a request alone over both caches (runtime/engine/lone_chain.py) ---

def prepare_chat(root: Path) -> tuple[Path, Path]:
    """The tiny chat model (SmolLM2's tokenizer: the engine needs one) built float32 with the cache."""
    from tiny_models import make_tiny_chat_model
    from vtool.runtime.weights.default_model import default_model_path
    from vtool.toolchain.build import build_artifact

    case = root / "chat-float32"
    model = make_tiny_chat_model(case / "model", default_model_path())
    return model, build_artifact(model, "sm_90a", "float32", output=case / "artifact", draft_cache_len=CACHE_LEN)


def prepare_gguf_blocks(root: Path) -> tuple[Path, Path]:
    """A tiny Q4_K/Q6_K GGUF kept in its blocks (what a Q4_K_M target keeps on CUDA) with the cache."""
    from quant_gguf import VARIANTS, write_tiny_gguf
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.toolchain.build import build_artifact

    case = root / "q4_k-gguf-float32"
    (case / "model").mkdir(parents=True, exist_ok=True)
    qtype_of, tie, _, shape = VARIANTS["q4_k"]
    path = write_tiny_gguf(case / "model" / "m.gguf", qtype_of, tie=tie, shape=shape)
    return path, build_artifact(path, "sm_90a", "float32", checkpoint=open_checkpoint(path), quantization="gguf",
                                output=case / "artifact", draft_cache_len=CACHE_LEN)


def prepared(name: str, make, tmp_path_factory) -> tuple[Path, Path]:  # noqa: ANN001
    from gpu_fixtures import prepared_case

    return prepared_case(ENV, "test_gpu_draft_chain.py", name, make, tmp_path_factory)


def test_the_engine_runs_a_request_alone_on_both_caches_on_the_gpu(tmp_path_factory):
    """On a GPU the own caches are on by default: a greedy request alone runs chain rounds, leaves
    for the scheduler when a second arrives and returns when alone again; every token is the
    engine's without speculation (float32), the paged cache idle at the end; a draft model drafts
    for a request alone only (the GPU's batch-size rule)."""
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.engine.spec_config import GPU_DRAFT_DISABLE_BY_BATCH_SIZE, parse_speculative_config
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint

    model_dir, artifact = prepared("chat-float32", prepare_chat, tmp_path_factory)
    session = open_session(artifact, open_checkpoint(model_dir), max_model_len=CACHE_LEN)
    assert session.model.on_gpu
    rng = np.random.default_rng(5)
    arrivals = [(0, [int(t) for t in rng.integers(1, 4000, 40)], 40), (6, [int(t) for t in rng.integers(1, 4000, 9)], 8),
                (30, [int(t) for t in rng.integers(1, 4000, 90)], 24)]

    def drive(engine: Engine) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        pending, step = list(enumerate(arrivals)), 0
        while pending or engine.has_unfinished():
            while pending and pending[0][1][0] <= step:
                i, (_, ids, n) = pending.pop(0)
                engine.add_request(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                out[f"r{i}"] = []
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
            step += 1
        return out

    baseline = drive(Engine(session, EngineConfig()))
    config = parse_speculative_config({"model": str(model_dir), "num_speculative_tokens": 4})
    engine = Engine(session, EngineConfig(speculative=config.resolved(str(artifact), str(model_dir))))
    assert engine.lone_chain is not None  # auto: on a GPU
    assert engine.speculator.config.disable_by_batch_size == GPU_DRAFT_DISABLE_BY_BATCH_SIZE
    assert drive(engine) == baseline
    stats = engine.stats()
    assert stats["lone_chain_rounds"] > 0 and stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] > 0
    assert engine.kv.in_sync() and engine.kv_usage() == 0.0 and engine._alone is None
    # without speculation, asked, the same library decodes a request alone on its own cache
    # (runtime/engine/lone_decode.py), rounds of lone_decode_steps tokens, the same tokens
    lone = Engine(session, EngineConfig(lone_decode=True))
    assert type(lone.lone_chain).__name__ == "LoneDecode"
    assert drive(lone) == baseline
    assert lone.stats()["lone_decode_rounds"] > 0 and lone.stats()["lone_chain_rounds"] == 0
    assert lone.kv.in_sync() and lone.kv_usage() == 0.0 and lone._alone is None


def test_a_library_keeping_gguf_blocks_speculates_as_its_decode_on_the_gpu(tmp_path_factory):
    """draft_extend, draft_step and chain_verify over Q4_K/Q6_K blocks on CUDA (the block GEMV and
    the dequantizing prompt path): chain rounds give the library's own greedy decode."""
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.engine.draft_chain import ChainVerifier, DraftChain, chain_generate
    from vtool.runtime.engine.generate import Generator
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.weights.checkpoint import open_checkpoint

    path, artifact = prepared("q4_k-gguf-float32", prepare_gguf_blocks, tmp_path_factory)
    model = CompiledModel(artifact, open_checkpoint(path))
    assert model.on_gpu and model.manifest["quantization"] == "gguf"
    gen = Generator(model, CACHE_LEN)
    prompt = [1, 17, 42, 99, 7, 3, 250, 11, 64, 5, 200, 31]
    expected = list(gen.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)).token_ids)
    for k in (1, 4, 7):
        tokens, stats = chain_generate(ChainVerifier(model), DraftChain(model), list(prompt), 24, k)
        assert tokens == expected, k
        assert stats["accepted"] == stats["drafted"] > 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
    if len(sys.argv) != 3 or sys.argv[1] != "--prepare":
        sys.exit("usage: python tests/test_gpu_draft_chain.py --prepare DIR")
    for shape, dtype in CASES:
        print(prepare(Path(sys.argv[2]), shape, dtype))
    print(prepare_chat(Path(sys.argv[2])))
    print(prepare_gguf_blocks(Path(sys.argv[2])))
