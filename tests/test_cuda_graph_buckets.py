"""Batched decode from CUDA graphs at padded batch sizes (--cuda-graph-sizes;
runtime/engine/decode_buckets.py, toolchain/pipeline.py's capture pass).

Here (any machine): the bucket choice and the padding plan (hypothesis over batch sizes,
bucket lists and free pages); the padding protocol against a block-mirror stand-in for the
KV cache, and against TVM's real paged KV cache with the host build of the tiny chat model
(its uncaptured batch_decode run at the padded size: the real rows' logits must not change);
the --cuda-graph-sizes option as the BuildPlan resolves it; and the captured entry the CUDA
pipeline adds (the Relax module after the pipeline, no nvcc needed).

On a GPU (marker `gpu`): a CUDA build's captured, padded batch_decode against its uncaptured
batch_decode on the same steps (same logits within float32/bfloat16 tolerance, same greedy
tokens), with sequences joining, forking and leaving between steps so the batch crosses
bucket boundaries and goes past the largest. Artifacts come from VTOOL_CUDA_GRAPH_ARTIFACTS
(a folder tests/bench/decode_graphs.py prebuild writes where the compiler is), or are built
here when apache-tvm and nvcc are installed.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtool import VtoolError
from vtool.runtime.engine import decode_buckets as db
from vtool.runtime.engine.kv_blocks import KVBlockManager
from vtool.runtime.engine.step_types import ScheduledSequence, SchedulerOutput

ARTIFACTS_ENV = "VTOOL_CUDA_GRAPH_ARTIFACTS"
SIZES = st.lists(st.integers(1, 300), min_size=1, max_size=12).map(lambda s: tuple(sorted(set(s))))


# --- the bucket choice and the padding plan -----------------------------------------------------

@settings(max_examples=400, deadline=None)
@given(built=SIZES, max_batch=st.integers(1, 400))
def test_usable_sizes_stay_within_the_build_and_the_kv_cache(built, max_batch):
    sizes = db.usable_sizes(built, max_batch)
    assert list(sizes) == sorted(set(sizes))
    assert all(2 <= s <= max_batch and s <= max(built) for s in sizes)  # TVM sizes a step's arrays by max_batch
    assert {s for s in built if 2 <= s <= max_batch} <= set(sizes)  # every built size that fits is kept
    added = set(sizes) - set(built)
    assert added <= {max_batch} and (not added or max_batch < max(built))
    if 2 <= max_batch < max(built):  # a batch up to the KV cache's limit always has a size
        assert sizes and sizes[-1] == max_batch


@settings(max_examples=600, deadline=None)
@given(n=st.integers(0, 400), built=SIZES, max_batch=st.integers(1, 400), free=st.integers(0, 400))
def test_a_step_pads_to_the_smallest_size_that_holds_it(n, built, max_batch, free):
    sizes = db.usable_sizes(built, max_batch)
    plan = db.plan_padding(n, sizes, free)
    fits = [s for s in sizes if s >= n]
    if n < 2 or not fits or fits[0] - n > free:
        assert plan is None  # one sequence runs `decode`; past the largest or short of pages: uncaptured
        return
    assert plan is not None and plan.rows == n and plan.size == fits[0] <= max_batch
    assert len(plan.pad_ids) == plan.pages == plan.size - n <= free
    assert len(set(plan.pad_ids)) == len(plan.pad_ids)
    assert all(p <= db.PAD_SEQ_BASE < -(1 << 32) for p in plan.pad_ids)  # never a scheduler's (non-negative) id


def test_pick_size_examples():
    sizes = (2, 4, 8, 16, 24, 32)
    assert [db.pick_size(n, sizes) for n in (1, 2, 3, 5, 9, 17, 25, 32, 33)] == [2, 2, 4, 8, 16, 24, 32, 32, None]
    assert db.usable_sizes((1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128), 40) == (2, 4, 8, 16, 24, 32, 40)
    assert db.usable_sizes((1, 2, 4, 8), 256) == (2, 4, 8)
    assert db.usable_sizes((1,), 16) == () and db.usable_sizes((), 16) == ()


def test_the_entry_point_name_is_the_toolchains():
    from vtool.toolchain.families import CAPTURED_BATCH_DECODE, CAPTURED_BATCH_VERIFY

    assert db.CAPTURED_ENTRY == CAPTURED_BATCH_DECODE
    assert db.CAPTURED_VERIFY_ENTRY == CAPTURED_BATCH_VERIFY


# --- the padding protocol against a stand-in KV cache --------------------------------------------

class FakeKV:
    """The calls DecodeBuckets makes on runtime/engine/kv_cache.PagedKVCache, over the real
    block mirror, with the order of calls checked."""

    def __init__(self, num_blocks: int, max_num_seqs: int):
        self.blocks = KVBlockManager(num_blocks, 16)
        self.max_num_seqs = max_num_seqs
        self.in_forward: list[int] | None = None
        self.log: list[tuple[str, Any]] = []
        self.tvm = "kv-handle"

    def add(self, seq_id: int) -> None:
        assert self.in_forward is None
        self.blocks.add(seq_id)
        self.log.append(("add", seq_id))

    def remove(self, seq_id: int) -> None:
        assert self.in_forward is None, "a sequence removed inside a forward"
        self.blocks.remove(seq_id)
        self.log.append(("remove", seq_id))

    def begin_forward(self, seq_ids, lengths, queued_early: bool = False) -> None:
        assert self.in_forward is None and len(seq_ids) == len(set(seq_ids)) <= self.max_num_seqs
        for s, n in zip(seq_ids, lengths):
            self.blocks.append(s, n)
        self.in_forward = list(seq_ids)
        self.log.append(("begin", (tuple(seq_ids), tuple(lengths))))

    def end_forward(self) -> None:
        assert self.in_forward is not None
        self.in_forward = None
        self.log.append(("end", None))


class FakeModel:
    hidden_size, vocab_size, dtype = 8, 32, "float32"
    params = "params"

    class ffi:  # noqa: N801 - stands in for the tvm_ffi module
        Shape = tuple

    def __init__(self, fail: bool = False):
        self.calls: list[tuple[str, Any]] = []
        self.fail = fail

    def upload(self, array, dtype=None, slot=None):  # noqa: ANN001, ANN201
        return np.array(array)

    def function(self, name: str):  # noqa: ANN201
        def call(*args):  # noqa: ANN002, ANN202
            self.calls.append((name, args))
            if name == "embed":
                return ("embeds", args[0])
            if self.fail:
                raise RuntimeError("the device call failed")
            return ("logits", args[0][2][0]), args[1]
        return call


def _view(base, shape, dtype, offset):  # noqa: ANN001, ANN202
    assert offset == 0
    return ("view", base, tuple(shape), dtype)


def _decode_step(seqs: list[int], tokens: dict[int, int]) -> SchedulerOutput:
    return SchedulerOutput(tuple(ScheduledSequence(f"r{s}", s, (tokens[s],), 5, 1, False) for s in seqs))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), built=SIZES, max_batch=st.integers(2, 40), num_blocks=st.integers(4, 120))
def test_padding_leaves_the_kv_state_as_the_unpadded_step_would(data, built, max_batch, num_blocks):
    kv, ref = FakeKV(num_blocks, max_batch), KVBlockManager(num_blocks, 16)
    model = FakeModel()
    buckets = db.DecodeBuckets(model, kv, db.usable_sizes(built, max_batch), entry="batch_decode",
                               create_view=_view)
    live: list[int] = []
    next_id = 0
    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        # sequences join (with a prompt already in the cache) and leave between steps
        joins = data.draw(st.integers(0, max_batch - len(live)), label="joins")
        for _ in range(joins):
            prompt = data.draw(st.integers(1, 40), label="prompt")
            if -(-prompt // 16) > ref.num_free_blocks - 2:
                break
            for mirror in (kv.blocks, ref):
                mirror.add(next_id)
                mirror.append(next_id, prompt)
            live.append(next_id)
            next_id += 1
        for s in data.draw(st.lists(st.sampled_from(live), unique=True), label="leaves") if live else []:
            live.remove(s)
            kv.blocks.remove(s)
            ref.remove(s)
        if not live or sum(ref.blocks_needed(s, 1) for s in live) > ref.num_free_blocks:
            continue
        order = data.draw(st.permutations(live), label="batch order")
        tokens = {s: data.draw(st.integers(0, 31), label="token") for s in order}
        free_after = ref.num_free_blocks - sum(ref.blocks_needed(s, 1) for s in order)
        expected = db.plan_padding(len(order), buckets.sizes, free_after)
        kv.log.clear()
        model.calls.clear()
        out = buckets.forward(_decode_step(order, tokens))
        if expected is None:  # nothing done: the runner runs the step unpadded (its appends, mirrored here)
            assert out is None and not kv.log and not model.calls
            for s in order:
                kv.blocks.append(s, 1)
        else:
            pads = list(expected.pad_ids)
            assert out == ("view", ("logits", expected.size), (len(order), 1, model.vocab_size), "float32")
            assert [c for c, _ in kv.log] == ["add"] * len(pads) + ["begin", "end"] + ["remove"] * len(pads)
            assert kv.log[len(pads)][1] == (tuple(order) + tuple(pads), (1,) * expected.size)
            embed, entry = model.calls
            assert embed[1][0].tolist() == [tokens[s] for s in order] + [db.PAD_TOKEN] * len(pads)
            assert entry[0] == "batch_decode" and entry[1][0][2] == (expected.size, 1, model.hidden_size)
        for s in order:  # what the unpadded step appends
            ref.append(s, 1)
        # the KV state is the unpadded step's: same sequences, lengths and free pages
        assert sorted(kv.blocks.sequences()) == sorted(ref.sequences())
        assert {s: kv.blocks.length(s) for s in live} == {s: ref.length(s) for s in live}
        assert kv.blocks.num_free_blocks == ref.num_free_blocks


def test_a_failing_device_call_still_ends_the_forward_and_removes_the_pad_rows():
    kv, model = FakeKV(64, 16), FakeModel(fail=True)
    buckets = db.DecodeBuckets(model, kv, (2, 4, 8), entry="batch_decode", create_view=_view)
    for s in range(3):
        kv.blocks.add(s)
        kv.blocks.append(s, 7)
    with pytest.raises(RuntimeError, match="device call failed"):
        buckets.forward(_decode_step([0, 1, 2], {0: 1, 1: 2, 2: 3}))
    assert kv.in_forward is None and sorted(kv.blocks.sequences()) == [0, 1, 2]
    assert [c for c, _ in kv.log][-2:] == ["end", "remove"]


def test_only_libraries_with_the_captured_entry_pad(monkeypatch):
    kv = FakeKV(64, 40)

    class Loaded(FakeModel):
        def __init__(self, manifest):  # noqa: ANN001
            super().__init__()
            self.manifest = manifest

    graphs = {"entry": db.CAPTURED_ENTRY, "sizes": [1, 2, 4, 8, 16, 24, 32, 48, 64], "max_batch": 64}
    cuda = {"entry_points": ["embed", "batch_decode", db.CAPTURED_ENTRY],
            "build": {"pipeline": {"cuda_graph_batch": graphs}}}
    monkeypatch.setattr(db, "global_func", lambda name: _view)
    assert db.DecodeBuckets.for_model(Loaded(cuda), kv).sizes == (2, 4, 8, 16, 24, 32, 40)
    assert db.DecodeBuckets.for_model(Loaded({"entry_points": ["embed", "batch_decode"], "build": {}}), kv) is None
    assert db.DecodeBuckets.for_model(FakeModel(), kv) is None  # no manifest at all
    monkeypatch.setenv(db.ENFORCE_EAGER_ENV, "1")
    assert db.DecodeBuckets.for_model(Loaded(cuda), kv) is None


# --- the padding protocol on TVM's paged KV cache (host build: its batch_decode, padded) ---------

@dataclasses.dataclass
class Harness:
    """One model runner with its own KV cache, driven by hand (prefill, fork, decode, leave)."""

    model: Any
    kv: Any
    runner: Any
    tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # seq -> its tokens so far

    @classmethod
    def make(cls, model, num_blocks: int, max_num_seqs: int, buckets: Any = "off",  # noqa: ANN001
             device_sampling: bool = False) -> "Harness":
        from vtool.runtime.engine.kv_cache import PagedKVCache
        from vtool.runtime.engine.runner import ModelRunner

        kv = PagedKVCache(model, num_blocks, 16, max_num_seqs, 256)
        runner = ModelRunner(model, kv, device_sampling=device_sampling)
        if buckets == "off":
            runner.decode_buckets = None
        elif buckets != "library":  # a (sizes, entry) pair
            runner.decode_buckets = db.DecodeBuckets(model, kv, buckets[0], entry=buckets[1])
        return cls(model, kv, runner)

    def prefill(self, seq_id: int, prompt: list[int]) -> np.ndarray:
        self.kv.add(seq_id)
        self.tokens[seq_id] = list(prompt)
        step = SchedulerOutput((ScheduledSequence(f"r{seq_id}", seq_id, tuple(prompt), 0, 1, False,
                                                  return_logits=True),))
        return self.runner.execute(step).results[0].logits[-1]

    def fork(self, parent: int, child: int) -> None:
        self.kv.fork(parent, child, len(self.tokens[parent]))
        self.tokens[child] = list(self.tokens[parent])

    def leave(self, seq_id: int) -> None:
        self.kv.remove(seq_id)
        del self.tokens[seq_id]

    def decode(self, next_tokens: dict[int, int]) -> dict[int, np.ndarray]:
        order = list(next_tokens)
        step = SchedulerOutput(tuple(
            ScheduledSequence(f"r{s}", s, (next_tokens[s],), len(self.tokens[s]), 1, False, return_logits=True)
            for s in order))
        out = self.runner.execute(step)
        for s in order:
            self.tokens[s].append(next_tokens[s])
        return {s: r.logits[-1] for s, r in zip(order, out.results)}


# Batch sizes the scenario passes through with sizes (2, 4, 8, 16): 3 (pads to 4), 5 (8),
# 9 (16), 7 (8), 17 (past the largest: unpadded), 16 (exact), 2 (exact), 1 (`decode`).
def run_scenario(padded: Harness, eager: Harness, vocab: int, seed: int = 0) -> dict[str, Any]:
    """Drive both harnesses through the same steps, the eager one's greedy tokens fed to both
    (so one near-tie cannot make them drift apart); per decode step, the largest logit
    difference and whether the greedy tokens agree."""
    rng = np.random.default_rng(seed)
    report: dict[str, Any] = {"steps": [], "max_abs": 0.0, "token_mismatches": [], "min_gap_at_mismatch": None}
    pending: dict[int, int] = {}  # seq -> the token it feeds next
    next_id = [0]

    def join(count: int) -> None:
        for _ in range(count):
            s = next_id[0]
            next_id[0] += 1
            prompt = [int(t) for t in rng.integers(3, vocab, size=int(rng.integers(3, 40)))]
            a, b = padded.prefill(s, prompt), eager.prefill(s, prompt)
            report["max_abs"] = max(report["max_abs"], float(np.max(np.abs(a - b))))
            pending[s] = int(np.argmax(b))

    def fork(parent: int) -> None:
        s = next_id[0]
        next_id[0] += 1
        padded.fork(parent, s)
        eager.fork(parent, s)
        pending[s] = pending[parent]

    def leave(count: int) -> None:
        for s in list(pending)[:count]:
            padded.leave(s)
            eager.leave(s)
            del pending[s]

    def decode(times: int = 1) -> None:
        for _ in range(times):
            order = list(pending)
            rng.shuffle(order)
            feed = {s: pending[s] for s in order}
            a, b = padded.decode(feed), eager.decode(feed)
            step_max = 0.0
            for s in order:
                diff = float(np.max(np.abs(a[s] - b[s])))
                step_max = max(step_max, diff)
                top = np.sort(b[s])[-2:]
                if int(np.argmax(a[s])) != int(np.argmax(b[s])):
                    gap = float(top[1] - top[0])
                    report["token_mismatches"].append((len(order), s, gap))
                pending[s] = int(np.argmax(b[s]))
            report["steps"].append((len(order), round(step_max, 6)))
            report["max_abs"] = max(report["max_abs"], step_max)
            assert padded.kv.in_sync() and eager.kv.in_sync()
            assert not [s for s in padded.kv.blocks.sequences() if s < 0], "a pad row outlived its step"
            assert padded.kv.tvm_free_blocks() == eager.kv.tvm_free_blocks()

    join(3)
    decode(2)
    fork(0)  # shares the prompt's full pages (a cascade over two depths in TVM's decode)
    join(1)
    decode(2)
    join(4)
    decode(2)
    leave(2)
    decode()
    join(10)
    decode(2)
    leave(1)
    decode()
    leave(14)
    decode(2)
    leave(1)
    decode()
    return report


def test_padding_on_tvms_paged_kv_cache_leaves_the_real_rows_unchanged(tiny_session):
    """The host build's batch_decode run at the padded size (pad sequences added, appended,
    removed around it) against the same batch_decode at the step's own size."""
    model = tiny_session.model
    padded = Harness.make(model, 200, 32, ((2, 4, 8, 16), "batch_decode"))
    eager = Harness.make(model, 200, 32)
    calls: list[tuple[int, bool]] = []
    forward = padded.runner.decode_buckets.forward

    def counted(step, *rest):  # noqa: ANN001, ANN002, ANN202
        out = forward(step, *rest)
        calls.append((len(step.sequences), out is not None))
        return out

    padded.runner.decode_buckets.forward = counted
    report = run_scenario(padded, eager, model.vocab_size)
    print(f"\n[host] steps (batch, max |dlogit|): {report['steps']}")
    assert report["max_abs"] <= 1e-4, report
    assert not report["token_mismatches"], report
    sizes = [n for n, _ in report["steps"]]
    assert {3, 5, 9, 7, 17, 16, 2} <= set(sizes) and 1 in sizes
    padded_sizes = {n for n, ran in calls if ran}
    assert padded_sizes == {3, 5, 9, 7, 16, 2}  # 17: past the largest size; 1: `decode`


