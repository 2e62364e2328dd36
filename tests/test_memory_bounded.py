"""Memory stays bounded when every step has a new shape (issue #13, the short form of
tests/bench/soak.py).

Under load almost every engine step runs `batch_prefill` over a packed token count it has not
seen before. The Relax VM sizes that function's intermediates by the count and takes their
storage from the allocator the library was initialised with; TVM's pooled allocator keeps each
freed buffer for reuse at exactly its page-rounded size and never releases it, so each new
count added its intermediates to the process for good (the default model's server grew by
about 31 KB per token of each new count, without bound). Here the tiny model's 16 sequences
make steps of 1,200 to 3,550 packed tokens, each count new; with the pool that keeps them, the
48 steps after warm-up left 246 MB behind (about 2 KB a token); without it, 3 to 7 MB.
"""
from __future__ import annotations

import gc
import random
import re
from pathlib import Path

from vtool.runtime.sampling.params import SamplingParams

BATCH = 16  # sequences packed into one batch_prefill step
GROWTH_LIMIT_MB = 32


def rss_mb() -> float:
    gc.collect()
    return int(re.search(r"^VmRSS:\s+(\d+)", Path("/proc/self/status").read_text(), re.MULTILINE).group(1)) / 1024


def prefill_step(engine, lengths: list[int], rng: random.Random, tag: str) -> tuple[int, int]:
    """Admit one request per length (max_tokens 1) and run them to the end: one batch_prefill
    over all the prompts packed. Returns (steps run, prompt tokens computed)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, n in enumerate(lengths):
        engine.add_request(f"{tag}-{i}", [rng.randrange(100, 30000) for _ in range(n)], params)
    steps, computed = engine.counters.steps, engine.counters.computed_prefill_tokens
    while engine.has_unfinished():
        engine.step()
    return engine.counters.steps - steps, engine.counters.computed_prefill_tokens - computed


def lengths_for(total: int) -> list[int]:
    """BATCH prompt lengths summing to `total`."""
    base, extra = divmod(total, BATCH)
    return [base + (1 if i < extra else 0) for i in range(BATCH)]


def test_rss_stays_bounded_over_steps_of_new_token_counts(tiny_engine):
    engine = tiny_engine(max_num_seqs=BATCH, max_num_batched_tokens=BATCH * 240, enable_prefix_caching=False)
    rng = random.Random(0)
    # Warm-up: the largest step and a few others, so that malloc's heap has reached the high-water
    # mark of one step's transient buffers before the baseline.
    for total in (BATCH * 240, 1000, BATCH * 240 - 7, 2000):
        prefill_step(engine, lengths_for(total), rng, f"warm{total}")
    before = rss_mb()
    # 48 steps, each a packed count never run before, 50 tokens apart: every intermediate's
    # page-rounded size is new each time.
    totals = list(range(1200, 1200 + 48 * 50, 50))
    rng.shuffle(totals)
    seen = [prefill_step(engine, lengths_for(total), rng, f"s{total}") for total in totals]
    after = rss_mb()
    assert seen == [(1, total) for total in totals]  # one step each, packing the count it was made for
    assert engine.kv.in_sync() and engine.kv.blocks.num_free_blocks == engine.kv.blocks.num_blocks
    assert after - before < GROWTH_LIMIT_MB, (
        f"RSS grew {after - before:.0f} MB ({before:.0f} -> {after:.0f} MB) over {len(totals)} steps of new packed "
        f"token counts ({sum(totals)} tokens in all): buffers of each step's size are being kept")
