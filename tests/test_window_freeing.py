"""Models whose every layer is windowed free the KV blocks wholly outside the window (issue 18).

The tiny Mistral and Phi-3 shapes (tests/support/tiny_models.py: window 8, every layer) get the
library's second cache, create_tir_sliding_kv_cache (models/window_cache.py: TVM's cache-wide
sliding window, inline rope, the window masked per query), which engines and generators use by
default since its attention runs on vtool's parallel inline-rope kernels (schedules/cpu/
rope_attention.py; EngineConfig.kv_window_freeing, Generator(free_window=...) turn it off): each
sequence keeps its last 7 tokens and holds at most 2 blocks of 16 however long it runs. A 40-token prompt and 60 greedy
tokens (100 tokens: 7 blocks on the per-layer cache) give transformers' tokens and logits, the
block mirror agrees with TVM's free-page count after every step, and the KV gauge is back at 0
at the end. Speculative decoding (which pops rejected drafts: TVM cannot bring slid tokens back)
keeps the per-layer cache. Models with a global layer never get the freeing cache."""
from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import window_oracle
from hf_oracle import float32_rounding, greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vtool import VtoolError
from vtool.models.config import parse_hf_config
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.artifact.tvm_runtime import global_func
from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.engine.generate import Generator
from vtool.runtime.engine.kv_blocks import KVBlockManager, OutOfBlocks, blocks_for_window
from vtool.runtime.engine.kv_cache import SLIDING_CACHE, PagedKVCache
from vtool.runtime.engine.spec_config import parse_speculative_config
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.session import Session
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.toolchain.build import build_artifact
from window_oracle import BOUND, KEPT, PROMPT, STEPS, TOL, TOL_LONG, WINDOW

def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=["mistral-window", "phi3-window"])
def windowed(request, tiny_shape_dir):
    folder = tiny_shape_dir(request.param)
    artifact = build_artifact(folder, "host", "float32")
    ref = greedy(hf_model(folder), PROMPT, STEPS)
    return types.SimpleNamespace(name=request.param, folder=folder, artifact=artifact,
                                 model=CompiledModel(artifact, open_checkpoint(folder)), ref=ref,
                                 rounding=float32_rounding(folder, PROMPT, ref, attn_implementation="eager"))


def session_of(w) -> Session:
    return window_oracle.session_of(w.folder, w.model)  # ids in, ids out


def test_the_build_has_the_freeing_cache(windowed):
    manifest = json.loads((windowed.artifact / "manifest.json").read_text())
    assert SLIDING_CACHE in manifest["entry_points"] and "create_tir_paged_kv_cache" in manifest["entry_points"]
    library = (windowed.artifact / "model.so").read_bytes()
    # its kernels under names of their own: vtool's parallel inline-rope ones (head dims of 16s)
    assert b"batch_prefill_paged_kv_cpu_sliding_window_window_freeing" in library
    assert b"batch_prefill_ragged_kv_window_freeing" in library
    assert manifest["window_freeing_kernels"] == "parallel"


def test_generation_past_the_window_matches_transformers(windowed):
    """`vtool run`'s generator on the freeing cache: prompt logits, 60 greedy tokens and their
    logits against transformers; TVM's pages held stay at 2 at most."""
    ref_prompt, ref_tokens, ref_logits = windowed.ref
    assert Generator(windowed.model, 256, free_window=False).kept == 0  # the per-layer cache when told
    gen = Generator(windowed.model, 256)  # the freeing cache by default
    assert gen.kept == KEPT
    prompt = float(np.abs(gen.prompt_logits(PROMPT) - ref_prompt).max())
    tokens, seen, held = window_oracle.generate_counting_pages(gen)
    assert tokens == ref_tokens
    errors = [float(np.abs(a - b).max()) for a, b in zip(seen, ref_logits)]
    print(windowed.name, "prompt", prompt, "first 24 steps", max(errors[:24]), "all", max(errors), "held", held,
          "transformers' float32 rounding", windowed.rounding)
    tol, tol_long = TOL + windowed.rounding, TOL_LONG + windowed.rounding
    assert prompt < tol and max(errors[:24]) < tol and max(errors) < tol_long
    assert max(held) <= BOUND and held[-1] >= 1


def run_engine(w, frees: bool = True, **config):
    return window_oracle.run_engine(session_of(w), frees, **config)