def test_a_kv_cache_without_pages_for_the_pad_rows_runs_unpadded(tiny_session):
    """3 rows of 15 tokens (their next token fits their page) pad to 8 only with 5 free pages."""
    model = tiny_session.model
    seen = set()
    for num_blocks in (6, 7, 8, 9):
        h = Harness.make(model, num_blocks, 8, ((2, 8), "batch_decode"))
        for s in range(3):
            h.prefill(s, [5 + s] * 15)
        free = h.kv.blocks.num_free_blocks
        plan = h.runner.decode_buckets.plan([0, 1, 2])
        assert (plan is None) == (free < 5), (num_blocks, free, plan)
        seen.add(plan is None)
        logits = h.decode({0: 9, 1: 10, 2: 11})  # either way the step runs and the KV state stays true
        assert len(logits) == 3 and h.kv.in_sync() and h.kv.blocks.num_free_blocks == free
    assert seen == {True, False}


# --- the build option and the pipeline --------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_shape_dir):
    from vtool.runtime.weights.checkpoint import open_checkpoint

    return open_checkpoint(tiny_shape_dir("llama-gqa"))


def test_cuda_graph_sizes_resolve_or_are_refused_by_name(tiny_checkpoint):
    from vtool.toolchain.families import CUDA
    from vtool.toolchain.plan import BuildOptions, resolve_plan

    def sizes(target: str, value: str) -> tuple[int, ...]:
        return resolve_plan(tiny_checkpoint, target, BuildOptions(cuda_graph_sizes=value), tools=False).cuda_graph_sizes

    assert sizes("sm_90a", "auto") == CUDA.graph_batch_sizes == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
    assert sizes("sm_90a", "none") == () and sizes("x86-avx2", "auto") == () and sizes("x86-avx2", "none") == ()
    assert sizes("sm_90a", " 16, 2,4,2 ") == (2, 4, 16)
    for bad in ("0", "-4", "two", "4,x", ",", "2000"):
        with pytest.raises(VtoolError, match="--cuda-graph-sizes"):
            sizes("sm_90a", bad)
    with pytest.raises(VtoolError, match="--cuda-graph-sizes '1,2'.*target 'x86-avx2'"):
        sizes("x86-avx2", "1,2")
    plan = resolve_plan(tiny_checkpoint, "sm_90a", BuildOptions(cuda_graph_sizes="2,8"), tools=False)
    assert plan.as_dict()["cuda_graph_sizes"] == [2, 8]
    json.dumps(plan.as_dict())


