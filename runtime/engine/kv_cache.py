"""TVM's paged KV cache and its Python block mirror, changed together in one place."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from vtool import VtoolError
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.engine.kv_blocks import KVBlockManager
from vtool.runtime.artifact.tvm_runtime import global_func


# models/window_cache.py ENTRY: the build's cache-wide sliding-window KV cache (every layer windowed)
SLIDING_CACHE = "create_tir_sliding_kv_cache"


def sliding_window(model: CompiledModel) -> int:
    """The window of the model's sliding-window layers (0: none). TVM's paged KV cache masks
    the window over the cached keys only: within one step a sequence's new tokens attend to
    each other causally, so no sequence may feed more than this many tokens in one step
    (Generator and Scheduler chunk prompts by it), and the prefix cache stays off (attention
    over a forked prefix applies the window to each shared block apart).

    What is freed, and when. By default nothing before the sequence ends: the model's
    per-layer cache (create_tir_paged_kv_cache) holds every page of a sequence until it is
    removed. A model whose every layer is windowed (Mistral, Phi-3, Qwen2 with
    max_window_layers 0) is also built with SLIDING_CACHE (CPU and CUDA builds: models/window_cache.py),
    which engines and generators use by default where its attention kernels are vtool's
    parallel CPU ones (frees_window_by_default; EngineConfig.kv_window_freeing and
    Generator(free_window=...) say otherwise): after every step each sequence keeps its last
    window - 1 tokens (a query sees those and itself: the window) and every page wholly before
    them goes back, so a sequence holds at most ceil((window + 14) / 16) pages however long it
    runs. That cache cannot pop (speculative decoding's rejected drafts) or fork, so an engine
    with speculative decoding, and a draft model's own cache, keep the per-layer cache, as does
    every model with a global layer (Gemma-2/3, Qwen2 with max_window_layers > 0, OLMo-3): those
    layers attend to every token, so no page is ever outside every layer's window."""
    return int(model.manifest.get("config", {}).get("sliding_window") or 0)


def frees_window(model: CompiledModel) -> bool:
    """Whether the library has SLIDING_CACHE, the cache that frees what the window passed."""
    return SLIDING_CACHE in model.manifest.get("entry_points", ())


def frees_window_by_default(model: CompiledModel) -> bool:
    """Whether SLIDING_CACHE is used unless told otherwise: the library has it and its attention
    runs on vtool's parallel inline-rope CPU kernels (the manifest's window_freeing_kernels
    "parallel", schedules/cpu/rope_attention.py). Elsewhere it is used only when asked for: on
    TVM's serial CPU ones (head dims not a multiple of 16, or a CPU library built before vtool's
    kernels) a prompt of a 512-token window took over 100 times as long; on CUDA ("tvm-gpu":
    TVM's GPU kernels, rotating every key per query) prompts took 1.35x and decode steps
    1.3-1.7x the per-layer cache's time on the H200 (BENCHMARKS.md)."""
    return frees_window(model) and model.manifest.get("window_freeing_kernels") == "parallel"


def cache_layers(config: dict[str, Any], frees: bool = False) -> int:
    """The KV cache's layers for a manifest's config: the model's, and one more that no forward
    pass reaches when every layer is a sliding-window one (Mistral, Phi-3: TVM 0.27's cache
    allocates its q/k/v staging buffers only when some layer has full attention;
    models/decoder.py create_paged_kv_cache adds it), except in SLIDING_CACHE (`frees`), whose
    layers are all full-attention ones to TVM."""
    layers = int(config["num_hidden_layers"])
    windowed = config.get("sliding_window") and len(config.get("sliding_layers") or ()) == layers
    return layers + 1 if windowed and not frees else layers


def window_kept(model: CompiledModel) -> int:
    """The tokens each sequence of SLIDING_CACHE keeps after a step: window - 1 (the query
    itself is the window's last)."""
    return sliding_window(model) - 1


# TVM's TIR attention/append kernels are generated for 16-token pages (other sizes fail
# their buffer-shape checks at the first forward), so the block size is fixed to it.
SUPPORTED_BLOCK_SIZES = (16,)


class PagedKVCache:
    def __init__(self, model: CompiledModel, num_blocks: int, block_size: int, max_num_seqs: int,
                 prefill_chunk: int, free_window: bool = False):
        """free_window: use SLIDING_CACHE where the library has it (sliding_window() says what
        it frees); its sequences can be neither popped nor forked, so the default is the
        per-layer cache, which keeps every page."""
        if block_size not in SUPPORTED_BLOCK_SIZES:
            raise VtoolError(f"block size {block_size} is not supported; supported: {SUPPORTED_BLOCK_SIZES}")
        shape = model.ffi.Shape
        self.frees = free_window and frees_window(model)
        # tokens each sequence keeps (0: all); TVM adds 2 pages per sequence to this cache's count
        self.window = window_kept(model) if self.frees else 0
        sizes = [shape([max_num_seqs]), shape([num_blocks * block_size]), shape([prefill_chunk]), shape([block_size])]
        self.handle = model.function(SLIDING_CACHE)(*sizes) if self.frees else \
            model.function("create_tir_paged_kv_cache")(*sizes, shape([0]))
        self._f = {name: global_func(f"vm.builtin.{name}") for name in (
            "kv_state_add_sequence", "kv_state_remove_sequence", "kv_state_fork_sequence",
            "kv_state_begin_forward", "kv_state_end_forward", "kv_state_popn", "attention_kv_cache_get_num_available_pages",
            "attention_kv_cache_enable_sliding_window_for_seq")}
        self._shape = shape
        self._begin, self._end = self._f["kv_state_begin_forward"], self._f["kv_state_end_forward"]
        self._last_key: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # begin_forward's
        self._last_shapes: tuple[Any, Any] = ()
        self._held: list[int] | None = None  # holding_removals' sequences, while it holds
        self._cuda: Any = None  # fence_steps
        self._recorded = False
        self._fence_rows, self._rows = 1, 0  # fence_steps' min_rows; the rows of the step begun last
        self._step_rows = 0  # one_step's: the rows of a step run as several forwards
        self.max_num_seqs = max_num_seqs  # TVM sizes a step's arrays by it: no step may run more rows
        # TVM may round the page count up; the mirror starts from what TVM reports.
        self.blocks = KVBlockManager(self.tvm_free_blocks(), block_size)
        self.block_size = block_size

    def tvm_free_blocks(self) -> int:
        return int(self._f["attention_kv_cache_get_num_available_pages"](self.handle))

    def add(self, seq_id: int) -> None:
        self.blocks.add(seq_id, self.window)
        self._f["kv_state_add_sequence"](self.handle, seq_id)
        if self.window:  # keep the last `window` tokens, no attention sink
            self._f["attention_kv_cache_enable_sliding_window_for_seq"](self.handle, seq_id, self.window, 0)

    def fork(self, parent: int, child: int, fork_pos: int) -> None:
        if self.frees:
            raise VtoolError("the window-freeing KV cache cannot fork a sequence (TVM forks a slid sequence only "
                             "within its attention sink); the prefix cache is off for sliding-window models")
        self.blocks.fork(parent, child, fork_pos)
        self._f["kv_state_fork_sequence"](self.handle, parent, child, fork_pos)

    def remove(self, seq_id: int) -> None:
        if self._held is not None:
            self._held.append(seq_id)
            return
        self.blocks.remove(seq_id)
        self._f["kv_state_remove_sequence"](self.handle, seq_id)

    @contextlib.contextmanager
    def holding_removals(self) -> Iterator[None]:
        """Hold every remove() made inside until the end (mirror and TVM's cache alike): host
        work run beside a model call on another thread (engine/model_thread.py) may end requests,
        and TVM's cache must not change while that call runs its attention."""
        if self._held is not None:
            raise VtoolError("PagedKVCache.holding_removals does not nest")
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            for seq_id in held:
                self.remove(seq_id)

    def pop(self, seq_id: int, num_tokens: int) -> None:
        """Take back the sequence's last num_tokens (speculative tokens the target rejected)."""
        if num_tokens and self.frees:
            raise VtoolError("the window-freeing KV cache cannot take tokens back (the tokens its window slid out "
                             "for them are gone): speculative decoding runs on the per-layer cache "
                             "(PagedKVCache(free_window=False))")
        if num_tokens:
            self.blocks.pop(seq_id, num_tokens)
            self._f["kv_state_popn"](self.handle, seq_id, num_tokens)

    def fence_steps(self, cuda: Any, min_rows: int = 1) -> None:
        """Let a step be queued before the one before it has run (chained steps, on a GPU).

        Also between the two calls of a mixed step run split (mixed_steps.py): the second waits for
        the first (on an H200 the 8B shape's split steps died with an illegal address without it).

        TVM's cache copies a step's page tables and positions into one device buffer at the step's
        first attention call, from one page-locked host buffer, on a copy stream of its own that
        TVM creates non-blocking: the copy does not wait for the kernels already queued on the
        default stream. Steps queued only after the previous one is done never noticed; a step
        queued while the one before still runs would rewrite that buffer under the earlier step's
        attention kernels (an illegal address on the H200 once the shapes differ). So end_forward
        records an event behind the step's model work, and the next begin_forward waits for it:
        at most until the previous step's logits are computed, so its draw and the rest of this
        step's queueing still overlap. When the previous step was collected first (every step
        that is not chained), the event has fired long before, and begin_forward does not wait on it.
        min_rows: only steps of this many sequences or more record the event (a step queued early
        behind a smaller one is never made: the engine chains no step of fewer sequences; on an
        H100 the record cost a served one-sequence step ~0.2 ms of queueing, BENCHMARKS.md)."""
        if self._cuda is None:  # once: the runner (split mixed steps) and the engine (chained ones) both ask
            self._cuda = cuda
            self._model_done = cuda.event_create()
            self._recorded = False
        self._fence_rows = min_rows

    def may_queue_behind(self) -> bool:
        """Whether a step may be queued before the last one begun is collected: no fence is kept
        (steps queued after their predecessor's collection only), or that step recorded it."""
        return self._cuda is None or self._recorded

    def begin_forward(self, seq_ids: Sequence[int], lengths: Sequence[int], queued_early: bool = False) -> None:
        """queued_early: the step is queued before the previous one was collected (a chained step):
        with fence_steps, wait for the previous step's model work first. A step queued after the
        previous was collected skips the wait (that work is long done) and its ctypes call."""
        fenced = queued_early and self._cuda is not None
        if fenced and not self._recorded:
            raise VtoolError(f"a step queued before the previous one was collected, behind a step of fewer than "
                             f"{self._fence_rows} sequences that recorded no fence: that step may not be chained")
        for seq_id, n in zip(seq_ids, lengths):
            self.blocks.append(seq_id, n)
        # The last step's Shapes when the batch is the same (decode steps of the same sequences).
        key = (tuple(seq_ids), tuple(lengths))
        if key != self._last_key:
            self._last_key, self._last_shapes = key, (self._shape(list(key[0])), self._shape(list(key[1])))
        if fenced:
            self._cuda.event_synchronize(self._model_done)  # the previous step no longer reads TVM's buffers
        self._rows = len(seq_ids)
        self._begin(self.handle, *self._last_shapes)

    def end_forward(self) -> None:
        self._end(self.handle)
        if self._cuda is not None:
            self._recorded = (self._step_rows or self._rows) >= self._fence_rows
            if self._recorded:
                self._cuda.event_record(self._model_done)

    @contextlib.contextmanager
    def one_step(self, rows: int) -> Iterator[None]:
        """Forwards inside make one step of `rows` sequences (a mixed step run as two calls,
        mixed_steps.py): the fence's rule looks at the whole step, whose rows a chained step may
        follow, not at each forward's share."""
        self._step_rows = rows
        try:
            yield
        finally:
            self._step_rows = 0

    def in_sync(self) -> bool:
        """Whether the mirror agrees with TVM's own count (checked by the tests)."""
        return self.blocks.num_free_blocks == self.tvm_free_blocks()

    @property
    def tvm(self) -> Any:
        return self.handle
