"""What the window-freeing tests share, on the CPU (tests/test_window_freeing.py) and on a GPU
(tests/test_gpu_parity.py): the prompt, the bounds, and two requests run through the engine with
the block mirror checked against TVM after every step. Imports no compiler room: the GPU
machine has only the TVM runtime."""
from __future__ import annotations

import numpy as np
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.artifact.tvm_runtime import global_func
from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.engine.generate import Generator
from vtool.runtime.engine.kv_blocks import blocks_for_window
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.session import Session
from vtool.runtime.weights.checkpoint import open_checkpoint

PROMPT = [1] + np.random.default_rng(1).integers(3, 500, 39).tolist()  # 40 tokens: 5 windows of 8
STEPS = 60  # 100 tokens in all: 7 blocks of 16 kept on the per-layer cache
WINDOW, KEPT = 8, 7  # a sequence keeps window - 1 tokens; the query is the window's last
BOUND = blocks_for_window(KEPT, 16)  # 2 blocks per sequence at most
# Bounds on top of transformers' own float32 rounding on the run (hf_oracle.float32_rounding, as
# test_parity_tiny): tiny Mistral's float32 decode is 6.2e-5 from its float64 run over these 60
# steps. Past 24 steps the per-layer cache measured 1.01e-4 (Xeon, AVX-512) and 1.44e-4 (AMD EPYC
# Zen 3, AVX2); the freeing cache 9.7e-5 and 1.04e-4 (Mistral), 7.5e-5 and 7.0e-5 (Phi-3), its
# AVX2 figure reached by step 24.
TOL = 1e-4
TOL_LONG = 2e-4


def session_of(folder, model: CompiledModel) -> Session:
    """A session over token ids (no tokenizer) for the engine."""
    return Session(open_checkpoint(folder), model, None, [], 256, Generator(model, 256))


def generate_counting_pages(gen: Generator) -> tuple[list[int], list[np.ndarray], list[int]]:
    """PROMPT then STEPS greedy tokens through `gen`: (tokens, the logits each was chosen from,
    the pages TVM's cache holds for the sequence after each token)."""
    available = global_func("vm.builtin.attention_kv_cache_get_num_available_pages")
    gen._fresh_sequence(len(PROMPT) + STEPS)
    total = int(available(gen._kv))  # the sequence holds no page yet
    held: list[int] = []
    seen: list[np.ndarray] = []
    result = gen.generate(PROMPT, SamplingParams(temperature=0, max_tokens=STEPS), on_logits=seen.append,
                          on_token=lambda _t: held.append(total - int(available(gen._kv))))
    return result.token_ids, seen, held


def run_engine(session: Session, frees: bool = True, **config) -> tuple[dict[str, list[int]], int, int]:
    """Two requests through the engine, the mirror checked against TVM after every step: the
    tokens, the most blocks any one sequence held, the most blocks held in all. frees=False:
    the default per-layer cache, which keeps every page. config: more EngineConfig fields."""
    engine = Engine(session, EngineConfig(max_num_batched_tokens=64, kv_window_freeing=frees, **config))
    assert engine.kv.frees is frees and engine.scheduler.config.max_chunk == WINDOW
    initial = engine.kv.tvm_free_blocks()
    assert engine.kv.blocks.num_free_blocks == initial and engine.kv_usage() == 0
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    for rid, prompt in (("a", PROMPT), ("b", PROMPT[:13])):
        engine.add_request(rid, prompt, params, with_text=False)
    done: dict[str, list[int]] = {"a": [], "b": []}
    per_seq = total = 0
    while engine.has_unfinished():
        for out in engine.step_core():
            done[out.request_id].extend(out.new_token_ids)
        assert engine.kv.in_sync(), "block mirror and TVM disagree"
        used = initial - engine.kv.tvm_free_blocks()
        assert used == engine.kv.blocks.num_blocks - engine.kv.blocks.num_free_blocks
        total = max(total, used)
        per_seq = max([per_seq] + [len(engine.kv.blocks.blocks_of(r.seq_id)) for r in engine.scheduler.running])
    assert engine.kv_usage() == 0 and engine.kv.tvm_free_blocks() == initial  # idle again
    return done, per_seq, total
