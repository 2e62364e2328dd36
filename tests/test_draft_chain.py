"""The draft cache (`vtool build --draft-cache-len`): draft_extend / draft_step (models/draft_chain.py)
and the runtime's DraftChain (runtime/engine/draft_chain.py), on a CPU build.

The oracle is the same library's own paged-cache greedy decode (Generator), itself checked against
transformers elsewhere: the chain's drafts must be the greedy continuation of whatever tokens a
round hands it, whatever it held from earlier rounds. The CUDA forms of the kernels are checked on
a GPU by tests/test_gpu_draft_chain.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from vtool import VtoolError
from vtool.runtime.engine.draft_chain import ChainVerifier, DraftChain, chain_generate, has_chain_verify, has_draft_chain
from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.engine.generate import Generator
from vtool.runtime.engine.lone_decode import LoneDecode
from vtool.runtime.engine.spec_config import parse_speculative_config
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.session import open_session
from vtool.runtime.weights.checkpoint import open_checkpoint

CACHE_LEN = 96


@pytest.fixture(scope="module")
def chain_artifact(tiny_model_dir):
    from vtool.toolchain.build import build_artifact

    return build_artifact(tiny_model_dir, "host", draft_cache_len=CACHE_LEN)


@pytest.fixture(scope="module")
def chain_session(tiny_model_dir, chain_artifact):
    return open_session(chain_artifact, open_checkpoint(tiny_model_dir), max_model_len=256)


def greedy(session, ids: list[int], n: int) -> list[int]:
    """The library's own greedy continuation through the paged cache (Generator)."""
    gen = Generator(session.model, 256)
    return list(gen.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)).token_ids)


def test_the_build_records_the_draft_cache(chain_session, tiny_session):
    m = chain_session.model
    assert has_draft_chain(m) and not has_draft_chain(tiny_session.model)
    info = m.manifest["draft_chain"]
    cfg = m.manifest["config"]
    assert info["cache_len"] == CACHE_LEN == m.manifest["build"]["plan"]["draft_cache_len"]
    assert info["cache_shape"] == [cfg["num_hidden_layers"], CACHE_LEN, cfg["num_key_value_heads"],
                                   cfg["hidden_size"] // cfg["num_attention_heads"]]
    assert {"draft_extend", "draft_step", "chain_verify"} <= set(m.manifest["entry_points"])
    assert info["max_verify"] == 8 and info["verify_state_len"] == 24


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), prompt=st.lists(st.integers(1, 400), min_size=1, max_size=30), k=st.integers(1, 8))
def test_drafts_are_the_greedy_continuation_round_after_round(chain_session, data, prompt, k):
    """Rounds as verification leaves them: some drafts kept, then another token (the target's),
    or a request that starts over; each round's drafts equal the paged cache's greedy tokens."""
    chain = DraftChain(chain_session.model)
    ids, request = list(prompt), "a"
    for _ in range(4):
        if len(ids) + k > CACHE_LEN:
            break
        drafts = chain.propose(request, ids, k)
        assert drafts == greedy(chain_session, ids, k), (ids, k)
        kept = data.draw(st.integers(0, k), label="kept")
        ids = ids + drafts[:kept] + [data.draw(st.integers(1, 400), label="next")]
        if data.draw(st.booleans(), label="another request"):
            request = request + "'"
            ids = ids[:data.draw(st.integers(1, len(ids)), label="its common prefix")]


def test_a_model_that_rotates_its_own_keys_drafts_its_greedy_tokens(tiny_shape_dir, tmp_path):
    """Phi-4-mini's partial rotary (q and k rotated by the model, not the cache): the draft cache
    stores its keys as they come, and its drafts are still the paged cache's greedy tokens."""
    import shutil
    from types import SimpleNamespace

    from vtool.runtime.artifact.library import CompiledModel
    from vtool.toolchain.build import build_artifact

    folder = tmp_path / "phi3-partial"
    shutil.copytree(tiny_shape_dir("phi3-fused"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(partial_rotary_factor=0.75, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                              "partial_rotary_factor": 0.75})
    cfg.pop("rope_scaling", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    art = build_artifact(folder, "host", output=tmp_path / "art", draft_cache_len=64)
    model = CompiledModel(art, open_checkpoint(folder))  # the tiny folder has no tokenizer
    assert model.manifest["config"]["model_rope"] and model.manifest["config"]["rotary_dim"] == 24
    session = SimpleNamespace(model=model)
    chain = DraftChain(model)
    ids = [5, 17, 300, 2, 41, 9, 77]
    drafts = chain.propose("a", ids, 6)
    assert drafts == greedy(session, ids, 6)
    ids = ids + drafts[:3] + [123]
    assert chain.propose("a", ids, 5) == greedy(session, ids, 5)


@pytest.fixture(scope="module")
def other_draft_build(tiny_model_dir, tmp_path_factory):
    """Another tiny model of the same vocabulary (another seed), built with the cache: its folder
    and artifact. Its drafts are mostly wrong."""
    import sys
    from pathlib import Path

    from vtool.runtime.weights.default_model import default_model_path
    from vtool.toolchain.build import build_artifact

    sys.path.insert(0, str(Path(__file__).parent / "support"))
    from tiny_models import make_tiny_chat_model

    folder = make_tiny_chat_model(tmp_path_factory.mktemp("otherdraft"), default_model_path(), seed=5)
    return folder, build_artifact(folder, "host", draft_cache_len=CACHE_LEN)


@pytest.fixture(scope="module")
def other_draft(other_draft_build):
    from vtool.runtime.artifact.library import CompiledModel

    folder, artifact = other_draft_build
    return CompiledModel(artifact, open_checkpoint(folder))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(1, 400), min_size=1, max_size=20), k=st.integers(0, 7),
       n=st.integers(1, 24), own=st.booleans())
