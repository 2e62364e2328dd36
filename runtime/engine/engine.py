"""The continuous-batching engine: admit requests, run one batched model step at a time,
sample, detokenize, stop, and report per-request deltas.

One step = Scheduler.schedule() -> one call of batch_decode (every item one token) or
batch_prefill (prefill chunks, mixed with decodes) -> sample the rows whose sequence is
now complete -> RequestOutputs. The engine is single-threaded; AsyncEngine runs it on its
own thread for the server.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from vtool import VtoolError
from vtool.runtime.sampling.device import DeviceSampler, sequence_on_device
from vtool.runtime.engine.kv_cache import PagedKVCache
from vtool.runtime.engine.prefix_cache import PrefixCache
from vtool.runtime.engine.request import Request, StepOutput, Status
from vtool.runtime.sampling.host import SequenceSampler, prompt_logprobs, sample_batch
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.engine.scheduler import POLICIES, Scheduler, SchedulerConfig
from vtool.runtime.session import Session
from vtool.runtime.sampling.stop_strings import StopStringMatcher
from vtool.runtime.artifact.tvm_runtime import global_func

log = logging.getLogger("vtool.engine")

DEFAULT_KV_MEMORY_BYTES = 1 << 30  # CPU default budget for K/V when --num-blocks is not given
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default


class RequestError(VtoolError):
    """A request the engine refuses (the server answers 400 with this message)."""


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


def kv_bytes_per_block(manifest: dict[str, Any], block_size: int) -> int:
    c = manifest["config"]
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[manifest["dtype"]]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * block_size * itemsize


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
    steps: int = 0
    finished: dict[str, int] = dataclasses.field(default_factory=dict)


class StepLogits:
    """One step's logits, left where the model wrote them (rows [n, V] of float32), with
    the item each row belongs to (owners[r]; -1 for a row no item needs). They come to the
    host once, and only if a host sampler or prompt logprobs ask for rows."""

    def __init__(self, model: Any, tensor: Any, vocab_size: int, owners: list[int], num_items: int):
        self.model, self.tensor, self.vocab_size = model, tensor, vocab_size
        self.owners = np.asarray(owners)
        self.num_items = num_items
        self._host: np.ndarray | None = None

    def rows_are(self, items: list[int]) -> bool:
        """Whether the rows are exactly these items' rows, one each, in this order (then the
        tensor itself can be sampled on the device)."""
        return self.owners.tolist() == list(items)

    def rows(self, item: int) -> np.ndarray | None:
        """Item's rows on the host, [k, V], or None when the step computed none for it."""
        if not (self.owners == item).any():
            return None
        if self._host is None:
            self._host = self.model.to_numpy(self.tensor).reshape(len(self.owners), self.vocab_size)
        return self._host[self.owners == item]


