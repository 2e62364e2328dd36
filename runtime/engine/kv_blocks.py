"""Block (page) accounting that mirrors TVM's paged KV cache.

TVM's cache owns the pages and shares them between sequences by fork: a child forked
at position p shares the parent's p // block_size full pages and, when p is not a
multiple of the block size, gets a private copy of the partial page. Removing a
sequence releases every page no other sequence holds. The scheduler must know, before
it runs a step, whether the pages that step needs exist; this mirror answers that in
Python, and the engine checks it against TVM's own free-page count.

A windowed sequence (`add(seq_id, window=S)`: TVM's cache-wide sliding window, models/
window_cache.py) keeps only its last S tokens: after each append, the pages wholly before
them go back (TVM's SlideWindowForSequence, sink 0). Its pages cover the token positions from
B * floor((length - S) / B) on (B: the block size), so it holds ceil(length / B) -
floor((length - S) / B) of them (`window_blocks` at most). Within a step TVM borrows placeholder pages when none is
free and fills them from what the step's slide gave back, so an append needs only the pages
the sequence holds more afterwards. Such a sequence cannot be popped or forked (TVM cannot
bring back tokens slid out).
"""
from __future__ import annotations


def blocks_for_window(window: int, block_size: int) -> int:
    """The most blocks a sequence keeping its last `window` tokens ever holds after a step:
    ceil((window + block_size - 1) / block_size) (the window starting anywhere in a block)."""
    return -(-(window + block_size - 1) // block_size)


class OutOfBlocks(RuntimeError):
    """A step asked for more blocks than are free (a scheduler bug if it escapes)."""


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives the lowest id
        self._blocks: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._windows: dict[int, int] = {}  # windowed sequences -> the tokens they keep

    # -- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._blocks

    def length(self, seq_id: int) -> int:
        return self._lengths[seq_id]

    def blocks_of(self, seq_id: int) -> list[int]:
        return list(self._blocks[seq_id])

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def sequences(self) -> list[int]:
        return list(self._blocks)

    def window(self, seq_id: int) -> int:
        """The tokens a windowed sequence keeps; 0: it keeps all."""
        return self._windows.get(seq_id, 0)

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """New blocks that appending num_tokens to seq_id takes (for a windowed sequence: the
        blocks it holds more afterwards, never below 0)."""
        length = self._lengths[seq_id]
        if seq_id in self._windows:
            return max(0, self._held(length + num_tokens, self._windows[seq_id]) - len(self._blocks[seq_id]))
        return self._ceil(length + num_tokens) - self._ceil(length)

    def blocks_for_fork(self, fork_pos: int) -> int:
        return 1 if fork_pos % self.block_size else 0

    def window_blocks(self, window: int) -> int:
        """The most blocks a sequence keeping `window` tokens ever holds (blocks_for_window)."""
        return blocks_for_window(window, self.block_size)

    # -- mutations (each mirrors one TVM call) --------------------------------------
    def add(self, seq_id: int, window: int = 0) -> None:
        """window > 0: the sequence keeps only its last `window` tokens (TVM's
        attention_kv_cache_enable_sliding_window_for_seq with that size and sink 0)."""
        if seq_id in self._blocks:
            raise ValueError(f"sequence {seq_id} already exists")
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self._blocks[seq_id] = []
        self._lengths[seq_id] = 0
        if window:
            self._windows[seq_id] = window

    def fork(self, parent: int, child: int, fork_pos: int) -> None:
        if child in self._blocks:
            raise ValueError(f"sequence {child} already exists")
        if parent in self._windows:
            raise ValueError(f"sequence {parent} keeps a sliding window: TVM forks it only within its attention "
                             "sink, which is empty")
        if not 0 <= fork_pos <= self._lengths[parent]:
            raise ValueError(f"fork position {fork_pos} outside sequence {parent} of length {self._lengths[parent]}")
        full, partial = divmod(fork_pos, self.block_size)
        if partial and not self._free:
            raise OutOfBlocks("no free block for the partial page a fork copies")
        shared = self._blocks[parent][:full]
        for block in shared:
            self._refs[block] += 1
        self._blocks[child] = shared + ([self._take()] if partial else [])
        self._lengths[child] = fork_pos

    def append(self, seq_id: int, num_tokens: int) -> None:
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise OutOfBlocks(f"sequence {seq_id} needs {need} blocks, {len(self._free)} free")
        if seq_id in self._windows:
            self._append_windowed(seq_id, num_tokens)
            return
        self._blocks[seq_id].extend(self._take() for _ in range(need))
        self._lengths[seq_id] += num_tokens

    def _append_windowed(self, seq_id: int, num_tokens: int) -> None:
        """TVM's ReserveAppendLengthInSeq then SlideWindowForSequence: the new pages (placeholders,
        -1, where none is free), the pages wholly before the window released, then the
        placeholders filled."""
        length, window, blocks = self._lengths[seq_id], self._windows[seq_id], self._blocks[seq_id]
        for _ in range(self._ceil(length + num_tokens) - self._ceil(length)):
            blocks.append(self._take() if self._free else -1)
        drop = len(blocks) - self._held(length + num_tokens, window)
        for block in blocks[:drop]:
            if block >= 0:
                self._release(block)
        del blocks[:drop]
        blocks[:] = [block if block >= 0 else self._take() for block in blocks]
        self._lengths[seq_id] = length + num_tokens

    def pop(self, seq_id: int, num_tokens: int) -> None:
        """Drop the sequence's last num_tokens (rejected speculative tokens); pages left empty
        go back unless another sequence holds them."""
        length = self._lengths[seq_id]
        if num_tokens and seq_id in self._windows:
            raise ValueError(f"cannot pop tokens of sequence {seq_id}: it keeps a sliding window, and the tokens "
                             "it slid out for them do not come back")
        if not 0 <= num_tokens <= length:
            raise ValueError(f"cannot pop {num_tokens} tokens from sequence {seq_id} of length {length}")
        keep = self._ceil(length - num_tokens)
        blocks = self._blocks[seq_id]
        first_touched = (length - num_tokens) // self.block_size
        if num_tokens and any(self._refs[b] > 1 for b in blocks[first_touched:]):
            # TVM re-forks such a sequence; the engine only ever pops tokens it appended itself.
            raise ValueError(f"cannot pop {num_tokens} tokens of sequence {seq_id}: they reach a page it shares")
        for block in blocks[keep:]:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
        del blocks[keep:]
        self._lengths[seq_id] = length - num_tokens

    def remove(self, seq_id: int) -> None:
        for block in self._blocks.pop(seq_id):
            self._release(block)
        del self._lengths[seq_id]
        self._windows.pop(seq_id, None)

    # -- helpers ---------------------------------------------------------------------
    def _ceil(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _take(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def _held(self, length: int, window: int) -> int:
        """Blocks a sequence of `length` tokens keeping the last `window` holds: those of
        the positions from block_size * floor((length - window) / block_size) on."""
        return self._ceil(length) - max(0, length - window) // self.block_size

    def exclusive_blocks(self, seq_ids: set[int]) -> int:
        """Blocks that would become free if every sequence in seq_ids were removed."""
        held: dict[int, int] = {}
        for seq_id in seq_ids:
            for block in self._blocks[seq_id]:
                held[block] = held.get(block, 0) + 1
        return sum(1 for block, n in held.items() if n == self._refs[block])