def test_chain_speculation_gives_the_target_s_greedy_tokens(chain_session, other_draft, prompt, k, n, own):
    """Both caches on the device: the target's chain_verify scores each round's drafts (its own
    model's, all kept; or another model's, mostly not) and the tokens are its greedy decode."""
    target = ChainVerifier(chain_session.model)
    draft = DraftChain(chain_session.model if own else other_draft)
    tokens, stats = chain_generate(target, draft, list(prompt), n, k)
    assert tokens == greedy(chain_session, list(prompt), n)
    assert stats["accepted"] <= stats["drafted"] and stats["rounds"] <= n
    if own and k:  # its own drafts are its greedy tokens: every one kept
        assert stats["accepted"] == stats["drafted"] and stats["rounds"] < n or n <= 1


def test_every_chain_object_of_a_library_uses_one_set_of_buffers(chain_session):
    """A CUDA graph of draft_step or chain_verify keeps the addresses it was captured with: a second
    DraftChain or ChainVerifier on the same library must reuse the first one's tensors (and its
    bookkeeping of what they hold), each role its own."""
    m = chain_session.model
    a, b = DraftChain(m), DraftChain(m)
    va, vb = ChainVerifier(m), ChainVerifier(m)
    assert a._k is b._k and a._v is b._v and a._state is b._state
    assert va._k is vb._k and va._state is vb._state and va._k is not a._k
    ids = [4, 44, 144, 244]
    drafts = a.propose("x", ids, 3)
    assert b.tokens == ids + drafts[:-1]  # b knows what a left in the cache
    more = ids + drafts[:2] + [17]
    assert b.propose("x", more, 3) == greedy(chain_session, more, 3)
    assert vb.verify("x", more, []) == va.verify("x", more, []) == greedy(chain_session, more, 1)


def test_chain_verify_scores_any_drafts_as_decode_would(chain_session):
    """Row by row, chain_verify's greedy tokens are the paged cache's after each prefix, for drafts
    that are right, wrong, after a rejected round and for another request."""
    assert has_chain_verify(chain_session.model)
    target = ChainVerifier(chain_session.model)
    ids = [3, 99, 250, 7, 61]
    want = greedy(chain_session, ids, 4)
    assert target.verify("a", ids, want[:3]) == want  # all right: the bonus token too
    wrong = [want[0], (want[1] + 1) % 400, 5]
    got = target.verify("a", ids, wrong)
    assert got[:2] == want[:2] and got[2] == greedy(chain_session, ids + wrong[:2], 1)[0]
    ids2 = ids + [want[0], want[1]]  # the round kept one draft and the target's token
    assert target.verify("a", ids2, []) == greedy(chain_session, ids2, 1)
    other = [8, 8, 8]
    assert target.verify("b", other, [1, 2]) == [greedy(chain_session, other + [1, 2][:i], 1)[0] for i in range(3)]
    with pytest.raises(ValueError, match="cannot take"):
        target.verify("a", ids, [1] * target.max_verify)


def test_a_round_past_the_cache_or_the_steps_is_refused_by_name(chain_session):
    chain = DraftChain(chain_session.model)
    assert not chain.fits(CACHE_LEN, 1) and chain.fits(CACHE_LEN - 1, 1)
    assert not chain.fits(10, chain.max_steps) and not chain.fits(10, 0)
    with pytest.raises(ValueError, match="cannot take"):
        chain.propose("a", [1] * CACHE_LEN, 2)


PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n", "Hi"]


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