def test_cuda_graph_sizes_are_in_the_cuda_cache_key_only(tiny_checkpoint):
    from vtool.toolchain.plan import BuildOptions, resolve_plan

    def key(target: str, value: str) -> str:
        plan = resolve_plan(tiny_checkpoint, target, BuildOptions(cuda_graph_sizes=value), tools=False)
        # the key without the external tools' versions (nvcc need not be installed here)
        return dataclasses.replace(plan, toolchain={"nvcc": "test"}, attention_backend="tir").cache_key()

    cuda = {v: key("sm_90a", v) for v in ("auto", "none", "2,4,8", "2,4,16")}
    assert len(set(cuda.values())) == 4
    assert key("sm_90a", "1,2,4,8,16,24,32,48,64,96,128") == cuda["auto"]  # what auto resolves to
    assert key("x86-avx2", "auto") == key("x86-avx2", "none")  # CPU builds keep their keys


def test_the_cuda_pipeline_adds_a_captured_batch_decode_and_no_kernel(tiny_checkpoint):
    pytest.importorskip("tvm")
    import tvm
    from tvm import tirx

    from vtool.models.config import parse_hf_config
    from vtool.targets import lookup
    from vtool.toolchain.build import model_module
    from vtool.toolchain.pipeline import build_pipeline, describe, pass_context

    cfg = parse_hf_config(tiny_checkpoint.config())
    spec = lookup("sm_90a")
    kernels, functions = {}, {}
    for sizes in ((), (2, 4, 16)):
        target, mod, _params, _entries = model_module(cfg, spec, "bfloat16", lambda _msg: None)
        with target, pass_context("cuda"):
            out = build_pipeline(target, "cuda", "cublas", graph_sizes=sizes)(mod)
        functions[sizes] = out
        # every PrimFunc but the VM's host-side shape helpers (one more for the new function)
        kernels[sizes] = {gv.name_hint for gv, f in out.functions_items() if isinstance(f, tirx.PrimFunc)
                          and not gv.name_hint.startswith(("shape_func", "compute_symbolic_expr"))}
    assert kernels[()] == kernels[(2, 4, 16)] and len(kernels[()]) > 20  # the copy runs the very same kernels
    captured = functions[(2, 4, 16)]["batch_decode_captured"]
    assert int(captured.attrs["tir_var_upper_bound"]["batch_size"]) == 16
    assert list(captured.attrs["relax.rewrite_cuda_graph.capture_symbolic_vars"]) == ["batch_size"]
    script = captured.script()
    assert script.count("vm.builtin.cuda_graph.run_or_capture") >= cfg.num_hidden_layers
    # each capture is keyed by the batch size: (function, args, index, shape key)
    calls = [line for line in script.splitlines() if "run_or_capture" in line]
    assert all(line.rstrip().endswith("),))") or "ty_args" in line for line in calls)
    assert "run_or_capture" not in functions[(2, 4, 16)]["batch_decode"].script()  # eager batch_decode unchanged
    assert not any(gv.name_hint == "batch_decode_captured" for gv in functions[()].get_global_vars())
    # speculative verification: batch_verify captured per (token count, position count)
    verify = functions[(2, 4, 16)]["batch_verify_captured"]
    assert {k: int(v) for k, v in verify.attrs["tir_var_upper_bound"].items()} == {"seq_len": 16, "batch_size": 16}
    assert list(verify.attrs["relax.rewrite_cuda_graph.capture_symbolic_vars"]) == ["seq_len", "batch_size"]
    assert verify.script().count("vm.builtin.cuda_graph.run_or_capture") >= cfg.num_hidden_layers
    assert "run_or_capture" not in functions[(2, 4, 16)]["batch_verify"].script()
    assert not any(gv.name_hint == "batch_verify_captured" for gv in functions[()].get_global_vars())
    described = describe("cuda", "cublas", (2, 4, 16))
    assert described["cuda_graph_batch"] == {"entry": "batch_decode_captured", "sizes": [2, 4, 16], "max_batch": 16}
    assert described["cuda_graph_verify"] == {"entry": "batch_verify_captured", "max_tokens": 16}
    assert described["passes"].index("VtoolCaptureBatchDecode") == described["passes"].index("cuda.dataflow_lower") - 1
    assert "cuda_graph_batch" not in describe("cuda", "cublas", ())
    assert tvm is not None


