"""The continuous-batching engine: admit requests, run one step at a time, report
per-request deltas.

One step, as vLLM v1 splits it: the Scheduler decides what runs (a SchedulerOutput), the
ModelRunner computes it and samples (a ModelRunnerOutput), the OutputProcessor turns each
sampled token into a StepOutput (text, logprobs, stop checks); the engine only moves
requests between them and frees what finished. Limits are checked in engine/validation.py.
The engine is single-threaded; AsyncEngine runs it on its own thread for the server.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from vtool import VtoolError
from vtool.runtime.artifact.draft_state import LONE_DECODE_STEPS
from vtool.runtime.engine.chain_rule import OneSequenceChains
from vtool.runtime.engine.chained_steps import DeviceTokens, chain_rows, chained_step
from vtool.runtime.engine.grammar_stage import GrammarStage
from vtool.runtime.engine.kv_blocks import blocks_for_window
from vtool.runtime.engine.kv_cache import (PagedKVCache, cache_layers, frees_window, frees_window_by_default,
                                          sliding_window, window_kept)
from vtool.runtime.engine.lone_chain import LoneChain
from vtool.runtime.engine.lone_decode import LoneDecode
from vtool.runtime.engine.model_thread import Beside, ModelThread, model_thread_for
from vtool.runtime.engine.output_processor import OutputProcessor
from vtool.runtime.engine.prefix_cache import PrefixCache
from vtool.runtime.engine.request import CoreOutput, FinishedRequestStats, Request, Status, StepOutput
from vtool.runtime.engine.runner import InFlightStep, ModelRunner
from vtool.runtime.engine.scheduler import POLICIES, Scheduler, SchedulerConfig
from vtool.runtime.engine.spec_config import SpeculativeConfig
from vtool.runtime.engine.speculator import Speculator
from vtool.runtime.engine.step_types import ScheduledSequence, SchedulerOutput
from vtool.runtime.engine.text_stage import TextStage
from vtool.runtime.engine.validation import RequestError, RequestLimits
from vtool.runtime.sampling.host import SampleResult, SequenceSampler, prompt_logprobs
from vtool.runtime.sampling.logits_processors import LogitsProcessor
from vtool.runtime.sampling.params import SamplingParams

if TYPE_CHECKING:  # the session composes an engine's parts; the engine only reads it
    from vtool.runtime.session import Session

log = logging.getLogger("vtool.engine")

DEFAULT_KV_MEMORY_BYTES = 1 << 30  # CPU default budget for K/V when --num-blocks is not given
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
CHAINED_STEPS_ENV = "VTOOL_CHAINED_STEPS"
OVERLAP_MODEL_CALLS_ENV = "VTOOL_OVERLAP_MODEL_CALLS"
# Chained steps by default (EngineConfig.chain_steps None) for this many sequences or more; one
# sequence only once its steps are seen to be device-bound (engine/chain_rule.py): a host-bound
# model's one-sequence step lost 6-10% chained, with or without the model thread (BENCHMARKS.md).
CHAIN_MIN_ROWS = 2


def _env_switch(name: str) -> bool | None:
    """An on/off environment setting: None when unset or empty, False for 0, True otherwise."""
    value = os.environ.get(name, "")
    return None if value == "" else value != "0"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from the KV memory budget (below)
    # The KV budget when num_blocks is not given. None: DEFAULT_KV_MEMORY_BYTES on the CPU;
    # on a GPU, the device memory free once the weights are loaded times
    # gpu_memory_utilization. A number is the budget on either device.
    kv_memory_bytes: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    enable_prefix_caching: bool = True
    # On a GPU, sample with the library's compiled functions when every request in the
    # batch allows it (runtime/sampling/device.py); False keeps every draw on the host.
    device_sampling: bool = True
    scheduling_policy: str = "fcfs"
    max_new_tokens_ceiling: int | None = None  # server-side cap on an unset max_tokens
    max_model_len: int | None = None  # None: the session's
    # On a GPU, launch step N+1 before building step N's outputs (vLLM's async scheduling);
    # False runs one step at a time. The CPU always does (its launches are the computation).
    async_scheduling: bool = True
    # With async_scheduling on a GPU, queue a plain decode step before the previous step's tokens
    # are back, its input tokens read on the device (chained_steps.py). None (the default): when
    # the model thread runs the chained step's call (overlap_model_calls), for steps of at least
    # CHAIN_MIN_ROWS sequences: the previous step is then collected beside that call, 4-21% faster
    # steps at 4-64 sequences on an H100; chaining alone measured no faster (docs/BENCHMARKS.md,
    # "The model thread"). Steps of one sequence chain once the engine has seen them device-bound
    # (engine/chain_rule.py). True: every step that can chain does, thread or not; False: none.
    # VTOOL_CHAINED_STEPS=1 / 0 sets True / False.
    chain_steps: bool | None = dataclasses.field(default_factory=lambda: _env_switch(CHAINED_STEPS_ENV))
    # With async_scheduling on a GPU, run a chained step's entry-point call on a thread of its own
    # while this thread takes the previous step's tokens and builds its outputs (model_thread.py):
    # a small model's step is bound by the host, and TVM's VM releases the GIL while it queues the
    # step. VTOOL_OVERLAP_MODEL_CALLS=0 turns it off.
    overlap_model_calls: bool = dataclasses.field(
        default_factory=lambda: _env_switch(OVERLAP_MODEL_CALLS_ENV) is not False)
    # Structured output: append the tokens a grammar forces without a decode step each
    # (engine/grammar_stage.py); False decodes them one step at a time.
    grammar_jump_forward: bool = True
    # --speculative-config (engine/spec_config.py); None: no speculation.
    speculative: SpeculativeConfig | None = None
    # A library built with --draft-cache-len, no speculation: a greedy request alone decodes on the
    # library's own cache, lone_decode_steps tokens a round, each step one captured graph
    # (engine/lone_decode.py). Off until timed on a GPU; slower on the CPU.
    lone_decode: bool = False
    lone_decode_steps: int = LONE_DECODE_STEPS
    # A model whose every layer is windowed (CPU builds): give back the KV blocks wholly outside
    # the window while a sequence runs (kv_cache.py sliding_window), so a sequence holds at most
    # about window / 16 + 2 blocks. None: where the library's kernels for it are vtool's parallel
    # ones (kv_cache.py frees_window_by_default); True: also on TVM's serial ones (over 100x slower
    # prompts); False: never. Speculative decoding keeps every block.
    kv_window_freeing: bool | None = None

    def __post_init__(self) -> None:
        if self.scheduling_policy not in POLICIES:
            raise VtoolError(f"scheduling policy {self.scheduling_policy!r} is not one of {', '.join(POLICIES)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) <= 0:
                raise VtoolError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise VtoolError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes <= 0:
            raise VtoolError(f"kv_memory_bytes must be positive, got {self.kv_memory_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise VtoolError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


def kv_bytes_per_block(manifest: dict[str, Any], block_size: int, frees: bool = False) -> int:
    """frees: the cache is the window-freeing one (kv_cache.py SLIDING_CACHE), which has no extra layer."""
    c = manifest["config"]
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[manifest["dtype"]]
    return 2 * cache_layers(c, frees) * c["num_key_value_heads"] * c["head_dim"] * block_size * itemsize


def kv_memory_budget(model: Any, config: EngineConfig) -> int:
    """Bytes the KV cache may take when num_blocks is not given: config.kv_memory_bytes when
    set; else on a GPU the memory free now (weights loaded) times gpu_memory_utilization
    (vLLM's flag, applied to what is free rather than to the whole device), on the CPU
    DEFAULT_KV_MEMORY_BYTES."""
    if config.kv_memory_bytes is not None:
        return config.kv_memory_bytes
    memory = model.device_memory() if getattr(model, "on_gpu", False) else None
    if memory is None:
        return DEFAULT_KV_MEMORY_BYTES
    free, total = memory
    budget = int(free * config.gpu_memory_utilization)
    log.info("KV budget %.2f GiB: %.2f GiB free of %.2f GiB x gpu_memory_utilization %.2f",
             budget / 2**30, free / 2**30, total / 2**30, config.gpu_memory_utilization)
    return budget


@dataclasses.dataclass
class EngineCounters:
    prompt_tokens: int = 0  # every prompt token admitted, cache hits included (vllm:prompt_tokens_total)
    generation_tokens: int = 0
    computed_prefill_tokens: int = 0  # prompt tokens actually run through the model
    # Each request's prompt by where its KV came from, counted once when its prefill ends (its
    # first token), as vLLM's PromptTokenStats: computed + cache hits - recomputed = prompt.
    prompt_tokens_computed: int = 0    # vllm:prompt_tokens_by_source{source="local_compute"}
    prompt_tokens_cache_hit: int = 0   # {source="local_cache_hit"}
    prompt_tokens_cached: int = 0      # vllm:prompt_tokens_cached (no external KV here: the same)
    prompt_tokens_recomputed: int = 0  # vllm:prompt_tokens_recomputed
    steps: int = 0
    finished: dict[str, int] = dataclasses.field(default_factory=dict)
    # Host seconds per part of a step (the runner adds "forward" and "sample"): where the
    # engine's time goes, read as rates between two snapshots.
    schedule_seconds: float = 0.0
    output_seconds: float = 0.0
    # Speculative decoding, as vLLM counts it: sequences that carried drafts into a step,
    # the drafts, the accepted ones, and the accepted ones by draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    propose_seconds: float = 0.0
    # Rounds a greedy request alone ran with both models on their own caches (lone_chain.py).
    lone_chain_rounds: int = 0
    # Rounds a greedy request alone decoded on the library's own cache (lone_decode.py).
    lone_decode_rounds: int = 0
    # Steps queued behind the one before, their tokens read on the device (chained_steps.py).
    chained_steps: int = 0


@dataclasses.dataclass
class _Launched:
    """A step the runner has queued, with the requests it serves, in batch order."""

    requests: list[Request]
    flight: InFlightStep
    launched_at: float  # perf_counter when its launch began
    queued_seconds: float = 0.0  # the host's time in the launch (a plain one; chained ones are not timed)
    # a one-sequence step the next could have chained to but for OneSequenceChains' decision: its
    # collection times it for that decision
    times_one_sequence: bool = False


class EngineObserver(Protocol):
    """What the engine reports as it runs (serving/metrics.py's ServerMetrics is one)."""

    def observe_iteration(self, num_tokens: int) -> None: ...
    def observe_step(self, kind: str, seconds: float) -> None: ...
    def observe_first_token(self, seconds: float) -> None: ...
    def observe_inter_tokens(self, seconds: Sequence[float]) -> None: ...
    def observe_finished_request(self, stats: FinishedRequestStats) -> None: ...


class Engine:
    """The engine core (step_core: token ids out) with, for in-process callers, the text
    stage on top (step: text out). A server whose engine core has its own process uses
    step_core there and runs TextStage beside the HTTP handlers."""

    def __init__(self, session: Session, config: EngineConfig = EngineConfig()):
        if session.model.manifest.get("task", "generate") != "generate":  # `vtool run`, bench, ...
            raise VtoolError(f"{session.checkpoint.path} is an embedding model ({session.model.manifest.get('arch')}, "
                             "task 'embed'): it does not generate text; use LLM.embed() or `vtool serve` and "
                             "POST /v1/embeddings")
        self.session = session
        self.model = session.model
        self.tokenizer = session.tokenizer
        self.config = config
        self.max_model_len = config.max_model_len or session.max_model_len
        if self.max_model_len > session.max_model_len:
            raise VtoolError(f"max_model_len {self.max_model_len} is past the session's {session.max_model_len}")
        self.vocab_size = self.model.vocab_size
        self.output_processor = OutputProcessor(self.max_model_len)
        # Before the KV cache: on a GPU the cache takes a share of what memory is free, and a
        # draft model's weights and cache must be in place by then.
        self.speculator = Speculator.create(config.speculative, self) if config.speculative else None
        # A greedy request alone speculates over the two libraries' own caches when both have
        # them (engine/lone_chain.py), or without speculation decodes on the library's own cache
        # (engine/lone_decode.py); it is then held here, outside the scheduler.
        self.lone_chain: LoneChain | LoneDecode | None = \
            LoneChain.open(self) if self.speculator is not None else LoneDecode.open(self)
        self._alone: Request | None = None
        # Every layer windowed: the cache that frees what the window passed (by default where its
        # kernels are fast), unless speculative decoding must take rejected drafts back
        # (kv_cache.py sliding_window).
        asked = config.kv_window_freeing
        wanted = frees_window_by_default(self.model) if asked is None else asked
        frees = wanted and self.speculator is None and frees_window(self.model)
        if wanted and not frees:  # a warning when asked for, a note when it was the default
            log.log(logging.WARNING if asked else logging.INFO, "KV blocks outside the sliding window are kept: %s",
                    "speculative decoding takes tokens back" if self.speculator is not None
                    and frees_window(self.model) else
                    "the model has no window-freeing cache (a global layer, no window, or not a CPU build)")
        elif asked is None and frees_window(self.model) and not wanted:
            log.info("KV blocks outside the sliding window are kept: the library's window-freeing attention is "
                     "TVM's serial kernels (--kv-window-freeing uses them anyway)")
        per_seq_tokens = self.max_model_len
        if frees:  # a sequence never holds more; TVM adds 2 pages per sequence to what it is given
            per_seq_tokens = min(per_seq_tokens, blocks_for_window(window_kept(self.model), config.block_size)
                                 * config.block_size)
        num_blocks = config.num_blocks or max(
            1, min(kv_memory_budget(self.model, config) // kv_bytes_per_block(self.model.manifest, config.block_size,
                                                                               frees)
                   - (2 * config.max_num_seqs if frees else 0),
                   -(-per_seq_tokens * config.max_num_seqs // config.block_size)))
        self.kv = PagedKVCache(self.model, num_blocks, config.block_size, config.max_num_seqs,
                               config.max_num_batched_tokens, free_window=frees)
        capacity = self.kv.blocks.num_blocks * config.block_size
        if self.kv.frees:
            if self.kv.blocks.num_blocks < self.kv.blocks.window_blocks(self.kv.window):
                raise VtoolError(f"the KV cache has {self.kv.blocks.num_blocks} blocks of {config.block_size}; a "
                                 f"sequence of this sliding-window model may hold "
                                 f"{self.kv.blocks.window_blocks(self.kv.window)}: raise --num-blocks")
            capacity = None  # blocks outside the window are freed: no prompt outgrows the cache
        elif capacity < self.max_model_len:
            if config.max_model_len is not None:
                # As vLLM: one request at full context must fit, or preemption could never help it.
                raise VtoolError(
                    f"the KV cache holds {capacity} tokens ({self.kv.blocks.num_blocks} blocks of {config.block_size}), "
                    f"less than max_model_len={self.max_model_len}; raise --num-blocks or lower --max-model-len")
            log.warning("max_model_len lowered from %d to %d, what %d KV blocks of %d tokens hold",
                        self.max_model_len, capacity, self.kv.blocks.num_blocks, config.block_size)
            self.max_model_len = capacity
        self.limits = RequestLimits(self.vocab_size, self.max_model_len, kv_capacity_tokens=capacity,
                                    max_new_tokens_ceiling=config.max_new_tokens_ceiling)
        window = sliding_window(self.model)  # chunks of at most the window, no prefix cache (kv_cache.py)
        if window and config.enable_prefix_caching:
            log.info("prefix caching is off: the model has sliding-window layers")
        self.prefix_cache = PrefixCache(self.kv.blocks) if config.enable_prefix_caching and not window else None
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.scheduling_policy, max_chunk=window),
                                   self.kv, self.prefix_cache)
        self.runner = ModelRunner(self.model, self.kv, device_sampling=config.device_sampling)
        self.output_processor.max_model_len = self.max_model_len
        self.requests: dict[str, Request] = {}
        self.texts: dict[str, TextStage] = {}  # in-process text stages (add_request with_text)
        self.grammar = GrammarStage(self.tokenizer, self.vocab_size, session.stop_ids, config.grammar_jump_forward)
        self.counters = EngineCounters()
        self.observer: EngineObserver | None = None
        self._collected_at = 0.0  # perf_counter when the last step's tokens were in (step timing)
        self.last_step_tokens = 0
        # Overlapped steps (step_core) where a launch returns before the device is done.
        self._overlap = config.async_scheduling and self.runner.queues_work
        self.model_thread: ModelThread | None = None
        self._arrange_chains()
        self._in_flight: _Launched | None = None
        self._failed: list[CoreOutput] = []  # requests ended outside a step, reported by the next

    def _arrange_chains(self) -> None:
        """Chained steps (chained_steps.py): the next step queued before the last one's tokens are
        back, when the device draws them; not with speculation (drafts need the tokens on the
        host) nor the window-freeing cache (CPU only). By default only with the model thread
        (model_thread.py), which runs the chained step's call while the last step is collected.
        Decided from what the runner can do (overlapped launches, a device draw); the CPU tests
        give a CPU engine both and call this again."""
        config = self.config
        can_chain = self._overlap and config.chain_steps is not False and self.speculator is None \
            and not self.kv.frees and self.runner.device_sampler is not None
        if self.model_thread is not None:
            self.model_thread.close()
        self.model_thread = model_thread_for(self.model) if can_chain and config.overlap_model_calls else None
        self.runner.model_thread = self.model_thread
        self._chains = can_chain and (config.chain_steps is True or self.model_thread is not None)
        self._chain_min_rows = 1 if config.chain_steps is True else CHAIN_MIN_ROWS
        # one-sequence steps chain by default once seen device-bound (chain_rule.py)
        self.one_sequence_chains = OneSequenceChains() if self._chains and config.chain_steps is None else None
        self._fence_chains()

    def _fence_chains(self) -> None:
        """On a GPU, steps that a chained step may follow record the KV cache's fence
        (kv_cache.fence_steps): those of at least _chain_min_rows sequences."""
        if self._chains and getattr(self.model, "on_gpu", False):
            from vtool.runtime.artifact.tvm_runtime import cuda_runtime

            self.kv.fence_steps(cuda_runtime(), self._chain_min_rows)

    def _time_one_sequence(self, launched: _Launched, waited_seconds: float) -> None:
        """A one-sequence step collected unchained: its timings for the decision of chain_rule.py;
        when that says the device is the bottleneck, such steps chain from the next one recorded."""
        rule = self.one_sequence_chains
        if rule is not None and rule.observe(launched.queued_seconds, waited_seconds):
            queued, waited = rule.medians()
            log.info("one-sequence decode steps chain from now on: the host waited %.2f ms a step for the device, "
                     "after %.2f ms queueing it (medians of %d steps)", 1e3 * waited, 1e3 * queued, rule.observed)
            self._chain_min_rows = 1
            self._fence_chains()

    @property
    def device_sampler(self) -> Any:
        return self.runner.device_sampler

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None,
                    logits_processors: list[LogitsProcessor] | None = None, with_text: bool = True,
                    parent: tuple[str, int] | None = None) -> Request:
        """Admit a request (refusals raise RequestError / SamplingParamsError, naming what is
        wrong). with_text: step() turns its outputs into text here; False when the caller
        runs the TextStage itself (a server's API process). parent: (id, n) when this is one of
        a request's n parallel samples (Request.parent)."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        max_tokens = self.limits.check_request(prompt_ids, params)
        compiling = False
        if params.structured_outputs is not None:
            from vtool.runtime.sampling.grammar import spec_of

            spec_of(params.structured_outputs)  # validated now (cached): a bad grammar is refused here
            processor = self.grammar.processor_now(params.structured_outputs)
            if processor is not None:
                logits_processors = [*(logits_processors or ()), processor]
            compiling = processor is None  # compiled off the loop; it waits apart until then
        text = TextStage(self.tokenizer, list(prompt_ids), params) if with_text else None
        request = Request(
            request_id=request_id, prompt_ids=list(prompt_ids), params=params, max_tokens=max_tokens,
            sampler=SequenceSampler(params, prompt_ids, self.session.stop_ids, self.vocab_size,
                                    logits_processors or ()),
            priority=priority, arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            cumulative_logprob=None if params.logprobs is None else 0.0,
            parent=(str(parent[0]), int(parent[1])) if parent is not None else None)
        self.requests[request_id] = request
        if text is not None:
            self.texts[request_id] = text
        self.counters.prompt_tokens += len(prompt_ids)
        if compiling:
            self.grammar.submit(request, params.structured_outputs)
        else:
            self.scheduler.add(request)
        return request

    def prepare_grammar(self) -> None:
        """Build the grammar compiler's vocabulary on a worker now (0.3-1.4 s once per model), so
        that a server's first structured-output request does not wait for it."""
        self.grammar.prepare()

    def _admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the scheduler's queue; one whose grammar
        failed ends (reason "abort", reported in the next outputs) and the log says why."""
        for request, processor, error in self.grammar.ready():
            if error is not None:
                log.error("request %s: its grammar failed to compile: %s", request.request_id, error)
                self._finish(request, "abort", None, reported=True)
                self._failed.append(self.output_processor.ended(request))
                continue
            request.sampler.logits_processors = (*request.sampler.logits_processors, processor)
            self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already done."""
        return self.finish_request(request_id, "abort")

    def finish_request(self, request_id: str, reason: str, stop_reason: str | int | None = None) -> bool:
        """End a request from outside the core: "abort" (a client left), or "stop" when the
        text stage found a stop string. Frees its blocks; False if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, reason, stop_reason)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None or self.grammar.has_pending \
            or bool(self._failed) or self._alone is not None

    # -- one step --------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step with text: every request must have been added with_text."""
        outputs = []
        for core in self.step_core():
            text = self.texts[core.request_id]
            out = text.process(core)
            if out.finished:
                del self.texts[core.request_id]
                if core.finish_reason is None:  # a stop string, found by the text stage
                    self.finish_request(core.request_id, "stop", out.stop_reason)
            outputs.append(out)
        return outputs

    def step_core(self, on_outputs: Callable[[list[CoreOutput]], None] | None = None) -> list[CoreOutput]:
        """One step: schedule, run, sample; token ids out. Requests a stop token or the
        length limit ended are finished (their blocks freed) before this returns.

        On a GPU (config.async_scheduling) the steps overlap: this collects the step launched
        by the previous call, schedules and launches the next one, and only then builds the
        collected step's outputs, so that host work runs while the device computes. When the
        next step is known without the collected step's tokens (plain decoding, nobody to
        admit), it is launched first, chained to the device's draw, so the device never waits
        for the host between the two (chained_steps.py). Outputs therefore come one call
        later; has_unfinished() stays true until the last launched step has been collected.

        on_outputs: takes the outputs built beside a chained step's model call as soon as they are
        built, while the call still runs (the engine core sends them then: model_thread.py);
        everything it was not given is returned."""
        collected: list[tuple[list[tuple[Request, Any, str | None, int | None, float | None, list[int]]], float]] = []
        outputs: list[CoreOutput] = []

        def emit() -> None:  # the outputs of what was collected so far
            t0 = time.perf_counter()
            outputs.extend(out for taken, now in collected for out in self._emit(taken, now))
            collected.clear()
            self.counters.output_seconds += time.perf_counter() - t0

        if self.grammar.has_pending:
            self._admit_compiled()
        chained = None
        if self._in_flight is not None:
            flying, self._in_flight = self._in_flight, None

            def collect_and_emit() -> None:
                collected.append(self._collect(flying))
                emit()
                if on_outputs is not None and outputs:
                    on_outputs(outputs[:])
                    outputs.clear()

            # before the wait, when the next step is known; the flying step is collected beside
            # the chained step's model call when a model thread runs it (model_thread.py)
            chained = self._launch_chained(flying, collect_and_emit)
            if chained is None or not chained.flight.beside_ran:
                collected.append(self._collect(flying))
        if chained is not None:
            self._in_flight = chained
        elif (alone := self._lone_request()) is not None:
            collected.append(self._lone_round(alone))
        elif (launched := self._launch()) is not None:
            if self._overlap:
                self._in_flight = launched
            else:
                collected.append(self._collect(launched))
        emit()
        if self._in_flight is not None:
            self.runner.queue_draw(self._in_flight.flight)  # a grammar step's draw, its mask filled meanwhile
        if self._failed:
            outputs, self._failed = outputs + self._failed, []
        if not collected and self.grammar.has_pending and not self.scheduler.has_work():
            self.grammar.wait(0.005)  # only grammars compiling: do not spin beside them
        return outputs

    def _lone_request(self) -> Request | None:
        """The request a round over the two caches serves now (engine/lone_chain.py): one alone
        in the engine that the chain takes. A held request that is no longer alone (or no longer
        fits) goes back to the scheduler; None: the scheduler's step."""
        chain, scheduler = self.lone_chain, self.scheduler
        if chain is None:
            return None
        others = len(scheduler.running) + len(scheduler.waiting) + self.grammar.num_pending
        held = self._alone
        if held is not None:
            if others == 0 and chain.takes(held):
                return held
            self._alone = None
            scheduler.requeue(held)
            return None
        if others != 1 or not (scheduler.running or scheduler.waiting):
            return None
        request = (scheduler.running or scheduler.waiting)[0]
        if not chain.takes(request):
            return None
        scheduler.detach(request)
        self._alone = request
        return request

    def _lone_round(self, request: Request) -> tuple[list[tuple[Request, Any, str | None, int | None, float | None,
                                                                 list[int]]], float]:
        """One round of the lone request over the two caches, its tokens taken as _collect takes
        a step's (stop ids and length limits end it there)."""
        started = time.perf_counter()
        request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
        first = not request.output_ids
        new, drafted = self.lone_chain.round(request, self.output_processor.room(request))
        c = self.counters
        c.steps += 1
        setattr(c, self.lone_chain.rounds_counter, getattr(c, self.lone_chain.rounds_counter) + 1)
        if drafted:
            self._count_drafts(drafted, len(new) - 1)
        t0 = time.perf_counter()
        if self.observer is not None:
            self.observer.observe_step("prefill" if first else "decode", t0 - max(started, self._collected_at))
        self._collected_at = t0
        now = time.monotonic()
        last = request.last_token_time
        if request.first_token_time is None:
            self._count_prompt_sources(request)
            c.computed_prefill_tokens += len(request.prompt_ids) if request.num_preemptions == 0 else 0
        sampled: list[SampleResult] = []
        finish, stop_reason = None, None
        for token in new:
            request.sampler.append_token(token)
            sampled.append(SampleResult(token_id=token, logprob=None))
            finish, stop_reason = self.output_processor.update(request, sampled[-1], now)
            if finish is not None:
                break
        c.generation_tokens += len(sampled)
        if finish is not None:
            self._finish(request, finish, stop_reason)
        c.output_seconds += time.perf_counter() - t0
        return [(request, sampled, finish, stop_reason, last, [])], now

    def _launch(self) -> _Launched | None:
        if self.speculator is not None:
            t0 = time.perf_counter()
            self.speculator.propose(self.scheduler.running)
            self.counters.propose_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self.counters.schedule_seconds += time.perf_counter() - t0
        self.last_step_tokens = scheduled.num_tokens
        if scheduled.is_empty:
            return None
        now = time.monotonic()
        requests = [self.requests[s.request_id] for s in scheduled.sequences]
        for request in requests:
            request.first_scheduled_time = request.first_scheduled_time or now
        self.counters.steps += 1
        launched_at = time.perf_counter()
        flight = self.runner.launch(scheduled)
        return _Launched(requests, flight, launched_at, time.perf_counter() - launched_at)

    def _launch_beside(self, step: SchedulerOutput, device_tokens: DeviceTokens, beside: Beside | None) -> InFlightStep:
        """runner.launch of a chained step, `beside` run while its model call queues it when the
        model thread takes the call, the KV cache's removals held meanwhile (requests the host
        work ends free their blocks after the call)."""
        if beside is None or self.model_thread is None:
            return self.runner.launch(step, device_tokens)
        with self.kv.holding_removals():
            return self.runner.launch(step, device_tokens, beside)

    def _launch_chained(self, launched: _Launched, beside: Beside | None = None) -> _Launched | None:
        """Queue the next step right behind a launched one, its input tokens read on the device
        from the launched step's draw (engine/chained_steps.py), when that step is known without
        them; None: the next step needs the scheduler, after the launched step is collected."""
        if not self._chains:
            return None
        t0 = time.perf_counter()
        flight, scheduler = launched.flight, self.scheduler
        running = scheduler.running
        # Not behind a draw that reports logprobs: the host copies those rows of the step's logits
        # when it collects it, and a captured next step writes the same logits buffer first.
        rows = chain_rows(launched.requests, flight.step,
                          flight.on_device and flight.draw is not None and flight.pending_draw is None
                          and not flight.draw.logprob_rows,
                          running, bool(scheduler.waiting) and len(running) < self.config.max_num_seqs,
                          self.config.max_num_batched_tokens, self.output_processor.room)
        blocks = self.kv.blocks
        if rows is not None and len(rows) == 1 and self._chain_min_rows > 1 and len(flight.step.sequences) == 1:
            launched.times_one_sequence = True
        # a step queued early needs the step before to have recorded the fence (not yet, right
        # after one-sequence steps begin to chain)
        if rows is None or len(rows) < self._chain_min_rows or not self.kv.may_queue_behind() \
                or sum(blocks.blocks_needed(r.seq_id, 1) for r in running) > blocks.num_free_blocks:
            self.counters.schedule_seconds += time.perf_counter() - t0
            return None  # the scheduler evicts cached prefixes or preempts for blocks; not here
        requests = [launched.requests[i] for i in rows]
        step = chained_step(requests, [flight.step.sequences[i] for i in rows])
        self.counters.schedule_seconds += time.perf_counter() - t0
        self.last_step_tokens = step.num_tokens
        self.counters.steps += 1
        self.counters.chained_steps += 1
        launched_at = time.perf_counter()
        return _Launched(requests, self._launch_beside(step, DeviceTokens(flight.draw.tokens, tuple(rows)), beside),
                         launched_at)

    def _collect(self, launched: _Launched) -> tuple[list[tuple[Request, Any, str | None, int | None, float | None,
                                                                list[int]]], float]:
        """Wait for a launched step and take its tokens into the requests (what scheduling
        the next step needs); requests that ended are finished. Requests aborted while the
        step ran are skipped: their blocks are already free and nothing they computed counts."""
        waited = time.perf_counter()
        ran = self.runner.finish(launched.flight)
        t0 = time.perf_counter()
        if launched.times_one_sequence:
            self._time_one_sequence(launched, t0 - waited)
        if self.observer is not None:
            # A step's time on the critical path: from its launch, or from the previous step's
            # collection when it was queued behind that one (overlapped steps), to its tokens.
            self.observer.observe_step(launched.flight.step.kind, t0 - max(launched.launched_at, self._collected_at))
        self._collected_at = t0
        now = time.monotonic()
        taken = []
        for request, sequence, result in zip(launched.requests, launched.flight.step.sequences, ran.results):
            if request.finished:
                continue
            if sequence.draft_ids:
                self._account_drafts(request, sequence, result.num_accepted)
            else:
                self._account(request, sequence, result.logits)
            if result.sampled is not None:
                last = request.last_token_time
                if request.first_token_time is None:
                    self._count_prompt_sources(request)
                sampled = [result.sampled]
                finish, stop_reason = self.output_processor.update(request, result.sampled, now)
                for more in result.more:  # tokens a speculative step kept
                    if finish is not None:
                        break
                    sampled.append(more)
                    finish, stop_reason = self.output_processor.update(request, more, now)
                self.counters.generation_tokens += len(sampled)
                forced: list[int] = []
                if finish is None and request.sampler.logits_processors:
                    forced = self.grammar.forced_tokens(request, self.output_processor.room(request))
                    if forced:
                        finish, stop_reason = self.output_processor.extend(request, forced)
                        self.counters.generation_tokens += len(forced)
                taken.append((request, sampled, finish, stop_reason, last, forced))
                if finish is not None:
                    self._finish(request, finish, stop_reason)
        self.counters.output_seconds += time.perf_counter() - t0
        return taken, now

    def _emit(self, taken: list[tuple[Request, Any, str | None, int | None, float | None, list[int]]],
              now: float) -> list[CoreOutput]:
        """The outputs of collected tokens, and what the observer records of them."""
        observer = self.observer
        outputs = []
        gaps = []
        for request, sampled, finish, stop_reason, last, forced in taken:
            out = self.output_processor.record(request, sampled, finish, stop_reason, forced)
            if observer is not None:
                if last is None:
                    observer.observe_first_token(now - request.arrival_time)
                else:
                    gaps.append(now - last)
            outputs.append(out)
        if observer is not None and taken:
            observer.observe_inter_tokens(gaps)
            # vLLM's iteration tokens: tokens generated, plus each prompt that got its first token.
            observer.observe_iteration(sum(len(o.new_token_ids) for o in outputs)
                                       + sum(o.num_prompt_tokens for o in outputs
                                             if o.num_output_tokens == len(o.new_token_ids)))
        return outputs

    def _account(self, request: Request, sequence: ScheduledSequence, logits: Any) -> None:
        """Move the request past the tokens this step computed."""
        n = sequence.num_tokens
        in_prompt = max(0, min(request.num_computed + n, len(request.prompt_ids)) - request.num_computed)
        self.counters.computed_prefill_tokens += in_prompt if request.num_preemptions == 0 else 0
        if sequence.return_logits and logits is not None and request.prompt_logprobs is None:
            self._collect_prompt_logits(request, n, logits)
        request.num_computed += n

    def _account_drafts(self, request: Request, sequence: ScheduledSequence, accepted: int) -> None:
        """Move the request past its last token and the drafts the target accepted; the rejected
        drafts' K/V is taken back out of the cache (the draft model's own, at its next proposal)."""
        k = len(sequence.draft_ids)
        request.num_computed += 1 + accepted
        self.kv.pop(request.seq_id, k - accepted)
        self._count_drafts(k, accepted)

    def _count_drafts(self, k: int, accepted: int) -> None:
        """vLLM's spec_decode counts for one sequence's k drafts, the first `accepted` kept."""
        c = self.counters
        c.spec_num_drafts += 1
        c.spec_num_draft_tokens += k
        c.spec_num_accepted_tokens += accepted
        if len(c.spec_accepted_per_pos) < k:
            c.spec_accepted_per_pos.extend([0] * (k - len(c.spec_accepted_per_pos)))
        for pos in range(accepted):
            c.spec_accepted_per_pos[pos] += 1

    def _collect_prompt_logits(self, request: Request, n: int, rows: np.ndarray) -> None:
        chunks = request.prompt_logit_chunks
        chunks.append(rows[: max(0, min(n, len(request.prompt_ids) - request.num_computed))])
        if request.num_computed + n >= len(request.prompt_ids):
            full = np.concatenate(chunks)[: len(request.prompt_ids)]
            request.prompt_logprobs = prompt_logprobs(full, request.prompt_ids, request.params.prompt_logprobs)
            chunks.clear()

    def _finish(self, request: Request, reason: str, stop_reason: str | int | None, reported: bool = False) -> None:
        """reported: the caller reports the end in an output (else an abort came from outside,
        which needs none, and its text stage goes)."""
        request.status, request.finish_reason, request.stop_reason = Status.FINISHED, reason, stop_reason
        self.scheduler.release(request)
        self.grammar.discard(request.request_id)
        if self.speculator is not None:
            self.speculator.release(request)
        if self.lone_chain is not None:
            self.lone_chain.release(request)
            if self._alone is request:
                self._alone = None
        self.requests.pop(request.request_id, None)
        if reason == "abort" and not reported:
            self.texts.pop(request.request_id, None)
        self._finish_counts(reason)
        if self.observer is not None:
            self.observer.observe_finished_request(FinishedRequestStats(
                finish_reason=reason, arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time, first_token_time=request.first_token_time,
                finished_time=time.monotonic(), num_prompt_tokens=len(request.prompt_ids),
                num_cached_tokens=request.cached_prompt_tokens,
                num_generation_tokens=len(request.output_ids), max_tokens=request.max_tokens,
                n=request.parent[1] if request.parent else request.params.n, num_preemptions=request.num_preemptions,
                parent_id=request.parent[0] if request.parent else None))

    def _count_prompt_sources(self, request: Request) -> None:
        """A request's prefill ended: its prompt tokens by source, as vLLM's PromptTokenStats.
        A fully cached prompt still computes its last token (the cache never hands out all of
        it): vLLM counts that token as a cache hit recomputed, by the rule cached + 1 == prompt."""
        prompt, cached = len(request.prompt_ids), request.cached_prompt_tokens
        recomputed = 1 if cached > 0 and cached + 1 == prompt else 0
        c = self.counters
        c.prompt_tokens_computed += prompt - cached
        c.prompt_tokens_cache_hit += cached + recomputed
        c.prompt_tokens_cached += cached
        c.prompt_tokens_recomputed += recomputed

    def _finish_counts(self, reason: str) -> None:
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1

    # -- introspection ------------------------------------------------------------------------
    def kv_usage(self) -> float:
        """Fraction of blocks in use, prefix-cache-only blocks counted free (as vLLM)."""
        blocks = self.kv.blocks
        evictable = self.prefix_cache.evictable_blocks() if self.prefix_cache is not None else 0
        return (blocks.num_blocks - blocks.num_free_blocks - evictable) / blocks.num_blocks

    def reset_prefix_cache(self) -> bool:
        if self.prefix_cache is None:
            return False
        for seq_id in self.prefix_cache.clear():
            self.kv.remove(seq_id)
        return True

    def stats(self) -> dict[str, Any]:
        return {
            "num_running": len(self.scheduler.running) + (self._alone is not None), "num_waiting": len(self.scheduler.waiting) + self.grammar.num_pending,
            "num_waiting_deferred": self.grammar.num_pending,  # vLLM's reason: waiting for a grammar
            "kv_cache_usage": self.kv_usage(), "num_blocks": self.kv.blocks.num_blocks,
            "block_size": self.kv.block_size, "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.prefix_cache.queries if self.prefix_cache else 0,
            "prefix_cache_hits": self.prefix_cache.hits if self.prefix_cache else 0,
            **dataclasses.asdict(self.counters),
            "grammar_jumped_tokens": self.grammar.num_jumped_tokens,
            "forward_seconds": self.runner.seconds["forward"], "sample_seconds": self.runner.seconds["sample"],
        }