def test_the_engine_frees_blocks_outside_the_window(windowed):
    """Each sequence holds at most 2 blocks (through the mirror and TVM's free-page count alike)
    where the per-layer cache grows to 7; tokens equal transformers' either way."""
    ref_tokens = windowed.ref[1]
    done, per_seq, total = run_engine(windowed)
    assert done["a"] == ref_tokens and len(done["b"]) == STEPS
    assert per_seq <= BOUND and total <= 2 * BOUND, (per_seq, total)
    kept, per_seq_kept, _ = run_engine(windowed, frees=False)
    assert kept == done
    assert per_seq_kept == -(-(len(PROMPT) + STEPS) // 16) > BOUND  # what the bound above rules out


def test_a_library_on_tvms_serial_kernels_frees_only_when_asked(windowed):
    """A library whose freeing cache runs TVM's serial kernels (head dims not of 16s, or built
    before vtool's inline-rope kernels: no `window_freeing_kernels: parallel` in its manifest)
    keeps the per-layer cache by default, in the engine and the generator, and frees when asked."""
    old = copy.copy(windowed.model)
    old.manifest = {**windowed.model.manifest, "window_freeing_kernels": "serial"}
    assert Generator(old, 256).kept == 0 and Generator(old, 256, free_window=True).kept == KEPT
    for asked, frees in ((None, False), (True, True), (False, False)):
        engine = Engine(session_of(types.SimpleNamespace(folder=windowed.folder, model=old)),
                        EngineConfig(max_num_batched_tokens=64, kv_window_freeing=asked))
        assert engine.kv.frees is frees, asked
    del old.manifest["window_freeing_kernels"]
    assert Generator(old, 256).kept == 0
    default = Engine(session_of(windowed), EngineConfig(max_num_batched_tokens=64))
    assert default.kv.frees  # the parallel kernels: freed by default


def test_a_cache_of_few_blocks_serves_long_sequences(windowed):
    """The cache's block count need not cover a whole sequence, only the window: 1 block asked
    (TVM adds 1 + 2 per sequence) runs both 100-token requests; no prompt is refused as too long."""
    done, per_seq, _ = run_engine(windowed, num_blocks=1, max_num_seqs=2)
    assert done["a"] == windowed.ref[1] and per_seq <= BOUND


def test_speculation_keeps_the_per_layer_cache(windowed):
    """n-gram speculation pops rejected drafts, which the freeing cache cannot: the engine keeps the
    per-layer cache and gives transformers' tokens; the freeing cache refuses pop and fork by name."""
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    engine = Engine(session_of(windowed), EngineConfig(speculative=config, max_num_batched_tokens=64,
                                                       kv_window_freeing=True))
    assert not engine.kv.frees and engine.kv.window == 0
    engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), with_text=False)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step_core():
            tokens.extend(out.new_token_ids)
    assert tokens == windowed.ref[1][:24] and engine.kv.in_sync()

    kv = PagedKVCache(windowed.model, 4, 16, 2, 64, free_window=True)
    assert kv.frees and kv.window == KEPT
    kv.add(0)
    with pytest.raises(VtoolError, match="cannot take tokens back"):
        kv.pop(0, 1)
    with pytest.raises(VtoolError, match="cannot fork"):
        kv.fork(0, 1, 0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["add", "feed", "feed", "feed", "remove"]), st.integers(0, 50),
                          st.integers(1, WINDOW)), min_size=1, max_size=40))
def test_mirror_agrees_with_tvm_on_a_tight_freeing_cache(windowed, ops):
    """Random sequences fed random chunks on a cache that runs out of free pages (TVM then
    borrows placeholder pages a step's slide pays back): after every step the mirror's free
    count is TVM's, and no sequence holds more than 2 blocks."""
    model = windowed.model
    kv = PagedKVCache(model, num_blocks=1, block_size=16, max_num_seqs=3, prefill_chunk=64, free_window=True)
    assert kv.in_sync() and kv.blocks.num_blocks == 1 + 1 + 2 * 3  # TVM's page count for this cache
    next_id = 0
    for op, a, n in ops:
        live = kv.blocks.sequences()
        if op == "add" or not live:
            kv.add(next_id)
            next_id += 1
        elif op == "feed":
            seq = live[a % len(live)]
            if kv.blocks.blocks_needed(seq, n) <= kv.blocks.num_free_blocks:
                embeds = model.upload(np.zeros((1, n, model.hidden_size), np.float32))
                kv.begin_forward([seq], [n])
                model.function("prefill")(embeds, kv.tvm, model.params)
                kv.end_forward()
        else:
            kv.remove(live[a % len(live)])
        assert kv.in_sync(), (op, a, n)
        assert all(len(kv.blocks.blocks_of(s)) <= BOUND for s in kv.blocks.sequences())


def feed(kv: PagedKVCache, model, seq: int, ids: list[int] | int) -> np.ndarray:
    """One step of one sequence: token ids (their logits back, [n, vocab]) or n zero embeddings."""
    n = ids if isinstance(ids, int) else len(ids)
    if isinstance(ids, int):
        embeds = model.upload(np.zeros((1, n, model.hidden_size), np.float32))
    else:
        flat = model.function("embed")(model.upload(np.asarray(ids, dtype=np.int32), slot="ids"), model.params)
        embeds = global_func("runtime.TVMTensorCreateView")(flat, model.ffi.Shape([1, n, model.hidden_size]),
                                                            model.dtype, 0)
    positions = model.upload(np.arange(n, dtype=np.int32), slot="positions")
    kv.begin_forward([seq], [n])
    try:
        logits, _ = model.function("batch_prefill")(embeds, positions, kv.tvm, model.params)
    finally:
        kv.end_forward()
    return model.to_numpy(logits).reshape(n, -1)