# --- on a GPU: captured + padded against uncaptured --------------------------------------------

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25}


def _cuda_artifacts(tmp_path_factory) -> dict[str, Any]:
    from vtool.runtime.artifact.tvm_runtime import cuda_runtime

    try:
        cuda_runtime().gpu(0)
    except VtoolError as e:
        pytest.skip(f"no CUDA GPU usable by the vtool runtime: {e}")
    root = os.environ.get(ARTIFACTS_ENV)
    if root:
        index = json.loads((Path(root) / "index.json").read_text())
        return {k: {d: (Path(root) / v["checkpoint"], Path(root) / a) for d, a in v["artifacts"].items()}
                for k, v in index["tiny"].items()}
    if importlib.util.find_spec("tvm") is None or shutil.which("nvcc") is None:
        pytest.skip(f"{ARTIFACTS_ENV} is unset and there is no compiler here (apache-tvm + nvcc) to build with; "
                    "run tests/bench/decode_graphs.py prebuild where there is")
    from tiny_models import make_tiny_model
    from vtool.runtime.artifact.cuda import target_for_compute_capability
    from vtool.toolchain.build import build_artifact

    gpu = cuda_runtime().gpu(0)
    target = target_for_compute_capability(gpu.major, gpu.minor)
    tmp = tmp_path_factory.mktemp("cuda-graph-artifacts")
    out: dict[str, Any] = {}
    for name, dtypes in GPU_CASES.items():
        folder = make_tiny_model(name, tmp / name)
        out[name] = {d: (folder, build_artifact(folder, target, d, cuda_graph_sizes=GPU_SIZES)) for d in dtypes}
    return out


