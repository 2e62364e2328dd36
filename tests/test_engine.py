"""The continuous-batching engine on a tiny random Llama that carries SmolLM2's real
tokenizer: batching never changes greedy tokens, chunked prefill and preemption are
exact, prefix caching saves counted work, aborts free their blocks."""
from __future__ import annotations

import pytest

from vtool import VtoolError
from vtool.runtime.engine.engine import Engine, EngineConfig, RequestError
from vtool.runtime.sampling.params import SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hi",
    "In 1905 Einstein published four papers that changed physics: the photoelectric effect, Brownian motion, "
    "special relativity and the equivalence of mass and energy.",
    "def add(a, b):\n    return a + b\n",
    "Un deux trois, nous irons au bois.",
]


@pytest.fixture(scope="module")
def session(tiny_session):  # tests/conftest.py: the tiny chat model's host build, max_model_len 256
    return tiny_session


def run_all(engine: Engine, requests: list[tuple[str, list[int], SamplingParams]], priorities=None):
    for i, (rid, ids, params) in enumerate(requests):
        engine.add_request(rid, ids, params, priority=(priorities or {}).get(rid, 0))
    done: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    order: list[str] = []
    guard = 0
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id].extend(out.new_token_ids)
            if out.finished:
                order.append(out.request_id)
        guard += 1
        assert guard < 10_000, "the engine stopped making progress"
    assert engine.kv.in_sync(), "block mirror and TVM disagree"
    return done, order