def test_a_draft_with_the_cache_drafts_through_it_alone_and_changes_nothing(chain_session, tiny_session,
                                                                             tiny_model_dir, chain_artifact):
    """The tiny model as its own draft, built with the cache: a greedy request alone drafts through
    it (and keeps every draft); three at once take the engine's way; the tokens never change."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [tiny_session.tokenizer.encode(p) for p in PROMPTS]
    baseline = run(Engine(tiny_session, EngineConfig()), prompts, params)
    config = parse_speculative_config({"model": str(tiny_model_dir), "num_speculative_tokens": 4,
                                      "own_caches": True})  # on the CPU too
    engine = Engine(tiny_session, EngineConfig(speculative=config.resolved(str(chain_artifact), str(tiny_model_dir))))
    draft = engine.speculator.proposer
    assert draft.chain is not None
    assert run(engine, prompts, params) == baseline  # three at once: the paged draft cache
    assert draft.chain_rounds == 0
    for i, ids in enumerate(prompts):  # one at a time: the chain
        assert run(engine, [ids], params) == {"r0": baseline[f"r{i}"]}
    assert draft.chain_rounds > 0
    s = engine.stats()
    assert s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"] > 0
    assert draft.chain.owner is None  # released with its request
    assert engine.kv.in_sync() and engine.kv_usage() == 0.0
    # a sampled request alone needs the draft's probabilities: the engine's way
    rounds = draft.chain_rounds
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)
    run(engine, [prompts[0]], sampled)
    assert draft.chain_rounds == rounds


@pytest.mark.parametrize("shape, says", [
    ("gpt2-learned-pos", "no draft entry points"),
    ("mistral-window", "sliding window"),
    ("gemma2-softcap", "sliding window|soft-caps"),
])
def test_models_the_cache_cannot_serve_are_refused_by_name(tiny_shape_dir, shape, says):
    from vtool.toolchain.plan import BuildOptions, resolve_plan

    with pytest.raises(VtoolError, match=says):
        resolve_plan(open_checkpoint(tiny_shape_dir(shape)), "host", BuildOptions(draft_cache_len=64), tools=False)


def test_sizes_and_targets(tiny_model_dir):
    from vtool.toolchain.plan import BuildOptions, resolve_plan

    ckpt = open_checkpoint(tiny_model_dir)
    with pytest.raises(VtoolError, match="at least 16"):
        resolve_plan(ckpt, "host", BuildOptions(draft_cache_len=8), tools=False)
    context = ckpt.config()["max_position_embeddings"]
    with pytest.raises(VtoolError, match=f"more positions than the model's context \\({context}\\)"):
        resolve_plan(ckpt, "sm_90a", BuildOptions(draft_cache_len=context + 1), tools=False)
    assert resolve_plan(ckpt, "sm_90a", BuildOptions(draft_cache_len=context), tools=False).draft_cache_len == context
    # the option changes the library, so the cache key
    a = resolve_plan(ckpt, "host", BuildOptions(), tools=False).as_dict()
    b = resolve_plan(ckpt, "host", BuildOptions(draft_cache_len=64), tools=False).as_dict()
    assert "draft_cache_len" not in a and b["draft_cache_len"] == 64


def test_a_speculative_pair_gets_its_own_caches_on_cuda_by_default(tiny_model_dir, tiny_shape_dir):
    """DRAFT_CACHE_AUTO (what run/serve/bench/LLM build a draft-model pair with): a CUDA target gets
    up to 4096 positions within the context, the CPU none (the engine's way is faster there), a
    model the cache cannot serve none, saying why, instead of a refusal."""
    from vtool.runtime.engine.spec_config import PAIR_DRAFT_CACHE, pair_cache_len
    from vtool.toolchain.plan import DRAFT_CACHE_AUTO, BuildOptions, resolve_plan

    assert PAIR_DRAFT_CACHE == DRAFT_CACHE_AUTO
    ckpt = open_checkpoint(tiny_model_dir)
    context = ckpt.config()["max_position_embeddings"]
    auto = BuildOptions(draft_cache_len=DRAFT_CACHE_AUTO)
    assert resolve_plan(ckpt, "sm_90a", auto, tools=False).draft_cache_len == min(4096, context)
    assert resolve_plan(ckpt, "host", auto, tools=False).draft_cache_len == 0
    heard: list[str] = []
    window = open_checkpoint(tiny_shape_dir("mistral-window"))
    assert resolve_plan(window, "sm_90a", auto, notice=heard.append, tools=False).draft_cache_len == 0
    assert any("without the model's own cache" in h and "sliding window" in h for h in heard)
    draft = parse_speculative_config({"model": "d", "num_speculative_tokens": 3})
    assert pair_cache_len(draft) == DRAFT_CACHE_AUTO and pair_cache_len(None) == 0
    assert pair_cache_len(parse_speculative_config({"model": "d", "num_speculative_tokens": 3,
                                                    "own_caches": False})) == 0
    assert pair_cache_len(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})) == 0


def test_the_cuda_attention_refuses_what_it_cannot_lay_out():
    from vtool.schedules.cuda.draft_chain import attention_layout, attention_part_gpu

    assert attention_layout(14, 2, 64, "bfloat16") == (8, 8, 16, 2)  # the 0.5B Qwen2.5 draft
    with pytest.raises(ValueError, match="cannot lay out 4 query heads over 2 KV heads of 96"):
        attention_part_gpu(2, 128, 4, 2, 96, "float16", 32)
    with pytest.raises(ValueError, match="cannot lay out 32 query heads over 1 KV heads of 128"):
        attention_layout(32, 1, 128, "bfloat16")  # 32 heads x 8 elements: too many registers


@pytest.mark.slow
def test_a_cuda_build_has_the_draft_entries(tiny_model_dir, tmp_path):
    """Compiled for sm_90a here (no GPU): the scheduled kernels go through nvcc."""
    from vtool.toolchain.build import build_artifact

    art = build_artifact(tiny_model_dir, "sm_90a", "float16", output=tmp_path / "art", draft_cache_len=128)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["draft_chain"]["cache_len"] == 128
    assert {"draft_extend", "draft_step"} <= set(manifest["entry_points"])
    assert manifest["build"]["cuda"]["embedded"]["sass"]
    assert "vtool.DraftChain" in manifest["build"]["pipeline"]["schedules"]["default_rules"]


@pytest.mark.parametrize("stream", [False, True])
def test_vtool_run_speculates_with_both_models_on_their_own_caches(chain_artifact, tiny_model_dir, stream):
    """A target and a draft both built with --draft-cache-len (here one tiny library as both):
    `vtool run` takes chain_generate for a greedy prompt, prints the engine's text and says so."""
    import io

    from rich.console import Console

    from vtool.runtime.run_cmd import RunOptions, run_completion

    def run(spec) -> tuple[str, str]:  # noqa: ANN001
        out, err = io.StringIO(), io.StringIO()
        run_completion(chain_artifact, open_checkpoint(tiny_model_dir),
                       RunOptions(prompt="The quick brown fox", max_tokens=24, repeat=2, stream=stream),
                       Console(file=out, width=400), Console(file=err, width=400), EngineConfig(speculative=spec))
        return out.getvalue(), err.getvalue()

    config = parse_speculative_config({"model": str(tiny_model_dir), "num_speculative_tokens": 4, "own_caches": True})
    plain, plain_log = run(None)
    fast, log = run(config.resolved(str(chain_artifact), str(tiny_model_dir)))
    assert fast == plain and len(plain.strip()) > 0
    assert "on their own caches" in log and "(100%)" in log and "on their own caches" not in plain_log
    assert "24 tokens (length)" in log


# -- the engine: a greedy request alone over both caches (runtime/engine/lone_chain.py) --------------

def drive(engine: Engine, arrivals: list[tuple[int, list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Step the engine, adding request i at the step its arrival names; the tokens of each."""
    out: dict[str, list[int]] = {}
    pending = sorted(enumerate(arrivals), key=lambda item: item[1][0])
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, ids, params) = pending.pop(0)
            engine.add_request(f"r{i}", ids, params)
            out[f"r{i}"] = []
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        step += 1
    return out


def chain_engine(session, folder, artifact, k: int) -> Engine:
    config = parse_speculative_config({"model": str(folder), "num_speculative_tokens": k, "own_caches": True})
    engine = Engine(session, EngineConfig(speculative=config.resolved(str(artifact), str(folder))))
    assert engine.lone_chain is not None
    return engine


def idle(engine: Engine) -> bool:
    return engine.kv.in_sync() and engine.kv_usage() == 0.0 and engine._alone is None \
        and not engine.scheduler.has_work()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(st.tuples(st.integers(0, 12), st.lists(st.integers(1, 400), min_size=1, max_size=20),
                                   st.integers(1, 20)), min_size=1, max_size=3),
       k=st.integers(1, 7), own=st.booleans())
def test_requests_alone_speculate_on_both_caches_and_keep_the_engine_s_tokens(chain_session, chain_artifact,
                                                                               tiny_model_dir, other_draft_build,
                                                                               requests, k, own):
    """Requests arriving at any step: while one is alone it runs over both caches, when another
    comes it rejoins the scheduler (recomputed), and every request's tokens are the engine's
    greedy tokens without speculation; the paged cache ends idle."""
    arrivals = [(at, ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for at, ids, n in requests]
    baseline = drive(Engine(chain_session, EngineConfig()), arrivals)
    folder, artifact = (tiny_model_dir, chain_artifact) if own else other_draft_build
    engine = chain_engine(chain_session, folder, artifact, k)
    assert drive(engine, arrivals) == baseline
    assert idle(engine)
    if len(requests) == 1:
        assert engine.stats()["lone_chain_rounds"] > 0


def test_a_request_alone_leaves_the_scheduler_and_rejoins_it_when_another_arrives(chain_session, chain_artifact,
                                                                                  tiny_model_dir):
    prompts = [chain_session.tokenizer.encode(p) for p in PROMPTS[:2]]
    long, short = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 6))
    baseline = drive(Engine(chain_session, EngineConfig()), [(0, prompts[0], long), (3, prompts[1], short)])
    engine = chain_engine(chain_session, tiny_model_dir, chain_artifact, 4)
    got = {"r0": [], "r1": []}

    def step() -> None:
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)

    a = engine.add_request("r0", prompts[0], long)
    step()
    assert got["r0"] == baseline["r0"][:1]  # the first round: the prompt, the first token alone
    step()
    step()
    assert engine._alone is a and a not in engine.scheduler.running and a.seq_id is None
    s = engine.stats()
    assert s["lone_chain_rounds"] == 3 and s["num_running"] == 1 and s["spec_num_accepted_tokens"] == 8
    assert len(got["r0"]) == 1 + 2 * 5  # its own drafts: every one kept
    engine.add_request("r1", prompts[1], short)
    step()  # both through the scheduler: r0 recomputed beside r1's prompt
    assert engine._alone is None and a in engine.scheduler.running
    assert engine.stats()["lone_chain_rounds"] == 3
    while "r1" in engine.requests:
        step()
    rounds = engine.stats()["lone_chain_rounds"]
    step()  # alone again
    assert engine._alone is a and engine.stats()["lone_chain_rounds"] == rounds + 1
    while engine.has_unfinished():
        step()
    assert got == baseline and idle(engine)


@pytest.mark.parametrize("own, on_cpu", [(None, False), ("auto", False), (True, True), (False, False)])
def test_own_caches_are_used_on_a_gpu_by_default_and_on_the_cpu_when_asked(chain_session, chain_artifact,
                                                                         tiny_model_dir, own, on_cpu):
    """On the CPU the engine's way measured faster (docs/BENCHMARKS.md), so auto leaves the caches
    alone there; "own_caches" in --speculative-config decides either way."""
    from vtool.runtime.engine.spec_config import uses_own_caches

    raw = {"model": str(tiny_model_dir), "num_speculative_tokens": 4}
    if own is not None:
        raw["own_caches"] = own
    config = parse_speculative_config(raw)
    engine = Engine(chain_session, EngineConfig(speculative=config.resolved(str(chain_artifact), str(tiny_model_dir))))
    assert (engine.lone_chain is not None) == (engine.speculator.proposer.chain is not None) == on_cpu
    gpu = type("GpuModel", (), {"on_gpu": True})()
    assert uses_own_caches(config, gpu) == (own is not False)


@pytest.mark.parametrize("raw, says", [
    ({"own_caches": "yes"}, "own_caches must be true, false or \"auto\""),
    ({"own_caches": 1}, "own_caches must be"),
    ({"method": "ngram", "own_caches": True, "model": None}, "own_caches belongs to a draft model"),
])
def test_a_bad_own_caches_key_is_refused_by_name(raw, says):
    base = {"model": "d", "num_speculative_tokens": 2}
    with pytest.raises(VtoolError, match=says.replace("(", r"\(")):
        parse_speculative_config({k: v for k, v in {**base, **raw}.items() if v is not None})


def test_a_request_that_outgrows_the_caches_finishes_the_engine_s_way(chain_session, chain_artifact, tiny_model_dir):
    """A prompt of 70 tokens and 40 more: past the caches' 96 positions the request goes back to
    the scheduler (recomputed into the paged cache) and ends with the tokens it would have had."""
    ids = [int(t) for t in np.random.default_rng(4).integers(1, 400, size=70)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = drive(Engine(chain_session, EngineConfig()), [(0, ids, params)])
    engine = chain_engine(chain_session, tiny_model_dir, chain_artifact, 4)
    engine.add_request("r0", ids, params)
    got, held = [], []
    while engine.has_unfinished():
        for o in engine.step():
            got.extend(o.new_token_ids)
        held.append(engine._alone is not None)
    assert got == want["r0"] and idle(engine)
    assert held[0] and not held[-1] and engine.stats()["lone_chain_rounds"] > 1


@pytest.mark.parametrize("params, rounds", [
    (SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True), 0),
    (SamplingParams(temperature=0, logprobs=2, max_tokens=8, ignore_eos=True), 0),
    (SamplingParams(temperature=0, presence_penalty=0.5, max_tokens=8, ignore_eos=True), 0),
    (SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=8, ignore_eos=True), 0),
    (SamplingParams(temperature=0, max_tokens=12, min_tokens=4), 1),  # rounds once 4 tokens are out
])
def test_requests_that_read_or_edit_the_rows_take_the_engine_s_way(chain_session, chain_artifact, tiny_model_dir,
                                                                   params, rounds):
    engine = chain_engine(chain_session, tiny_model_dir, chain_artifact, 4)
    ids = chain_session.tokenizer.encode(PROMPTS[0])
    engine.add_request("r0", ids, params)
    while engine.has_unfinished():
        engine.step()
    assert (engine.stats()["lone_chain_rounds"] > 0) == bool(rounds) and idle(engine)


def test_an_aborted_or_stopped_lone_request_ends_cleanly_and_the_next_reuses_the_caches(chain_session,
                                                                                        chain_artifact,
                                                                                        tiny_model_dir):
    """An abort mid-way frees everything; a stop string (found by the text stage after a round
    that overshot it) ends the text where the engine without speculation ends it; a later request
    sharing the prompt starts from what the two caches still hold."""
    ids = chain_session.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = Engine(chain_session, EngineConfig())
    want = drive(plain, [(0, ids, params)])["r0"]
    text = chain_session.tokenizer.decode(want)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    engine = chain_engine(chain_session, tiny_model_dir, chain_artifact, 4)
    engine.add_request("a", ids, params)
    engine.step()
    engine.step()
    assert engine.abort("a") and not engine.has_unfinished() and idle(engine)
    verifier = engine.lone_chain.verifier
    assert verifier.tokens[:len(ids)] == ids and verifier.owner is None  # kept for the next request

    def finished_text(e: Engine) -> tuple[str, str | None]:
        e.add_request("s", ids, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
        out, reason = "", None
        while e.has_unfinished():
            for o in e.step():
                out += o.new_text
                reason = o.finish_reason or reason
        return out, reason

    assert finished_text(engine) == finished_text(plain)
    assert engine.stats()["lone_chain_rounds"] > 2 and idle(engine)
    assert drive(engine, [(0, ids, params)])["r0"] == want


@pytest.fixture(scope="module")
def chain_server(chain_artifact, tiny_model_dir, tmp_path_factory):
    """`vtool serve` of the tiny library built with the cache, itself as the draft (prebuilt)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_engine_core import Server

    spec = {"model": str(tiny_model_dir), "artifact": str(chain_artifact), "num_speculative_tokens": 4,
            "own_caches": True}
    s = Server(tiny_model_dir, tmp_path_factory.mktemp("chainserve") / "server.log", "--artifact",
               str(chain_artifact), "--speculative-config", json.dumps(spec))
    yield s
    s.stop()


def test_a_server_runs_a_lone_greedy_request_on_both_caches_and_two_at_once_as_without(chain_server, chain_session):
    """Through the openai client: one request at a time goes over the two caches (counted in
    vtool:spec_decode_own_cache_rounds), two at once share the engine's steps; every text is the
    engine's without speculation, streamed or not, and the paged cache ends idle."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from test_engine_core import MODEL

    prompts = [chain_session.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = drive(Engine(chain_session, EngineConfig()), [(0, ids, params) for ids in prompts])
    texts = [chain_session.tokenizer.decode(want[f"r{i}"]) for i in range(len(prompts))]
    client = openai.OpenAI(base_url=f"{chain_server.url}/v1", api_key="x", max_retries=0)

    def complete(i: int, stream: bool = False) -> str:
        done = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=24, temperature=0, stream=stream,
                                         extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in done if c.choices) if stream else done.choices[0].text

    assert [complete(i) for i in range(len(prompts))] == texts
    assert complete(0, stream=True) == texts[0]
    rounds = chain_server.metric("vtool:spec_decode_own_cache_rounds_total")
    assert rounds > 0
    assert chain_server.metric("vllm:spec_decode_num_accepted_tokens_total") == \
        chain_server.metric("vllm:spec_decode_num_draft_tokens_total") > 0
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(complete, [0, 1, 0, 1])) == [texts[0], texts[1], texts[0], texts[1]]
    assert chain_server.metric("vllm:kv_cache_usage_perc") == 0.0
    assert chain_server.metric("vllm:num_requests_running") == 0


@pytest.mark.parametrize("variant", ["q4_k", "q4_1"])
def test_a_library_keeping_gguf_blocks_speculates_on_its_caches_as_its_decode(variant, tmp_path):
    """What a GGUF pair gets by default (a CUDA bf16 build keeps Q4_K/Q6_K or Q4_1/Q8_0 files in
    their blocks): draft_extend, draft_step and chain_verify over quantized matmuls, here on the
    CPU's kernels, give the library's own greedy decode, its drafts all kept."""
    from quant_gguf import VARIANTS, write_tiny_gguf

    from vtool.runtime.artifact.library import CompiledModel
    from vtool.toolchain.build import build_artifact

    qtype_of, tie, kept, shape = VARIANTS[variant]
    path = write_tiny_gguf(tmp_path / "m.gguf", qtype_of, tie=tie, shape=shape)
    ckpt = open_checkpoint(path)
    artifact = build_artifact(path, "host", "float32", checkpoint=ckpt, quantization="gguf", draft_cache_len=CACHE_LEN)
    model = CompiledModel(artifact, ckpt)
    assert model.manifest["quantization"] == "gguf" and has_chain_verify(model)
    gen = Generator(model, 256)
    prompt = [1, 17, 42, 99, 7, 3, 250, 11, 64, 5, 200, 31]
    for k in (1, 4, 7):
        expected = list(gen.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)).token_ids)
        tokens, stats = chain_generate(ChainVerifier(model), DraftChain(model), list(prompt), 20, k)
        assert tokens == expected, k
        assert stats["accepted"] == stats["drafted"] > 0


# -- a greedy request alone decoding on the library's own cache (runtime/engine/lone_decode.py) ------

def lone_engine(session, steps: int = 8) -> Engine:
    engine = Engine(session, EngineConfig(lone_decode=True, lone_decode_steps=steps))
    assert isinstance(engine.lone_chain, LoneDecode)
    return engine


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(st.tuples(st.integers(0, 12), st.lists(st.integers(1, 400), min_size=1, max_size=20),
                                   st.integers(1, 30)), min_size=1, max_size=3),
       steps=st.integers(1, 23))
def test_requests_alone_decode_on_the_own_cache_and_keep_the_engine_s_tokens(chain_session, requests, steps):
    """Requests arriving at any step: while one is alone its rounds run on the library's own
    cache, when another comes it rejoins the scheduler (recomputed), and every request's tokens
    are the engine's greedy tokens through the paged cache; the paged cache ends idle."""
    arrivals = [(at, ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for at, ids, n in requests]
    baseline = drive(Engine(chain_session, EngineConfig()), arrivals)
    engine = lone_engine(chain_session, steps)
    assert drive(engine, arrivals) == baseline
    assert idle(engine) and engine.lone_chain.chain.owner is None
    if len(requests) == 1:
        assert engine.stats()["lone_decode_rounds"] > 0 and engine.stats()["lone_chain_rounds"] == 0


def test_a_lone_round_gives_the_first_token_alone_then_steps_tokens_a_round(chain_session):
    ids = chain_session.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    baseline = drive(Engine(chain_session, EngineConfig()), [(0, ids, params)])["r0"]
    engine = lone_engine(chain_session, steps=6)
    engine.add_request("r0", ids, params)
    sizes = []
    while engine.has_unfinished():
        sizes.append(sum(len(o.new_token_ids) for o in engine.step()))
    assert sizes == [1, 6, 6, 6, 1]  # the last round is cut to the 20 tokens asked for
    assert engine.stats()["lone_decode_rounds"] == 5


def test_a_stop_token_inside_a_round_ends_the_request_there(chain_session):
    """A round's steps run past a stop token; the request still ends on it, as through the
    paged cache, and the next request starts from what the cache truly holds."""
    ids = chain_session.tokenizer.encode(PROMPTS[1])
    free = drive(Engine(chain_session, EngineConfig()),
                 [(0, ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))])["r0"]
    stop = free[5]
    cut = free[:free.index(stop) + 1]
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop])
    engine = lone_engine(chain_session, steps=8)
    assert drive(engine, [(0, ids, params)]) == {"r0": cut}
    assert drive(engine, [(0, ids + cut, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))]) == \
        drive(Engine(chain_session, EngineConfig()),
              [(0, ids + cut, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))])