GPU_CASES = {"llama-gqa": ("float32", "bfloat16"), "qwen2-bias": ("bfloat16",)}
GPU_SIZES = "1,2,4,8,16"


@pytest.fixture(scope="module")
def cuda_artifacts(tmp_path_factory):
    return _cuda_artifacts(tmp_path_factory)


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", [(n, d) for n, ds in GPU_CASES.items() for d in ds])
def test_captured_padded_batch_decode_matches_uncaptured(cuda_artifacts, name, dtype):
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint

    if name not in cuda_artifacts or dtype not in cuda_artifacts[name]:
        pytest.skip(f"no {name} {dtype} artifact in {os.environ.get(ARTIFACTS_ENV)}")
    checkpoint, artifact = cuda_artifacts[name][dtype]
    model = CompiledModel(artifact, open_checkpoint(checkpoint))
    assert db.CAPTURED_ENTRY in model.manifest["entry_points"]
    # sizes 2, 4, 8, 16 as the host test; the KV cache's max batch 32 lets 17 run (unpadded)
    padded = Harness.make(model, 300, 32, buckets="library")
    eager = Harness.make(model, 300, 32)
    assert padded.runner.decode_buckets is not None and padded.runner.decode_buckets.sizes == (2, 4, 8, 16)
    taken: list[tuple[int, bool]] = []
    forward = padded.runner.decode_buckets.forward

    def counted(step, *rest):  # noqa: ANN001, ANN002, ANN202
        out = forward(step, *rest)
        taken.append((len(step.sequences), out is not None))
        return out

    padded.runner.decode_buckets.forward = counted
    report = run_scenario(padded, eager, model.vocab_size)
    tol = TOLERANCE[dtype]
    print(f"\n[gpu {name} {dtype}] max |dlogit| {report['max_abs']:.3g} (tolerance {tol}); steps {report['steps']}; "
          f"greedy mismatches (batch, seq, reference top-2 gap) {report['token_mismatches']}")
    assert report["max_abs"] <= tol, report
    # a greedy token may differ only at a near-tie of the reference (within the tolerance)
    assert all(gap <= tol for _, _, gap in report["token_mismatches"]), report
    ran = {n for n, padded_ran in taken if padded_ran}
    skipped = {n for n, padded_ran in taken if not padded_ran}
    assert {3, 5, 9, 7, 16, 2} <= ran and 17 in skipped  # captured at each size; past the largest: eager