class Engine:
    def __init__(self, session: Session, config: EngineConfig = EngineConfig()):
        self.session = session
        self.model = session.model
        self.tokenizer = session.tokenizer
        self.config = config
        self.max_model_len = config.max_model_len or session.max_model_len
        if self.max_model_len > session.max_model_len:
            raise VtoolError(f"max_model_len {self.max_model_len} is past the session's {session.max_model_len}")
        num_blocks = config.num_blocks or max(
            1, min(kv_memory_budget(self.model, config) // kv_bytes_per_block(self.model.manifest, config.block_size),
                   -(-self.max_model_len * config.max_num_seqs // config.block_size)))
        self.kv = PagedKVCache(self.model, num_blocks, config.block_size, config.max_num_seqs,
                               config.max_num_batched_tokens)
        capacity = self.kv.blocks.num_blocks * config.block_size
        if capacity < self.max_model_len:
            if config.max_model_len is not None:
                # As vLLM: one request at full context must fit, or preemption could never help it.
                raise VtoolError(
                    f"the KV cache holds {capacity} tokens ({self.kv.blocks.num_blocks} blocks of {config.block_size}), "
                    f"less than max_model_len={self.max_model_len}; raise --num-blocks or lower --max-model-len")
            log.warning("max_model_len lowered from %d to %d, what %d KV blocks of %d tokens hold",
                        self.max_model_len, capacity, self.kv.blocks.num_blocks, config.block_size)
            self.max_model_len = capacity
        self.prefix_cache = PrefixCache(self.kv.blocks) if config.enable_prefix_caching else None
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.scheduling_policy), self.kv, self.prefix_cache)
        self.requests: dict[str, Request] = {}
        self.counters = EngineCounters()
        self.vocab_size = self.model.vocab_size
        self._create_view = global_func("runtime.TVMTensorCreateView")
        self.device_sampler = self._make_device_sampler()

    def _make_device_sampler(self) -> DeviceSampler | None:
        """The library's sampling functions on a GPU (the full logits then stay there), or
        None: on the CPU the host sampler reads the logits in place anyway, and a library
        built without the functions samples on the host too."""
        if not self.config.device_sampling or not getattr(self.model, "on_gpu", False):
            return None
        try:
            return DeviceSampler(self.model)
        except VtoolError as err:
            log.warning("sampling on the host: %s", err)
            return None

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None) -> Request:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise RequestError("the prompt is empty: at least one token is needed")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        n_prompt = len(prompt_ids)
        if n_prompt >= self.max_model_len:
            raise RequestError(f"the prompt has {n_prompt} tokens, at or past max_model_len={self.max_model_len}; "
                               f"shorten it to at most {self.max_model_len - 1} tokens")
        capacity = self.kv.blocks.num_blocks * self.kv.block_size
        if n_prompt >= capacity:
            raise RequestError(f"the prompt has {n_prompt} tokens but the KV cache holds {capacity}")
        params.validate(self.vocab_size)
        request = Request(
            request_id=request_id, prompt_ids=list(prompt_ids), params=params,
            max_tokens=self._resolve_max_tokens(params.max_tokens, n_prompt),
            sampler=SequenceSampler(params, prompt_ids, self.session.stop_ids, self.vocab_size),
            detokenizer=self.tokenizer.incremental(params.skip_special_tokens, prompt_ids),
            stop_matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None,
            priority=priority, arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        self.requests[request_id] = request
        self.counters.prompt_tokens += n_prompt
        self.scheduler.add(request)
        return request

    def _resolve_max_tokens(self, max_tokens: int | None, n_prompt: int) -> int:
        room = self.max_model_len - n_prompt
        if max_tokens is None or max_tokens <= 0:
            ceiling = self.config.max_new_tokens_ceiling
            return min(room, ceiling) if ceiling else room
        if max_tokens > room:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} to generate)")
        return max_tokens

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.release(request)
        self._finish_counts("abort")
        request.status, request.finish_reason = Status.FINISHED, "abort"
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- one step --------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        if not plan.items:
            return []
        now = time.monotonic()
        for request, _ in plan.items:
            request.first_scheduled_time = request.first_scheduled_time or now
        logits = self._run_model(plan.items)
        self.counters.steps += 1
        ready: list[tuple[Request, int]] = []  # (request, index of its item)
        for i, (request, n) in enumerate(plan.items):
            in_prompt = max(0, min(request.num_computed + n, len(request.prompt_ids)) - request.num_computed)
            self.counters.computed_prefill_tokens += in_prompt if request.num_preemptions == 0 else 0
            if request.params.prompt_logprobs is not None and request.prompt_logprobs is None \
                    and logits.rows(i) is not None:
                self._collect_prompt_logits(request, n, logits.rows(i))
            request.num_computed += n
            if request.num_computed == request.num_tokens:
                ready.append((request, i))
        outputs = []
        if ready:
            samplers = [r.sampler for r, _ in ready]
            if (self.device_sampler is not None and logits.rows_are([i for _, i in ready])
                    and all(sequence_on_device(s) for s in samplers)):
                results = self.device_sampler.sample_batch(logits.tensor, samplers)
            else:
                results = sample_batch(np.stack([logits.rows(i)[-1] for _, i in ready]), samplers)
            for (request, _), result in zip(ready, results):
                outputs.append(self._advance(request, result))
        return outputs

    def _run_model(self, items: list[tuple[Request, int]]) -> StepLogits:
        """Run the batch; the logits of the rows the items need, left on the device."""
        m = self.model
        tokens: list[int] = []
        for request, n in items:
            tokens.extend(request.all_ids[request.num_computed: request.num_computed + n])
        seq_ids = [request.seq_id for request, _ in items]
        lengths = [n for _, n in items]
        flat = m.function("embed")(m.upload(np.asarray(tokens, dtype=np.int32), slot="ids"), m.params)
        self.kv.begin_forward(seq_ids, lengths)
        try:
            if all(n == 1 for n in lengths):
                embeds = self._create_view(flat, m.ffi.Shape([len(items), 1, m.hidden_size]), m.dtype, 0)
                # One sequence takes the static-shape `decode`: on CUDA it is a captured graph
                # of GEMV kernels, where batch_decode's symbolic batch runs uncaptured matmuls.
                entry = "decode" if len(items) == 1 else "batch_decode"
                logits, _ = m.function(entry)(embeds, self.kv.tvm, m.params)
                return StepLogits(m, logits, self.vocab_size, list(range(len(items))), len(items))
            positions, owners, offset = [], [], 0
            for i, (request, n) in enumerate(items):
                completes = request.num_computed + n == request.num_tokens
                wants_prompt = request.params.prompt_logprobs is not None and request.prompt_logprobs is None
                picked = range(offset, offset + n) if wants_prompt else (
                    [offset + n - 1] if completes else [])
                positions.extend(picked)
                owners.extend([i] * len(picked))
                offset += n
            if not positions:
                positions, owners = [offset - 1], [-1]  # the entry point needs one; its row is dropped
            embeds = self._create_view(flat, m.ffi.Shape([1, len(tokens), m.hidden_size]), m.dtype, 0)
            logits, _ = m.function("batch_prefill")(
                embeds, m.upload(np.asarray(positions, dtype=np.int32), slot="positions"), self.kv.tvm, m.params)
            return StepLogits(m, logits, self.vocab_size, owners, len(items))
        finally:
            self.kv.end_forward()

    def _collect_prompt_logits(self, request: Request, n: int, rows: np.ndarray) -> None:
        chunks = request.prompt_logit_chunks
        chunks.append(rows[: max(0, min(n, len(request.prompt_ids) - request.num_computed))])
        if request.num_computed + n >= len(request.prompt_ids):
            full = np.concatenate(chunks)[: len(request.prompt_ids)]
            request.prompt_logprobs = prompt_logprobs(full, request.prompt_ids, request.params.prompt_logprobs)
            chunks.clear()

    # -- after sampling --------------------------------------------------------------------
    def _advance(self, request: Request, result: Any) -> StepOutput:
        now = time.monotonic()
        token = result.token_id
        request.output_ids.append(token)
        request.cumulative_logprob += result.logprob
        new_logprobs = [result.logprobs_dict()] if request.params.logprobs is not None else []
        request.output_logprobs.extend(new_logprobs)
        request.first_token_time = request.first_token_time or now
        request.last_token_time = now
        self.counters.generation_tokens += 1

        stop_token = request.sampler.is_stop_token(token)
        text = "" if stop_token else request.detokenizer.push(token)  # a stop token's text is never shown
        finish, stop_reason = None, None
        if stop_token:
            finish = "stop"
            stop_reason = token if token in request.params.stop_token_ids else None  # eos reports None
        elif len(request.output_ids) >= request.max_tokens or request.num_tokens >= self.max_model_len:
            finish = "length"
        if finish is not None:
            text += request.detokenizer.flush()
        delta, matched = self._apply_stop_strings(request, text, final=finish is not None)
        if matched is not None:
            finish, stop_reason = "stop", matched
        if finish is not None:
            self._finish(request, finish, stop_reason)
        request.text += delta
        return StepOutput(
            request_id=request.request_id, new_token_ids=[token], new_text=delta, new_logprobs=new_logprobs,
            finished=finish is not None, finish_reason=finish, stop_reason=stop_reason,
            num_prompt_tokens=len(request.prompt_ids), num_output_tokens=len(request.output_ids),
            num_cached_tokens=request.cached_prompt_tokens,
            prompt_logprobs=request.prompt_logprobs if len(request.output_ids) == 1 else None,
            cumulative_logprob=request.cumulative_logprob)

    @staticmethod
    def _apply_stop_strings(request: Request, text: str, final: bool) -> tuple[str, str | None]:
        """(text to emit now, the stop string that ended the request or None). Text that
        may begin a stop string is held back until it cannot; stop strings only count
        once min_tokens are out, as in vLLM."""
        matcher = request.stop_matcher
        if matcher is None:
            return text, None
        if len(request.output_ids) < request.params.min_tokens:
            return text + (matcher.flush() if final else ""), None
        emitted, hit = matcher.push(text)
        if hit:
            return emitted, matcher.matched
        return emitted + (matcher.flush() if final else ""), None

    def _finish(self, request: Request, reason: str, stop_reason: str | int | None) -> None:
        request.status, request.finish_reason, request.stop_reason = Status.FINISHED, reason, stop_reason
        self.scheduler.release(request)
        self.requests.pop(request.request_id, None)
        self._finish_counts(reason)

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
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.kv_usage(), "num_blocks": self.kv.blocks.num_blocks,
            "block_size": self.kv.block_size, "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.prefix_cache.queries if self.prefix_cache else 0,
            "prefix_cache_hits": self.prefix_cache.hits if self.prefix_cache else 0,
            **dataclasses.asdict(self.counters),
        }