def test_a_step_on_a_full_cache_borrows_the_page_its_slide_frees(windowed):
    """Every page taken, a sequence at 16 tokens (window in page 0) fed 8 more needs a new page
    and frees page 0 in the same step: TVM borrows a placeholder and fills it from the slid page.
    The mirror says the step fits (0 blocks needed), stays in sync, and the logits of the tokens
    fed across that step equal transformers'."""
    model = windowed.model
    kv = PagedKVCache(model, num_blocks=1, block_size=16, max_num_seqs=3, prefill_chunk=64, free_window=True)
    assert kv.blocks.num_blocks == 8
    for seq in range(5):
        kv.add(seq)
    for seq in (1, 2, 3):  # 20 tokens each: the window (13..19) across pages 0 and 1
        for n in (8, 8, 4):
            feed(kv, model, seq, n)
    feed(kv, model, 4, 8)
    logits = [feed(kv, model, 0, PROMPT[0:8]), feed(kv, model, 0, PROMPT[8:16])]
    assert kv.blocks.num_free_blocks == 0 and kv.in_sync()
    for start in (16, 24, 32):
        assert kv.blocks.blocks_needed(0, 8) == 0
        logits.append(feed(kv, model, 0, PROMPT[start:start + 8]))
        assert kv.in_sync() and kv.blocks.num_free_blocks == 0
    err = float(np.abs(np.concatenate(logits) - windowed.ref[0]).max())
    print(windowed.name, "borrowing steps: max |diff|", err)
    assert err < TOL + windowed.rounding


# -- the mirror alone, against a model of TVM's page table (paged_kv_cache.cc) ----------------------