@pytest.mark.gpu
def test_the_device_sampler_draws_from_the_padded_steps_own_rows(cuda_artifacts):
    """Greedy tokens drawn on the GPU from the view of a padded step's logits are the argmax
    of the uncaptured step's rows (the pad rows never reach the sampler)."""
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.sampling.host import SequenceSampler
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.weights.checkpoint import open_checkpoint

    checkpoint, artifact = cuda_artifacts["llama-gqa"]["float32"]
    model = CompiledModel(artifact, open_checkpoint(checkpoint))
    padded = Harness.make(model, 100, 16, buckets="library", device_sampling=True)
    eager = Harness.make(model, 100, 16)
    assert padded.runner.device_sampler is not None
    rng = np.random.default_rng(1)
    for s in range(5):  # 5 rows: padded to 8
        prompt = [int(t) for t in rng.integers(3, model.vocab_size, size=9)]
        padded.prefill(s, prompt)
        eager.prefill(s, prompt)
    feed = {s: 7 + s for s in range(5)}
    reference = eager.decode(feed)
    step = SchedulerOutput(tuple(
        ScheduledSequence(f"r{s}", s, (feed[s],), len(padded.tokens[s]), 1, True,
                          sampler=SequenceSampler(SamplingParams(temperature=0.0), vocab_size=model.vocab_size))
        for s in range(5)))
    assert padded.runner.decode_buckets.plan(list(range(5))).size == 8
    drawn = [r.sampled.token_id for r in padded.runner.execute(step).results]
    assert drawn == [int(np.argmax(reference[s])) for s in range(5)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_verification_matches_uncaptured_and_keeps_greedy_output(cuda_artifacts, dtype, tmp_path):
    """batch_verify_captured against the uncaptured batch_verify on the same steps (every row's
    logits, token counts 2..9 across one to three sequences, each count twice with other
    tokens so a replayed graph must read its new inputs), then (float32) the tiny model as its
    own draft through the engine: greedy output equal to plain decoding, with target and draft
    both verifying through graphs."""
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.engine.engine import Engine, EngineConfig
    from vtool.runtime.engine.spec_config import parse_speculative_config
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint

    if dtype not in cuda_artifacts.get("llama-gqa", {}):
        pytest.skip(f"no llama-gqa {dtype} artifact")
    checkpoint, artifact = cuda_artifacts["llama-gqa"][dtype]
    model = CompiledModel(artifact, open_checkpoint(checkpoint))
    assert db.CAPTURED_VERIFY_ENTRY in model.manifest["entry_points"]
    h = Harness.make(model, 100, 8)
    assert h.runner.verify_graph_tokens == 16  # the build's largest graph size
    rng = np.random.default_rng(3)
    for s in range(3):
        h.prefill(s, [int(t) for t in rng.integers(3, model.vocab_size, size=11 + s)])
    worst = 0.0
    for counts in ([2], [3, 1], [4, 2, 3], [5], [2, 2, 5], [9], [2], [4, 2, 3]):
        seqs = list(range(len(counts)))
        step = SchedulerOutput(tuple(
            ScheduledSequence(f"r{s}", s, tuple(int(t) for t in rng.integers(3, model.vocab_size, size=n)),
                              len(h.tokens[s]), n, False, return_logits=True) for s, n in zip(seqs, counts)))
        rows = {}
        for graphs in (16, 0):
            h.runner.verify_graph_tokens = graphs
            # a draft model's runner: every multi-token step is a continuation (batch_verify)
            h.runner.continuations = True
            assert h.runner._multi_token_entry(step, sum(counts)) == (
                db.CAPTURED_VERIFY_ENTRY if graphs else "batch_verify")
            rows[graphs] = [r.logits for r in h.runner.execute(step).results]
            for s, n in zip(seqs, counts):
                h.kv.pop(s, n)
        for a, b in zip(rows[16], rows[0]):
            worst = max(worst, float(np.abs(a - b).max()))
    print(f"\n[gpu verify {dtype}] max |dlogit| captured vs eager {worst:.3g}")
    assert worst <= TOLERANCE[dtype]
    if dtype != "float32":  # bf16: verify (GEMM) and decode (GEMV) round differently, near ties may flip
        return

    # the engine wants a tokenizer beside the weights; the tiny checkpoint has none (ids go in as ids)
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    with_tokenizer = tmp_path / "llama-gqa"
    shutil.copytree(checkpoint, with_tokenizer)
    Tokenizer(WordLevel({f"t{i}": i for i in range(model.vocab_size)}, unk_token="t0")).save(
        str(with_tokenizer / "tokenizer.json"))
    checkpoint = with_tokenizer
    session = open_session(artifact, open_checkpoint(checkpoint), max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[int(t) for t in rng.integers(3, model.vocab_size, size=n)] for n in (7, 12)]

    def generate(engine: Engine) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", ids, params)
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        return out

    baseline = generate(Engine(session, EngineConfig()))
    config = parse_speculative_config({"model": str(checkpoint), "num_speculative_tokens": 3})
    engine = Engine(session, EngineConfig(speculative=config.resolved(str(artifact), str(checkpoint))))
    assert engine.runner.verify_graph_tokens == engine.speculator.proposer.runner.verify_graph_tokens == 16
    assert generate(engine) == baseline
    stats = engine.stats()
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] > 0
    assert engine.kv.in_sync() and engine.kv_usage() == 0.0