def greedy(max_tokens=12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_batched_greedy_equals_alone(session):
    ids = [session.tokenizer.encode(p) for p in PROMPTS]
    alone = {}
    for i, prompt_ids in enumerate(ids):
        engine = Engine(session, EngineConfig(enable_prefix_caching=False))
        alone.update(run_all(engine, [(f"r{i}", prompt_ids, greedy())])[0])
    # small token budget: prompts are prefilled in chunks while others decode
    engine = Engine(session, EngineConfig(max_num_batched_tokens=16, enable_prefix_caching=False))
    batched, _ = run_all(engine, [(f"r{i}", p, greedy()) for i, p in enumerate(ids)])
    assert batched == alone
    assert all(len(v) == 12 for v in batched.values())


def test_preemption_recomputes_exactly(session):
    ids = [session.tokenizer.encode(p) for p in PROMPTS]
    reference, _ = run_all(Engine(session, EngineConfig(enable_prefix_caching=False)),
                           [(f"r{i}", p, greedy(40)) for i, p in enumerate(ids)])
    # 8 blocks of 16 tokens cannot hold five growing sequences: some must be preempted.
    engine = Engine(session, EngineConfig(num_blocks=8, max_model_len=128, enable_prefix_caching=False))
    tight, _ = run_all(engine, [(f"r{i}", p, greedy(40)) for i, p in enumerate(ids)])
    assert engine.scheduler.num_preemptions > 0
    assert tight == reference


def test_prefix_caching_saves_counted_prefill_work(session):
    shared = session.tokenizer.encode(PROMPTS[2] * 3)
    a, b = shared + session.tokenizer.encode(" First."), shared + session.tokenizer.encode(" Second!")
    cold = Engine(session, EngineConfig(enable_prefix_caching=False))
    want, _ = run_all(cold, [("a", a, greedy())])
    want_b, _ = run_all(cold, [("b", b, greedy())])
    warm = Engine(session, EngineConfig(enable_prefix_caching=True))
    got, _ = run_all(warm, [("a", a, greedy())])
    before = warm.counters.computed_prefill_tokens
    got_b, _ = run_all(warm, [("b", b, greedy())])
    computed_b = warm.counters.computed_prefill_tokens - before
    assert got == want and got_b == want_b
    full_blocks = (len(shared) // 16) * 16
    assert computed_b == len(b) - full_blocks, (computed_b, len(b), full_blocks)
    assert warm.prefix_cache.hits >= full_blocks
    # vLLM's prompt tokens by source: b's shared blocks came from the cache
    c = warm.counters
    assert (c.prompt_tokens_computed, c.prompt_tokens_cached, c.prompt_tokens_recomputed) == (
        len(a) + len(b) - full_blocks, full_blocks, 0)
    assert c.prompt_tokens_cache_hit == full_blocks


def test_prompt_tokens_by_source_as_vllm_counts_them(session):
    """A prompt met again whole: the cache hands out all but its last token, which vLLM counts
    as a cache hit recomputed; the invariant computed + hits - recomputed = prompt tokens holds,
    and each finished request's prefill_kv_computed is its prompt less its cached tokens."""
    from prometheus_client.parser import text_string_to_metric_families

    from vtool.runtime.serving.metrics import ServerMetrics

    ids = session.tokenizer.encode(PROMPTS[2] * 3)[:48]  # three whole blocks
    engine = Engine(session, EngineConfig(enable_prefix_caching=True))
    engine.observer = ServerMetrics("m", max_model_len=256)
    run_all(engine, [("first", ids, greedy(4))])
    run_all(engine, [("again", ids, greedy(4))])
    c = engine.counters
    assert (c.prompt_tokens_computed, c.prompt_tokens_cached, c.prompt_tokens_recomputed) == (48 + 1, 47, 1)
    assert c.prompt_tokens_cache_hit == 48
    assert c.prompt_tokens_computed + c.prompt_tokens_cache_hit - c.prompt_tokens_recomputed == c.prompt_tokens
    engine.observer.update_from_engine(engine.stats())
    families = {f.name: f for f in text_string_to_metric_families(engine.observer.render().decode())}
    by_source = {s.labels["source"]: s.value for s in families["vllm:prompt_tokens_by_source"].samples
                 if s.name.endswith("_total")}
    assert by_source == {"local_compute": 49, "local_cache_hit": 48, "external_kv_transfer": 0}
    kv = {s.name: s.value for s in families["vllm:request_prefill_kv_computed_tokens"].samples}
    assert (kv["vllm:request_prefill_kv_computed_tokens_count"],
            kv["vllm:request_prefill_kv_computed_tokens_sum"]) == (2, 48 + 1)


def test_abort_frees_blocks_at_once(session):
    engine = Engine(session, EngineConfig())
    idle = engine.kv_usage()
    engine.add_request("x", session.tokenizer.encode(PROMPTS[2]), greedy(100))
    for _ in range(5):
        engine.step()
    assert engine.kv_usage() > idle
    assert engine.abort("x")
    assert engine.kv_usage() == idle
    assert not engine.has_unfinished()
    assert engine.kv.in_sync()


def test_seeded_sampling_is_reproducible_whatever_the_batch(session):
    ids = [session.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    alone, _ = run_all(Engine(session), [("s", ids[0], params)])
    mixed, _ = run_all(Engine(session, EngineConfig(max_num_batched_tokens=8)),
                       [("s", ids[0], params)] + [(f"o{i}", p, SamplingParams(temperature=1.0, max_tokens=7))
                                                  for i, p in enumerate(ids[1:])])
    assert mixed["s"] == alone["s"]


def test_priority_policy_runs_urgent_requests_first(session):
    ids = session.tokenizer.encode(PROMPTS[0])
    engine = Engine(session, EngineConfig(max_num_seqs=1, scheduling_policy="priority"))
    _, order = run_all(engine, [("late", ids, greedy(3)), ("urgent", ids, greedy(3))],
                       priorities={"late": 5, "urgent": -1})
    assert order == ["urgent", "late"]
    engine = Engine(session, EngineConfig(max_num_seqs=1, scheduling_policy="fcfs"))
    _, order = run_all(engine, [("late", ids, greedy(3)), ("urgent", ids, greedy(3))],
                       priorities={"late": 5, "urgent": -1})
    assert order == ["late", "urgent"]


def test_unset_max_tokens_runs_to_the_context(session):
    ids = session.tokenizer.encode(PROMPTS[0])
    engine = Engine(session)
    done, _ = run_all(engine, [("r", ids, greedy(None))])
    assert len(done["r"]) == session.max_model_len - len(ids)
    ceiling = Engine(session, EngineConfig(max_new_tokens_ceiling=5))
    done, _ = run_all(ceiling, [("r", ids, greedy(-1))])
    assert len(done["r"]) == 5


def test_stop_strings_cut_the_text(session):
    ids = session.tokenizer.encode(PROMPTS[1])
    engine = Engine(session)
    engine.add_request("full", ids, greedy(20))
    text = ""
    while engine.has_unfinished():
        text += "".join(o.new_text for o in engine.step())
    stop = text[len(text) // 2: len(text) // 2 + 3]
    engine.add_request("cut", ids, greedy(20, stop=[stop]))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    cut_text = "".join(o.new_text for o in outs)
    assert cut_text == text[: text.index(stop)]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop


def test_a_cache_smaller_than_an_explicit_context_is_refused_else_fitted(session):
    with pytest.raises(VtoolError, match=r"KV cache holds 1[0-9]{2} tokens \(\d+ blocks of 16\), less than max_model_len=256"):
        Engine(session, EngineConfig(num_blocks=8, max_model_len=256))
    fitted = Engine(session, EngineConfig(num_blocks=8))
    assert fitted.max_model_len == fitted.kv.blocks.num_blocks * 16 < 256


def test_refusals_name_the_lengths(session):
    engine = Engine(session)
    long_prompt = list(range(10, 10 + session.max_model_len))
    with pytest.raises(RequestError, match=f"prompt has {session.max_model_len} tokens, at or past max_model_len=256"):
        engine.add_request("a", long_prompt, greedy())
    with pytest.raises(RequestError, match="maximum context length is 256 tokens.*asks for 310"):
        engine.add_request("b", list(range(10, 20)), greedy(300))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request("c", [49152], greedy())


def test_prompt_logprobs_survive_a_warm_prefix_cache(session):
    """A prompt whose prefix is cached still gets logprobs for every prompt position."""
    from vtool.runtime.engine.engine import Engine

    ids = session.tokenizer.encode(PROMPTS[2] * 2)
    engine = Engine(session)
    run_all(engine, [("warm", ids, greedy(2))])  # leaves the prompt's blocks in the prefix cache
    engine.add_request("p", ids, greedy(2, prompt_logprobs=1))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    first = next(o for o in outs if o.prompt_logprobs is not None)
    assert len(first.prompt_logprobs) == len(ids) and first.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert ids[pos] in first.prompt_logprobs[pos]  # the actual prompt token is always reported


def test_decode_steps_through_batch_verify_give_decodes_tokens(session):
    """What a GPU library whose weights stay in blocks does past a few sequences
    (runtime/engine/block_decode.py): an all-decode step runs as batch_verify with one token
    per sequence. Here forced on the CPU build at every batched step: the same greedy tokens
    as each request alone, and the steps did go through batch_verify."""
    ids = [session.tokenizer.encode(p) for p in PROMPTS]
    alone = {}
    for i, prompt_ids in enumerate(ids):
        alone.update(run_all(Engine(session, EngineConfig(enable_prefix_caching=False)),
                             [(f"r{i}", prompt_ids, greedy())])[0])
    engine = Engine(session, EngineConfig(enable_prefix_caching=False))
    engine.runner.block_gemv_rows = 1
    entries: list[str] = []
    real = engine.runner._multi_token_entry

    def recorded(step, num_rows):  # noqa: ANN001, ANN202 - the real method, its answers kept
        entry = real(step, num_rows)
        entries.append(entry if not step.all_decode else f"decode:{entry}")
        return entry

    engine.runner._multi_token_entry = recorded
    batched, _ = run_all(engine, [(f"r{i}", p, greedy()) for i, p in enumerate(ids)])
    assert batched == alone
    assert entries.count("decode:batch_verify") >= 10  # 3 sequences decoding together for 11 steps