class TvmPages:
    """TVM 0.27's ReserveAppendLengthInSeq + SlideWindowForSequence for sequences of one block
    each, sink 0: the block's pages (True: a real page, False: a placeholder borrowed while none
    was free), its kept length and the window's offset into its first page."""

    def __init__(self, num_pages: int, page: int):
        self.free, self.page, self.seqs = num_pages, page, {}

    def add(self, seq: int, window: int) -> None:
        self.seqs[seq] = {"pages": [], "length": 0, "offset": 0, "window": window}

    def append(self, seq: int, n: int) -> None:
        s, p = self.seqs[seq], self.page
        for _ in range(-(-(s["length"] + s["offset"] + n) // p) - len(s["pages"])):
            if self.free:
                self.free -= 1
                s["pages"].append(True)
            elif s["window"]:  # kPagedKVCacheTempPageId
                s["pages"].append(False)
            else:
                raise OutOfBlocks("the KV cache is full")
        s["length"] += n
        if s["window"] and s["length"] > s["window"]:
            first, start = divmod(s["offset"] + s["length"] - s["window"], p)
            self.free += sum(s["pages"][:first])  # placeholders slid out give nothing back
            del s["pages"][:first]
            s["length"], s["offset"] = s["window"], start
        borrowed = s["pages"].count(False)
        if borrowed > self.free:
            raise OutOfBlocks("no page for a borrowed placeholder")
        self.free -= borrowed
        s["pages"] = [True] * len(s["pages"])

    def remove(self, seq: int) -> None:
        self.free += len(self.seqs.pop(seq)["pages"])


@settings(max_examples=300, deadline=None)
@given(st.integers(3, 12), st.lists(st.tuples(st.sampled_from(["add", "add_windowed", "append", "append", "append",
                                                                 "remove"]),
                                               st.integers(0, 50), st.integers(1, 20), st.integers(1, 20)),
                                     min_size=1, max_size=60))
def test_windowed_mirror_matches_tvms_page_table(num_blocks, ops):
    """Windowed and unwindowed sequences: the mirror's free count and each sequence's blocks equal
    the TVM model's after every append; blocks_needed says exactly when an append fits; a windowed
    sequence never holds more than blocks_for_window."""
    page = 4
    mirror, tvm = KVBlockManager(num_blocks, page), TvmPages(num_blocks, page)
    next_id = 0
    for op, a, n, window in ops:
        live = mirror.sequences()
        if op.startswith("add") or not live:
            window = window if op == "add_windowed" else 0
            mirror.add(next_id, window)
            tvm.add(next_id, window)
            next_id += 1
        elif op == "append":
            seq = live[a % len(live)]
            fits = mirror.blocks_needed(seq, n) <= mirror.num_free_blocks
            try:
                tvm.append(seq, n)
                tvm_ok = True
            except OutOfBlocks:
                tvm_ok = False
            assert fits == tvm_ok, (seq, n, mirror.window(seq))
            if fits:
                mirror.append(seq, n)
            else:
                with pytest.raises(OutOfBlocks):
                    mirror.append(seq, n)
                mirror.remove(seq)  # TVM's state after a failed reserve is not worth modelling
                tvm.seqs.pop(seq)
                tvm.free = mirror.num_free_blocks
        else:
            seq = live[a % len(live)]
            mirror.remove(seq)
            tvm.remove(seq)
        assert mirror.num_free_blocks == tvm.free
        for seq in mirror.sequences():
            assert len(mirror.blocks_of(seq)) == len(tvm.seqs[seq]["pages"])
            if mirror.window(seq):
                assert len(mirror.blocks_of(seq)) <= blocks_for_window(mirror.window(seq), page)
    for seq in mirror.sequences():
        mirror.remove(seq)
    assert mirror.num_free_blocks == num_blocks


def test_a_windowed_sequence_is_neither_popped_nor_forked():
    m = KVBlockManager(8, 4)
    m.add(0, window=5)
    m.append(0, 11)  # keeps tokens 6..10: blocks of positions 4..11
    assert len(m.blocks_of(0)) == 2 and m.num_free_blocks == 6
    with pytest.raises(ValueError, match="sliding window"):
        m.pop(0, 1)
    with pytest.raises(ValueError, match="sliding window"):
        m.fork(0, 1, 0)
    m.pop(0, 0)  # nothing to pop is fine


# -- which builds get the freeing cache ---------------------------------------------------------------

def test_only_all_window_models_on_the_cpu_and_cuda_get_the_freeing_cache(tiny_shape_dir):
    """A model with a global layer keeps every page (its global layers need them all); so do
    models rotating q/k themselves (model_rope: the freeing cache's positions restart at the
    window), and targets other than the CPU and CUDA (TVM's kernels for it not run there)."""
    from vtool.models.window_cache import FREEING_SUFFIX, frees_window
    from vtool.schedules.cpu import FREEING_SUFFIX as SCHEDULES_SUFFIX

    assert FREEING_SUFFIX == SCHEDULES_SUFFIX
    cpu, cuda, vulkan = (types.SimpleNamespace(kind=types.SimpleNamespace(name=n)) for n in ("llvm", "cuda", "vulkan"))

    def config(shape: str):
        return parse_hf_config(json.loads((tiny_shape_dir(shape) / "config.json").read_text()))

    for shape in ("mistral-window", "phi3-window"):
        assert frees_window(config(shape), cpu) and frees_window(config(shape), cuda)
        assert not frees_window(config(shape), vulkan)
    for shape in ("olmo3-window", "qwen2-window", "gemma3-window", "gemma2-softcap", "llama-gqa"):
        assert not frees_window(config(shape), cpu), shape
    mistral = config("mistral-window")
    assert not frees_window(dataclasses.replace(mistral, model_rope=True), cpu)
    assert not frees_window(dataclasses.replace(mistral, sliding_window=1), cpu)
    assert not frees_window(dataclasses.replace(mistral, sliding_layers=(0,)), cpu)


# -- the server flag ---------------------------------------------------------------------------------

def test_serve_frees_window_blocks_by_default(tiny_model_dir, tmp_path):
    """`vtool serve` on a Mistral with a window of 8 (the tiny chat Llama's weights and tokenizer
    under Mistral's config, head dim 16), no flag: with one KV block asked for, a 40-token prompt
    and 60 greedy tokens (100 tokens, 7 blocks without freeing) come back as transformers'
    tokens, and /server_info says the freeing cache is in use."""
    import httpx
    from live_server import vtool_serve
    from openai import OpenAI

    folder = tmp_path / "mistral-chat"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=WINDOW)
    (folder / "config.json").write_text(json.dumps(config))
    ref_tokens = greedy(hf_model(folder), PROMPT, STEPS)[1]
    log = tmp_path / "serve.log"
    args = ["--model", str(folder), "--num-blocks", "1", "--max-num-seqs", "2",
            "--max-model-len", "256", "--served-model-name", "m"]
    with vtool_serve(args, log) as url:
        assert httpx.get(f"{url}/server_info").json()["engine"]["kv_window_freeing_active"] is True
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        done = client.completions.create(model="m", prompt=PROMPT, max_tokens=STEPS, temperature=0, logprobs=0,
                                         extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    tokens = [int(t.removeprefix("token_id:")) for t in done.choices[0].logprobs.tokens]
    assert tokens == ref_tokens and done.usage.prompt_tokens == len(PROMPT)
    assert "KV blocks outside the sliding window freed" in log.read_text()