@pytest.mark.gpu
def test_short_steps_attend_as_decode_and_long_steps_as_before(cuda_artifacts):
    """The cached part of a multi-token step's attention: steps of at most 128 tokens run the
    split-KV short kernel, longer ones TVM's tiled kernel (schedules/cuda/short_prefill_attention.py
    dispatches). A verify step's rows equal decoding the same tokens one by one, and a prompt
    prefilled in chunks (each over a cached prefix: short chunks, then one past 128 tokens)
    gives the logits of the same prompt in one step (float32)."""
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint

    # head_dim 32 (the short kernel's lanes split it; llama-gqa's 16 keeps TVM's kernel), GQA 4/1
    if "float32" not in cuda_artifacts.get("llama3-rope", {}):
        pytest.skip("no llama3-rope float32 artifact")
    checkpoint, artifact = cuda_artifacts["llama3-rope"]["float32"]
    model = CompiledModel(artifact, open_checkpoint(checkpoint))
    h = Harness.make(model, 200, 8)
    rng = np.random.default_rng(5)
    tokens = [int(t) for t in rng.integers(3, model.vocab_size, size=400)]

    def chunk(seq: int, ids: list[int], rows: int) -> np.ndarray:
        step = SchedulerOutput((ScheduledSequence(f"r{seq}", seq, tuple(ids), len(h.tokens[seq]), rows, False,
                                                  return_logits=True),))
        out = h.runner.execute(step).results[0].logits
        h.tokens[seq].extend(ids)
        return out

    worst = 0.0
    for context, n in ((40, 5), (90, 9), (17, 2)):
        h.kv.add(0)
        h.tokens[0] = []
        chunk(0, tokens[:context], 1)
        rows = chunk(0, tokens[context:context + n], n)  # a verify-like step: every row
        h.kv.pop(0, n)
        del h.tokens[0][context:]
        for j in range(n):
            one = h.decode({0: tokens[context + j]})[0]
            worst = max(worst, float(np.abs(rows[j] - one).max()))
        h.leave(0)
    whole = {}
    for seq, cuts in ((1, (250,)), (2, (60, 100, 90)), (3, (50, 200))):
        h.kv.add(seq)
        h.tokens[seq] = []
        start = 0
        for cut in cuts:
            last = chunk(seq, tokens[start:start + cut], 1)[-1]
            start += cut
        whole[seq] = last
        h.leave(seq)
    chunked = max(float(np.abs(whole[s] - whole[1]).max()) for s in (2, 3))
    print(f"\n[gpu short steps] verify rows vs decode {worst:.3g}; chunked vs whole prompt {chunked:.3g}")
    assert worst <= TOLERANCE["float32"] and chunked <= TOLERANCE["float32"]


