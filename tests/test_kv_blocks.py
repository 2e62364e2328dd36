"""The block mirror and prefix cache: invariants under random operations, and agreement
with TVM's own paged KV cache on the same operations."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vtool.runtime.engine.kv_blocks import KVBlockManager, OutOfBlocks
from vtool.runtime.engine.prefix_cache import PrefixCache, block_hashes


class BlockMachine(RuleBasedStateMachine):
    """Random add / fork / append / remove; the books must always balance."""

    def __init__(self) -> None:
        super().__init__()
        self.m = KVBlockManager(num_blocks=24, block_size=4)
        self.next_id = 0

    def _seq(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.m.sequences())))

    @rule()
    def add(self) -> None:
        self.m.add(self.next_id)
        self.next_id += 1

    @precondition(lambda self: self.m.sequences())
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data, n) -> None:
        seq = self._seq(data)
        need = self.m.blocks_needed(seq, n)
        if need > self.m.num_free_blocks:
            with pytest.raises(OutOfBlocks):
                self.m.append(seq, n)
        else:
            before = self.m.num_free_blocks
            self.m.append(seq, n)
            assert self.m.num_free_blocks == before - need

    @precondition(lambda self: self.m.sequences())
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = self._seq(data)
        pos = data.draw(st.integers(0, self.m.length(parent)))
        if self.m.blocks_for_fork(pos) > self.m.num_free_blocks:
            return
        self.m.fork(parent, self.next_id, pos)
        shared = pos // self.m.block_size
        assert self.m.blocks_of(self.next_id)[:shared] == self.m.blocks_of(parent)[:shared]
        self.next_id += 1

    @precondition(lambda self: self.m.sequences())
    @rule(data=st.data(), n=st.integers(0, 9))
    def pop(self, data, n) -> None:
        seq = self._seq(data)
        length, blocks = self.m.length(seq), self.m.blocks_of(seq)
        n = min(n, length)
        start = (length - n) // self.m.block_size
        if n and any(self.m.ref_count(b) > 1 for b in blocks[start:]):
            with pytest.raises(ValueError, match="shares"):
                self.m.pop(seq, n)
            return
        before = self.m.num_free_blocks
        self.m.pop(seq, n)
        assert self.m.length(seq) == length - n
        assert self.m.num_free_blocks == before + len(blocks) - len(self.m.blocks_of(seq))

    @precondition(lambda self: self.m.sequences())
    @rule(data=st.data())
    def remove(self, data) -> None:
        seq = self._seq(data)
        freed = self.m.exclusive_blocks({seq})
        before = self.m.num_free_blocks
        self.m.remove(seq)
        assert self.m.num_free_blocks == before + freed

    @invariant()
    def books_balance(self) -> None:
        held: dict[int, int] = {}
        for seq in self.m.sequences():
            blocks = self.m.blocks_of(seq)
            assert len(blocks) == -(-self.m.length(seq) // self.m.block_size)
            for b in blocks:
                held[b] = held.get(b, 0) + 1
        for b, n in held.items():
            assert self.m.ref_count(b) == n
        assert len(held) + self.m.num_free_blocks == self.m.num_blocks


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(0, 7), max_size=40), st.lists(st.integers(0, 7), max_size=40), st.integers(1, 6))
def test_chained_hashes_equal_exactly_on_equal_prefixes(a, b, block_size):
    ha, hb = block_hashes(a, block_size), block_hashes(b, block_size)
    for i, (x, y) in enumerate(zip(ha, hb)):
        same_prefix = a[: (i + 1) * block_size] == b[: (i + 1) * block_size]
        assert (x == y) == same_prefix


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=6),
       st.lists(st.integers(0, 3), min_size=1, max_size=30))
def test_prefix_lookup_finds_the_longest_full_block_match(entries, prompt):
    blocks = KVBlockManager(200, 4)
    cache = PrefixCache(blocks)
    for i, tokens in enumerate(entries):
        blocks.add(i)
        blocks.append(i, len(tokens))
        cache.insert(i, tokens)
    hit = cache.lookup(prompt)

    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    best = max((common(t, prompt) // 4) * 4 for t in entries)
    want = min(best, len(prompt) - 1)
    if want <= 0:
        assert hit is None
    else:
        assert hit is not None and hit.num_tokens == want
        assert tuple(entries[hit.seq_id][:want]) == tuple(prompt[:want])


def test_eviction_is_least_recently_used_and_frees_only_unshared_blocks():
    blocks = KVBlockManager(16, 4)
    cache = PrefixCache(blocks)
    for seq in (0, 1):
        blocks.add(seq)
        blocks.append(seq, 8)
        cache.insert(seq, [seq] * 8)
    blocks.fork(1, 2, 4)  # a running sequence shares sequence 1's first block
    assert cache.evictable_blocks() == 2 + 1
    cache.lookup([0] * 8)  # 0 is now the most recently used
    assert cache.pop_lru() == 1
    blocks.remove(1)
    assert blocks.num_free_blocks == 16 - 2 - 1 - 0  # block shared with 2 stays held
    assert cache.pop_lru() == 0 and cache.pop_lru() is None


@pytest.fixture(scope="module")
def tiny_model(tiny_shape_dir):
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.toolchain.build import build_artifact

    folder = tiny_shape_dir("qwen3-qknorm")
    return CompiledModel(build_artifact(folder, "host"), open_checkpoint(folder))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["add", "fork", "feed", "pop", "remove"]), st.integers(0, 50),
                          st.integers(1, 40)),
                min_size=1, max_size=25))
def test_mirror_agrees_with_tvm(tiny_model, ops):
    """The same random operations on TVM's cache and on the mirror leave the same free-block count."""
    from vtool.runtime.engine.kv_cache import PagedKVCache

    # TVM's CPU attention kernels are compiled for 16-token pages (see PagedKVCache).
    kv = PagedKVCache(tiny_model, num_blocks=12, block_size=16, max_num_seqs=4, prefill_chunk=64)
    assert kv.in_sync()
    next_id = 0
    own_from: dict[int, int] = {}  # pops take back only tokens a sequence computed itself (speculation)
    for op, a, b in ops:
        live = kv.blocks.sequences()
        if op == "add" or not live:
            kv.add(next_id)
            own_from[next_id] = 0
            next_id += 1
        elif op == "fork":
            parent = live[a % len(live)]
            pos = b % (kv.blocks.length(parent) + 1)
            if kv.blocks.blocks_for_fork(pos) <= kv.blocks.num_free_blocks:
                kv.fork(parent, next_id, pos)
                own_from[next_id] = pos
                own_from[parent] = max(own_from[parent], kv.blocks.length(parent))  # its pages are shared now
                next_id += 1
        elif op == "pop":
            seq = live[a % len(live)]
            kv.pop(seq, min(b, kv.blocks.length(seq) - own_from[seq]))
        elif op == "feed":
            seq = live[a % len(live)]
            if kv.blocks.blocks_needed(seq, b) <= kv.blocks.num_free_blocks:
                embeds = tiny_model.upload(np.zeros((1, b, tiny_model.hidden_size), np.float32))
                kv.begin_forward([seq], [b])
                tiny_model.function("prefill")(embeds, kv.tvm, tiny_model.params)
                kv.end_forward()
        else:
            kv.remove(live[a % len(live)])
        assert kv.in_sync(), (op, a, b)
