"""TVM's paged KV cache and its Python block mirror, changed together in one place."""
from __future__ import annotations

from typing import Any, Sequence

from vtool import VtoolError
from vtool.runtime.artifact.library import CompiledModel
from vtool.runtime.engine.kv_blocks import KVBlockManager
from vtool.runtime.artifact.tvm_runtime import global_func


def sliding_window(model: CompiledModel) -> int:
    """The window of the model's sliding-window layers (0: none). TVM's paged KV cache masks
    the window over the cached keys only: within one step a sequence's new tokens attend to
    each other causally, so no sequence may feed more than this many tokens in one step
    (Generator and Scheduler chunk prompts by it), and the prefix cache stays off (attention
    over a forked prefix applies the window to each shared block apart)."""
    return int(model.manifest.get("config", {}).get("sliding_window") or 0)


def cache_layers(config: dict[str, Any]) -> int:
    """The KV cache's layers for a manifest's config: the model's, and one more that no forward
    pass reaches when every layer is a sliding-window one (Mistral, Phi-3: TVM 0.27's cache
    allocates its q/k/v staging buffers only when some layer has full attention;
    models/decoder.py create_paged_kv_cache adds it)."""
    layers = int(config["num_hidden_layers"])
    windowed = config.get("sliding_window") and len(config.get("sliding_layers") or ()) == layers
    return layers + 1 if windowed else layers


# TVM's TIR attention/append kernels are generated for 16-token pages (other sizes fail
# their buffer-shape checks at the first forward), so the block size is fixed to it.
SUPPORTED_BLOCK_SIZES = (16,)


class PagedKVCache:
    def __init__(self, model: CompiledModel, num_blocks: int, block_size: int, max_num_seqs: int,
                 prefill_chunk: int):
        if block_size not in SUPPORTED_BLOCK_SIZES:
            raise VtoolError(f"block size {block_size} is not supported; supported: {SUPPORTED_BLOCK_SIZES}")
        shape = model.ffi.Shape
        self.handle = model.function("create_tir_paged_kv_cache")(
            shape([max_num_seqs]), shape([num_blocks * block_size]), shape([prefill_chunk]), shape([block_size]),
            shape([0]))
        self._f = {name: global_func(f"vm.builtin.{name}") for name in (
            "kv_state_add_sequence", "kv_state_remove_sequence", "kv_state_fork_sequence",
            "kv_state_begin_forward", "kv_state_end_forward", "kv_state_popn", "attention_kv_cache_get_num_available_pages")}
        self._shape = shape
        self.max_num_seqs = max_num_seqs  # TVM sizes a step's arrays by it: no step may run more rows
        # TVM may round the page count up; the mirror starts from what TVM reports.
        self.blocks = KVBlockManager(self.tvm_free_blocks(), block_size)
        self.block_size = block_size

    def tvm_free_blocks(self) -> int:
        return int(self._f["attention_kv_cache_get_num_available_pages"](self.handle))

    def add(self, seq_id: int) -> None:
        self.blocks.add(seq_id)
        self._f["kv_state_add_sequence"](self.handle, seq_id)

    def fork(self, parent: int, child: int, fork_pos: int) -> None:
        self.blocks.fork(parent, child, fork_pos)
        self._f["kv_state_fork_sequence"](self.handle, parent, child, fork_pos)

    def remove(self, seq_id: int) -> None:
        self.blocks.remove(seq_id)
        self._f["kv_state_remove_sequence"](self.handle, seq_id)

    def pop(self, seq_id: int, num_tokens: int) -> None:
        """Take back the sequence's last num_tokens (speculative tokens the target rejected)."""
        if num_tokens:
            self.blocks.pop(seq_id, num_tokens)
            self._f["kv_state_popn"](self.handle, seq_id, num_tokens)

    def begin_forward(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> None:
        for seq_id, n in zip(seq_ids, lengths):
            self.blocks.append(seq_id, n)
        self._f["kv_state_begin_forward"](self.handle, self._shape(list(seq_ids)), self._shape(list(lengths)))

    def end_forward(self) -> None:
        self._f["kv_state_end_forward"](self.handle)

    def in_sync(self) -> bool:
        """Whether the mirror agrees with TVM's own count (checked by the tests)."""
        return self.blocks.num_free_blocks == self.tvm_free_blocks()

    @property
    def tvm(self) -> Any:
        return self.handle