@pytest.mark.gpu
@pytest.mark.parametrize("prompt_len", [100, 150])
def test_a_step_admitting_a_prompt_beside_decodes_attends_as_each_alone(cuda_artifacts, prompt_len):
    """A served step that admits a fresh prompt beside running decodes: 6 decodes and a
    100-token prompt (100 rows beyond one per sequence: the split-KV kernel) or a 150-token one
    (TVM's tiled kernel). Each decode row equals decoding that sequence alone (a fork of it)
    and the prompt's last row equals prefilling it alone (float32)."""
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint

    if "float32" not in cuda_artifacts.get("llama3-rope", {}):
        pytest.skip("no llama3-rope float32 artifact")  # head_dim 32: the short kernel's lanes split it
    checkpoint, artifact = cuda_artifacts["llama3-rope"]["float32"]
    model = CompiledModel(artifact, open_checkpoint(checkpoint))
    h = Harness.make(model, 300, 32)
    rng = np.random.default_rng(prompt_len)

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, model.vocab_size, size=n)]

    running = list(range(6))
    for seq in running:
        h.prefill(seq, ids(20 + 9 * seq))
    nxt = {seq: ids(1)[0] for seq in running}
    alone = {}
    for seq in running:
        h.fork(seq, 100 + seq)
        alone[seq] = h.decode({100 + seq: nxt[seq]})[100 + seq]
        h.leave(100 + seq)
    prompt = ids(prompt_len)
    prompt_alone = h.prefill(50, prompt)
    h.leave(50)
    h.kv.add(60)
    step = SchedulerOutput(tuple(
        ScheduledSequence(f"r{s}", s, (nxt[s],), len(h.tokens[s]), 1, False, return_logits=True) for s in running)
        + (ScheduledSequence("r60", 60, tuple(prompt), 0, 1, False, return_logits=True),))
    results = h.runner.execute(step).results
    decode_diff = max(float(np.abs(results[i].logits[-1] - alone[s]).max()) for i, s in enumerate(running))
    prompt_diff = float(np.abs(results[-1].logits[-1] - prompt_alone).max())
    print(f"\n[gpu mixed step, {prompt_len}-token prompt] decode rows vs alone {decode_diff:.3g}; "
          f"prompt vs alone {prompt_diff:.3g}")
    assert decode_diff <= TOLERANCE["float32"] and prompt_diff <= TOLERANCE["float32"]