def test_requests_the_argmax_cannot_serve_take_the_engine_s_way(chain_session):
    ids = chain_session.tokenizer.encode(PROMPTS[2])
    engine = lone_engine(chain_session)
    for params in (SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
                   SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3)):
        want = drive(Engine(chain_session, EngineConfig()), [(0, ids, params)])
        assert drive(engine, [(0, ids, params)]) == want
    assert engine.stats()["lone_decode_rounds"] == 0


def test_lone_decode_is_asked_for_and_needs_the_own_cache(chain_session, tiny_session):
    assert Engine(chain_session, EngineConfig()).lone_chain is None  # off unless asked
    assert Engine(tiny_session, EngineConfig()).lone_chain is None  # no own cache: nothing to say
    with pytest.raises(VtoolError, match="--draft-cache-len"):
        Engine(tiny_session, EngineConfig(lone_decode=True))


@pytest.fixture(scope="module")
def lone_server(chain_artifact, tiny_model_dir, tmp_path_factory):
    """`vtool serve --lone-decode` of the tiny library built with the cache (on the CPU: asked)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_engine_core import Server

    s = Server(tiny_model_dir, tmp_path_factory.mktemp("loneserve") / "server.log", "--artifact",
               str(chain_artifact), "--lone-decode", "--lone-decode-steps", "5")
    yield s
    s.stop()


def test_a_server_decodes_a_lone_greedy_request_on_the_own_cache_as_the_paged_one(lone_server, chain_session):
    """Through the openai client: a greedy request alone decodes in rounds on the library's own
    cache (counted in vtool:lone_decode_rounds), streamed or not, a stop sequence inside a round
    ends the text where it should, two at once share the engine's steps, a sampled request takes
    the engine's way; every text is the engine's through the paged cache, which ends idle."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from test_engine_core import MODEL

    prompts = [chain_session.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = drive(Engine(chain_session, EngineConfig()), [(0, ids, params) for ids in prompts])
    texts = [chain_session.tokenizer.decode(want[f"r{i}"]) for i in range(len(prompts))]
    client = openai.OpenAI(base_url=f"{lone_server.url}/v1", api_key="x", max_retries=0)

    def complete(i: int, stream: bool = False, **kw) -> str:
        done = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=24, temperature=0, stream=stream,
                                         extra_body={"ignore_eos": True}, **kw)
        return "".join(c.choices[0].text for c in done if c.choices) if stream else done.choices[0].text

    assert [complete(i) for i in range(len(prompts))] == texts
    assert complete(0, stream=True) == texts[0]
    rounds = lone_server.metric("vtool:lone_decode_rounds_total")
    assert rounds >= 4 * 5  # four requests: a first token alone, then 23 tokens in rounds of at most 5
    stop = texts[1][len(texts[1]) // 2:][:3]
    assert complete(1, stop=[stop]) == texts[1][:texts[1].index(stop)]
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(complete, [0, 1, 0, 1])) == [texts[0], texts[1], texts[0], texts[1]]
    before = lone_server.metric("vtool:lone_decode_rounds_total")
    client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=8, temperature=0.9, seed=1)
    assert lone_server.metric("vtool:lone_decode_rounds_total") == before
    assert lone_server.metric("vllm:kv_cache_usage_perc") == 0.0
    assert lone_server.metric("vllm:num_requests_running") == 0


