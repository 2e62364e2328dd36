"""Prefix caching by hashing full blocks, on top of TVM's fork.

A finished (or preempted) sequence is not removed from the KV cache: it is kept as a
cache entry, indexed by the chained hash of each of its full blocks (a block's hash
covers every token before it, as in vLLM, so equal hashes mean equal prefixes). A new
prompt looks up the entry sharing its longest run of full blocks and is forked from
it, so only the rest of the prompt is computed. Entries are evicted least recently
used first when the scheduler needs their blocks.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Sequence

from vtool.runtime.engine.kv_blocks import KVBlockManager


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of `tokens`."""
    hashes, parent = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start:start + block_size]
        parent = hashlib.blake2b(parent + b"|" + ",".join(map(str, block)).encode(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


@dataclasses.dataclass
class CacheEntry:
    seq_id: int
    tokens: tuple[int, ...]  # the tokens whose K/V the sequence holds
    hashes: list[bytes]


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    seq_id: int  # the cached sequence to fork from
    num_tokens: int  # tokens whose K/V the fork reuses


class PrefixCache:
    def __init__(self, blocks: KVBlockManager):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self._entries: collections.OrderedDict[int, CacheEntry] = collections.OrderedDict()
        self._by_hash: dict[bytes, set[int]] = {}
        self.queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.hits = 0  # prompt tokens served from the cache (vllm:prefix_cache_hits)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._entries

    def entry_ids(self) -> list[int]:
        return list(self._entries)

    def insert(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Keep sequence seq_id (holding K/V for `tokens`) as a cache entry."""
        entry = CacheEntry(seq_id, tuple(tokens), block_hashes(tokens, self.block_size))
        self._entries[seq_id] = entry
        for h in entry.hashes:
            self._by_hash.setdefault(h, set()).add(seq_id)

    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The entry sharing the most full blocks with the prompt. At least one prompt
        token is always left to compute, since the next token needs its logits."""
        self.queries += len(prompt)
        best: PrefixHit | None = None
        candidates: set[int] | None = None
        for depth, h in enumerate(block_hashes(prompt, self.block_size)):
            holders = self._by_hash.get(h)
            if not holders:
                break
            candidates = holders if candidates is None else candidates & holders
            if not candidates:
                break
            best = PrefixHit(min(candidates), (depth + 1) * self.block_size)
        if best is None:
            return None
        usable = min(best.num_tokens, len(prompt) - 1)
        if usable <= 0:
            return None
        self._entries.move_to_end(best.seq_id)  # recently used
        self.hits += usable
        return PrefixHit(best.seq_id, usable)

    def pop_lru(self, exclude: int | None = None) -> int | None:
        """Forget the least recently used entry (other than `exclude`) and return its
        sequence id (the caller removes it from the KV cache), or None if there is none."""
        seq_id = next((s for s in self._entries if s != exclude), None)
        if seq_id is None:
            return None
        entry = self._entries.pop(seq_id)
        for h in entry.hashes:
            holders = self._by_hash[h]
            holders.discard(seq_id)
            if not holders:
                del self._by_hash[h]
        return seq_id

    def evictable_blocks(self) -> int:
        """Blocks held only by cache entries: free for the asking."""
        return self.blocks.exclusive_blocks(set(self._entries)) if self._entries else 0

    def clear(self) -> list[int]:
        """Forget every entry; returns their sequence ids for removal."""
        removed = []
        while (seq_id := self.pop_lru()) is not None:
            removed.append(seq_id)
        return removed
