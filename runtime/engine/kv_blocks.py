"""Block (page) accounting that mirrors TVM's paged KV cache.

TVM's cache owns the pages and shares them between sequences by fork: a child forked
at position p shares the parent's p // block_size full pages and, when p is not a
multiple of the block size, gets a private copy of the partial page. Removing a
sequence releases every page no other sequence holds. The scheduler must know, before
it runs a step, whether the pages that step needs exist; this mirror answers that in
Python, and the engine checks it against TVM's own free-page count.
"""
from __future__ import annotations


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

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """New blocks that appending num_tokens to seq_id takes."""
        length = self._lengths[seq_id]
        return self._ceil(length + num_tokens) - self._ceil(length)

    def blocks_for_fork(self, fork_pos: int) -> int:
        return 1 if fork_pos % self.block_size else 0

    # -- mutations (each mirrors one TVM call) --------------------------------------
    def add(self, seq_id: int) -> None:
        if seq_id in self._blocks:
            raise ValueError(f"sequence {seq_id} already exists")
        self._blocks[seq_id] = []
        self._lengths[seq_id] = 0

    def fork(self, parent: int, child: int, fork_pos: int) -> None:
        if child in self._blocks:
            raise ValueError(f"sequence {child} already exists")
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
        self._blocks[seq_id].extend(self._take() for _ in range(need))
        self._lengths[seq_id] += num_tokens

    def pop(self, seq_id: int, num_tokens: int) -> None:
        """Drop the sequence's last num_tokens (rejected speculative tokens); pages left empty
        go back unless another sequence holds them."""
        length = self._lengths[seq_id]
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
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
        del self._lengths[seq_id]

    # -- helpers ---------------------------------------------------------------------
    def _ceil(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _take(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def exclusive_blocks(self, seq_ids: set[int]) -> int:
        """Blocks that would become free if every sequence in seq_ids were removed."""
        held: dict[int, int] = {}
        for seq_id in seq_ids:
            for block in self._blocks[seq_id]:
                held[block] = held.get(block, 0) + 1
        return sum(1 for block, n in held.items() if n == self._refs[block])