def test_a_server_asked_for_lone_decode_on_a_library_without_the_cache_refuses_to_start(tiny_model_dir,
                                                                                       tiny_artifact, tmp_path):
    """Not a silent default: the server exits at startup and its output names the missing option."""
    import subprocess
    import sys

    from test_engine_core import free_port

    done = subprocess.run([sys.executable, "-m", "vtool.toolchain.cli", "serve", "--model", str(tiny_model_dir),
                           "--artifact", str(tiny_artifact), "--port", str(free_port()), "--max-model-len", "256",
                           "--lone-decode"], capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    assert "--draft-cache-len" in done.stdout + done.stderr, done.stdout + done.stderr


def test_vtool_run_decodes_on_the_own_cache_when_asked(tiny_model_dir, chain_artifact, chain_session):
    """`vtool run --lone-decode` on a library with the cache: the paged engine's greedy text, and the
    run's report says how many rounds ran on the cache."""
    import subprocess
    import sys

    ids = chain_session.tokenizer.encode("The capital of France is")
    want = drive(Engine(chain_session, EngineConfig()),
                 [(0, ids, SamplingParams(temperature=0, max_tokens=20))])["r0"]  # as `run` asks
    done = subprocess.run([sys.executable, "-m", "vtool.toolchain.cli", "run", "--model", str(tiny_model_dir),
                           "--artifact", str(chain_artifact), "--max-tokens", "20", "--lone-decode", "--repeat", "2",
                           "--max-model-len", "256"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n") == chain_session.tokenizer.decode(want)
    assert "rounds on the library's own cache" in done.stderr, done.stderr


def test_a_request_outgrowing_the_own_cache_goes_on_through_the_paged_one(chain_session):
    """The cache holds CACHE_LEN positions: a request that grows past it mid-round is cut at the
    cache's end and rejoins the scheduler, which recomputes it and decodes the rest; the tokens
    are the paged engine's throughout."""
    rng = np.random.default_rng(11)
    ids = [int(t) for t in rng.integers(1, 400, CACHE_LEN - 20)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    baseline = drive(Engine(chain_session, EngineConfig()), [(0, ids, params)])
    engine = lone_engine(chain_session, steps=7)
    assert drive(engine, [(0, ids, params)]) == baseline
    assert engine.stats()["lone_decode_rounds"] >= 3 and idle(engine)
