"""Batched token sampling with vLLM's semantics; every row of a batch is its own request.

Per row, in vLLM's order: logit_bias, min_tokens masking of eos/stop ids, repetition
penalty (prompt + output tokens), frequency/presence penalties (output tokens only);
then greedy rows take the argmax, and random rows divide by the temperature, apply
min_p, top_k, top_p, and draw with the request's own numpy Generator.

Reported logprobs follow vLLM's default logprobs_mode "raw_logprobs": the log-softmax
of the model's logits before any of the processing above.

A request's draw depends only on its logits row, its own history and its own Generator
(one uniform per random step): each row is processed on its own, never with batch-wide
reductions, so batch composition and size cannot change a seeded request's tokens.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from vtool import VtoolError
from vtool.runtime.sampling.bitmask_batch import prefill_grammars
from vtool.runtime.sampling.logits_processors import LogitsProcessor
from vtool.runtime.sampling.params import SamplingParams, check_token_ids

# Unseeded requests draw their streams from one process-level SeedSequence, so two of
# them never share a stream; spawn() mutates it, hence the lock.
_ROOT_SEEDS = np.random.SeedSequence()
_ROOT_LOCK = threading.Lock()


def make_generator(seed: int | None) -> np.random.Generator:
    if seed is None:
        with _ROOT_LOCK:
            child = _ROOT_SEEDS.spawn(1)[0]
        return np.random.Generator(np.random.PCG64(child))
    # torch accepts negative seeds; numpy does not: use the two's-complement bits.
    return np.random.Generator(np.random.PCG64(seed % 2**64))


@dataclasses.dataclass
class Logprob:
    """vLLM's Logprob: one entry of a {token_id: Logprob} dict."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class SampleResult:
    token_id: int
    # The raw log-softmax of the chosen token; None when the request asked for no logprobs:
    # its logsumexp is a pass over the vocabulary that nobody would read (vLLM v1 reports
    # cumulative_logprob None then). The device sampler has it for free and always sets it.
    logprob: float | None
    rank: int | None = None  # vLLM's: tokens with a logprob >= the chosen one's; with logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # top-N, descending; when params.logprobs is set

    def logprobs_dict(self) -> dict[int, Logprob] | None:
        """vLLM's per-position dict: the chosen token first, then the top-N with ranks 1..N
        (a chosen token inside the top-N takes its top-N rank, as vLLM's dict build does)."""
        if self.top_logprobs is None:
            return None
        out = {self.token_id: Logprob(self.logprob, self.rank)}
        for rank, (token, lp) in enumerate(self.top_logprobs, start=1):
            out[token] = Logprob(lp, rank)
        return out


class EditLists(NamedTuple):
    """process_logits' edits of one row at this step, as token ids and float32 values in the
    order it applies them (processors aside): what the device applies instead
    (schedules/cuda/logit_edits.py). Ids are unique within each list."""

    bias_ids: np.ndarray  # int64: x += bias
    bias: np.ndarray  # float32
    mask_ids: np.ndarray  # int64: x = -inf (eos / stop ids while min_tokens are not out)
    repetition_ids: np.ndarray  # int64: x / r where x > 0, else x * r
    repetition: np.float32
    penalty_ids: np.ndarray  # int64: (x - frequency * count) - presence
    frequency: np.ndarray  # float32: frequency_penalty * count, the product as the host rounds it
    presence: np.float32


class SequenceSampler:
    """The sampling state of one sequence: params, Generator, prompt and output tokens."""

    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int] = (),
                 eos_token_ids: Iterable[int] | int | None = None, vocab_size: int | None = None,
                 logits_processors: Sequence[LogitsProcessor] = ()):
        self.params = params
        self.logits_processors = tuple(logits_processors)
        self.rng = make_generator(params.seed)
        self.prompt_token_ids = np.asarray(prompt_token_ids, dtype=np.int64).reshape(-1)
        self.output_token_ids: list[int] = []
        # What the penalties read, kept only for a request that has them (append_token is on
        # every decode step's path): the output tokens' counts (frequency/presence), and the
        # token ids the repetition penalty touches (prompt + output), as a set and an array.
        self._track_counts = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        self._track_seen = params.repetition_penalty != 1.0
        self._counts: dict[int, int] = {}
        self._seen = set(self.prompt_token_ids.tolist()) if self._track_seen else set()
        self._seen_ids = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
        if eos_token_ids is None:
            eos_token_ids = ()
        elif isinstance(eos_token_ids, (int, np.integer)):
            eos_token_ids = (int(eos_token_ids),)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        # vLLM's all_stop_token_ids: eos is masked under min_tokens even with ignore_eos.
        self._min_tokens_ids = np.array(sorted(set(params.stop_token_ids) | self.eos_token_ids), dtype=np.int64)
        self._stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        bias = params.logit_bias or {}
        self._bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self._bias_values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        self.vocab_size: int | None = None
        if vocab_size is not None:
            self._check_vocab(vocab_size)
        else:
            params.validate()

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        """Record a generated token (sample_batch does this for the tokens it draws)."""
        token_id = int(token_id)
        for processor in self.logits_processors:
            processor.accept(token_id)
        self.output_token_ids.append(token_id)
        if self._track_counts:
            self._counts[token_id] = self._counts.get(token_id, 0) + 1
        if self._track_seen and token_id not in self._seen:
            self._seen.add(token_id)
            self._seen_ids = np.append(self._seen_ids, token_id)

    def is_stop_token(self, token_id: int) -> bool:
        """Whether this just-generated (and recorded) token finishes the sequence: eos unless
        ignore_eos, or one of stop_token_ids, once min_tokens are out, as vLLM checks."""
        return self.num_generated >= self.params.min_tokens and int(token_id) in self._stop_ids

    def _check_vocab(self, vocab_size: int) -> None:
        if self.vocab_size == vocab_size:
            return
        self.params.validate(vocab_size)
        check_token_ids(self.prompt_token_ids, vocab_size, "prompt token id")
        self.vocab_size = vocab_size

    def needs_processing(self) -> bool:
        """Whether process_logits would change anything now (else the raw row is the one to
        choose from, and a greedy row needs no copy of it)."""
        p = self.params
        return bool(self.logits_processors or self._bias_ids.size
                    or (len(self.output_token_ids) < p.min_tokens and self._min_tokens_ids.size)
                    or (self._track_seen and self._seen) or (self._track_counts and self._counts))

    @property
    def has_edits(self) -> bool:
        """Whether edit_lists has anything at this step (cheap: read on every device draw)."""
        return bool(self._bias_ids.size or (self._track_seen and self._seen) or (self._track_counts and self._counts)
                    or (self.num_generated < self.params.min_tokens and self._min_tokens_ids.size))

    @property
    def edits_follow_tokens(self) -> bool:
        """Whether this row's edits change with each drawn token (penalties, min_tokens): its
        next step cannot be prepared before this step's token is known."""
        p = self.params
        return self._track_seen or self._track_counts or p.min_tokens > 0

    def edit_lists(self) -> EditLists:
        """The edits process_logits makes at this step besides its logits processors."""
        p = self.params
        none = np.zeros(0, np.int64)
        mask = (self._min_tokens_ids if self.num_generated < p.min_tokens and self._min_tokens_ids.size else none)
        seen = self._seen_ids if self._track_seen and self._seen else none
        if self._track_counts and self._counts:
            penalty_ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
            counts = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
            frequency = np.float32(p.frequency_penalty) * counts
        else:
            penalty_ids, frequency = none, np.zeros(0, np.float32)
        return EditLists(self._bias_ids, self._bias_values, mask, seen, np.float32(p.repetition_penalty),
                         penalty_ids, frequency, np.float32(p.presence_penalty))

    def process_logits(self, raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The logits the choice is made from, before temperature (float32; into `out` if given)."""
        p = self.params
        if out is None:
            x = np.array(raw, dtype=np.float32, copy=True)
        else:
            x = out
            np.copyto(x, raw)
        for processor in self.logits_processors:
            processor.apply(x, self.output_token_ids)
        if self._bias_ids.size:
            x[self._bias_ids] += self._bias_values
        if self.num_generated < p.min_tokens and self._min_tokens_ids.size:
            x[self._min_tokens_ids] = -np.inf
        if self._track_seen and self._seen:
            seen = self._seen_ids
            # vLLM: positive logits are divided by the penalty, the others multiplied.
            penalty = np.float32(p.repetition_penalty)
            v = x[seen]
            x[seen] = np.where(v > 0, v / penalty, v * penalty)
        if self._track_counts and self._counts:
            ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
            counts = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
            # OpenAI's definition, two steps as in vLLM's apply_penalties.
            x[ids] -= np.float32(p.frequency_penalty) * counts
            x[ids] -= np.float32(p.presence_penalty)
        return x


class _Scratch:
    """Vocabulary-sized work buffers, reused row after row: fresh 0.6 MB temporaries each
    cost page faults that outweigh the arithmetic. Every row overwrites what it reads."""

    def __init__(self, vocab: int):
        self.x = np.empty(vocab, np.float32)  # processed logits
        self.e = np.empty(vocab, np.float32)  # unnormalised probabilities
        self.g = np.empty(vocab, np.float32)
        self.bucket = np.empty(vocab, np.intp)
        self.mask = np.empty(vocab, bool)
        self.vocab = vocab


_SCRATCH = threading.local()  # one set of buffers per thread (the engine's, a Generator's)


def scratch_buffers(vocab: int) -> _Scratch:
    s = getattr(_SCRATCH, "buffers", None)
    if s is None or s.vocab != vocab:
        s = _SCRATCH.buffers = _Scratch(vocab)
    return s


def sample_batch(logits: np.ndarray, seqs: Sequence[SequenceSampler]) -> list[SampleResult]:
    """One token per row of `logits` [B, V]; row i belongs to seqs[i], which records the token."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[0] != len(seqs):
        raise VtoolError(f"sample_batch needs logits of shape [{len(seqs)}, vocab] for {len(seqs)} "
                         f"sequences, got {logits.shape}")
    vocab = logits.shape[1]
    scratch = scratch_buffers(vocab)
    if sum(1 for seq in seqs if seq.logits_processors) > 1:
        # Every grammar row's mask in one parallel call, before the rows' apply() (which then
        # uses it); a lone grammar computes its own.
        prefill_grammars([seq.logits_processors for seq in seqs])
    results = []
    for i, seq in enumerate(seqs):
        seq._check_vocab(vocab)
        raw = np.ascontiguousarray(logits[i], dtype=np.float32)  # a view when it is already so
        if seq.params.greedy and not seq.needs_processing():
            # The plain greedy row: one pass finds the token and the maximum together (NaN
            # is found first by argmax, so it is refused below as before).
            token = int(raw.argmax())
            raw_max = raw[token]
            if not math.isfinite(raw_max):
                raise VtoolError(f"logits row {i} has no finite maximum ({raw_max}): the model produced NaN/inf")
            seq.append_token(token)
            results.append(raw_logprobs(raw, raw_max, token, seq.params.logprobs, scratch))
            continue
        raw_max = raw.max()
        if not np.isfinite(raw_max):
            raise VtoolError(f"logits row {i} has no finite maximum ({raw_max}): the model produced NaN/inf")
        lse = None
        if seq.params.greedy:
            x = seq.process_logits(raw, out=scratch.x)
            token = int(np.argmax(x))
            if not np.isfinite(x[token]):
                raise VtoolError(f"row {i}: every token is masked (min_tokens/stop ids cover the vocabulary)")
        elif seq.needs_processing():
            token, _ = _sample_filtered(seq.process_logits(raw, out=scratch.x), seq.params, seq.rng, scratch, i)
        else:  # nothing edits the row: the temperature is applied while copying it
            x, m = _scaled_copy(raw, raw_max, seq.params, scratch)
            token, lse = _sample_filtered(x, seq.params, seq.rng, scratch, i, scaled_max=m,
                                          want_lse=seq.params.logprobs is not None)
        seq.append_token(token)
        results.append(raw_logprobs(raw, raw_max, token, seq.params.logprobs, scratch, lse))
    return results


def _scaled_copy(raw: np.ndarray, raw_max: np.float32, p: SamplingParams, s: _Scratch) -> tuple[np.ndarray, np.float32]:
    """(raw / T in the scratch, or raw itself at T = 1, and its maximum): what process_logits'
    copy divided in place by filtered_weights, and that copy's max(), come to, in one pass
    instead of three (none at T = 1: the filtering only reads a prescaled row). The maximum
    is the raw one divided: division by T > 0 keeps the order and rounding is monotonic, so the
    largest quotient is the largest logit's."""
    t = np.float32(p.sampling_temperature)
    if t == 1:  # division by 1 is exact
        return raw, raw_max
    return np.divide(raw, t, out=s.x), raw_max / t


def _sample_filtered(x: np.ndarray, p: SamplingParams, rng: np.random.Generator, s: _Scratch,
                     row: int, scaled_max: np.float32 | None = None,
                     want_lse: bool = False) -> tuple[int, float | None]:
    """Temperature, min_p, top_k, top_p, then one inverse-CDF draw (one uniform per step):
    (the token, and the raw row's logsumexp when the filtering computed it on the way, or
    could with one sum and `want_lse` asks for it; None otherwise). `x` is a private copy and
    is scaled in place (scaled_max given: it is scaled already, and that is its maximum, and it
    is only read: it may be the raw row itself)."""
    u = rng.random()  # drawn first and always: the stream advances by one per random step
    # At temperature 1 a prescaled x is the raw row itself (division by 1 is exact), so the
    # weights before any cut are exp(raw - max): their float64 sum gives the logsumexp that
    # raw_logprobs would compute from the same values.
    raw_row = scaled_max is not None and p.sampling_temperature == 1.0
    idx, w, total = _filtered(x, p, s, row, scaled_max, want_total=raw_row and want_lse)
    lse = float(scaled_max) + float(np.log(total)) if raw_row and total is not None else None
    token = draw_index(w, u)
    return (token if idx is None else int(idx[token])), lse


def filtered_weights(x: np.ndarray, p: SamplingParams, s: _Scratch, row: int = 0) -> tuple[np.ndarray | None, np.ndarray]:
    """The unnormalised probabilities a random row draws from: temperature, min_p, top_k,
    top_p applied to the processed logits `x` (a private copy, scaled in place). (None, w)
    with w over the whole vocabulary (the scratch buffer: read it before the next row), or
    (idx, w) over the kept token ids `idx` when top_k cut the vocabulary first."""
    idx, w, _ = _filtered(x, p, s, row)
    return idx, w


def _filtered(x: np.ndarray, p: SamplingParams, s: _Scratch, row: int = 0, scaled_max: np.float32 | None = None,
              want_total: bool = False) -> tuple[np.ndarray | None, np.ndarray, np.float64 | None]:
    """filtered_weights, and the float64 sum of exp(x - max) over the whole vocabulary
    (e.sum(dtype=float64), before min_p or top_p cut anything) when top_p computed it, or when
    asked for (want_total) and no min_p or top_k applies; else None. scaled_max: x is divided
    by the temperature already and this is its maximum."""
    if scaled_max is None:
        x /= np.float32(p.sampling_temperature)
        m = x.max()
    else:
        m = scaled_max
    if not np.isfinite(m):
        raise VtoolError(f"row {row}: every token is masked (min_tokens/stop ids cover the vocabulary)")
    if 0 < p.top_k < x.size:
        # min_p and top_k both keep a top set of the same ranking, so their order does not
        # matter: take the top-k first and work on those few tokens only.
        idx = _top_k_indices(x, m, p.top_k, s)
        xs = x[idx]
        w = np.exp(xs - m)  # unnormalised probabilities; the maximum is exactly 1
        if p.min_p > 0.0:
            keep = w >= np.float32(p.min_p)
            idx, xs, w = idx[keep], xs[keep], w[keep]
        if p.top_p < 1.0:
            keep = _nucleus_sorted(xs, w, p.top_p)
            idx, w = idx[keep], w[keep]
        return idx, w, None
    e = s.e
    np.subtract(x, m, out=e)
    np.exp(e, out=e)  # unnormalised probabilities; the maximum is exactly 1
    if p.min_p > 0.0:
        # vLLM keeps prob >= min_p * max_prob; with the max at 1 that is e >= min_p.
        np.copyto(e, 0.0, where=np.less(e, np.float32(p.min_p), out=s.mask))
    total = None
    if p.top_p < 1.0:
        total = _nucleus_dense(x, m, e, p.top_p, s)
    elif want_total and p.min_p <= 0.0:
        total = e.sum(dtype=np.float64)
    if p.min_p > 0.0:
        total = None  # the sum of what min_p left
    return None, e, total


def target_probs(x: np.ndarray, p: SamplingParams, s: _Scratch, row: int = 0) -> np.ndarray:
    """filtered_weights as a dense, normalised float64 distribution over the vocabulary
    (what speculative verification compares a draft against)."""
    idx, w = filtered_weights(x, p, s, row)
    if idx is None:
        out = w.astype(np.float64)
    else:
        out = np.zeros(x.size, np.float64)
        out[idx] = w
    return out / out.sum()


def _top_k_indices(x: np.ndarray, m: np.float32, k: int, s: _Scratch) -> np.ndarray:
    """Indices of logits >= the k-th largest, ascending: vLLM keeps ties at the cut.

    Bisect a threshold until a few times k tokens clear it (each step one cheap counting
    pass), then select exactly among those: a full partition of 150k logits costs more.
    """
    lo, hi = np.float32(-np.inf), m  # count(x >= lo) >= k; count(x >= hi) may be < k
    finite = x[np.isfinite(x)] if not np.isfinite(x.min()) else x
    if finite.size > k:
        lo = finite.min()
        for _ in range(40):
            mid = np.float32(lo + (hi - lo) / 2)
            if not lo < mid < hi:
                break
            count = np.count_nonzero(np.greater_equal(x, mid, out=s.mask))
            if count < k:
                hi = mid
            else:
                lo = mid
                if count <= 4 * k:
                    break
    cand = np.flatnonzero(np.greater_equal(x, lo, out=s.mask))
    values = x[cand]
    kth = np.partition(values, values.size - k)[values.size - k] if values.size > k else values.min()
    return cand[values >= kth]


def _nucleus_sorted(xs: np.ndarray, w: np.ndarray, top_p: float) -> np.ndarray:
    """Mask of the tokens whose heavier-tokens mass is < top_p of the total. vLLM masks the
    tokens whose ascending cumulative probability is <= 1 - top_p: the same set. Ordered by
    logit, as vLLM sorts logits (distinct logits can round to one float32 weight)."""
    order = np.argsort(-xs, kind="stable")
    ws = w[order].astype(np.float64)
    before = np.cumsum(ws) - ws
    keep = np.zeros(xs.size, dtype=bool)
    keep[order[before < top_p * ws.sum()]] = True
    return keep


_NUCLEUS_BINS = 8192
_EXP_UNDERFLOW = 104.0  # exp(-d) is 0 in float32 beyond this: such tokens weigh nothing


def _nucleus_dense(x: np.ndarray, m: np.float32, e: np.ndarray, top_p: float, s: _Scratch) -> np.float64 | None:
    """_nucleus_sorted over the whole vocabulary, zeroing the cut weights of `e` in place,
    without sorting it: bucket tokens by logit, find the bucket where the heavier mass
    crosses top_p, and sort only that bucket (_nucleus_head: looking at the first buckets'
    tokens only, when the mass crosses there). Returns the float64 sum of e before the cut
    (None for a vocabulary small enough to sort)."""
    if x.size <= _NUCLEUS_BINS:
        e[~_nucleus_sorted(x, e, top_p)] = 0.0
        return None
    total = e.sum(dtype=np.float64)
    limit = top_p * total
    for head in _NUCLEUS_HEADS:
        if _nucleus_head(x, m, e, limit, head, s):
            return total
    g = s.g
    np.subtract(m, x, out=g)
    np.multiply(g, _NUCLEUS_SCALE, out=g)
    np.minimum(g, _NUCLEUS_BINS - 1, out=g)
    bucket = s.bucket
    np.copyto(bucket, g, casting="unsafe")  # truncation = floor: 0 holds the largest logits
    mass = np.bincount(bucket, weights=e, minlength=_NUCLEUS_BINS)
    through = np.cumsum(mass)
    cross = min(int(np.searchsorted(through, limit, side="left")), _NUCLEUS_BINS - 1)
    members = np.flatnonzero(np.equal(bucket, cross, out=s.mask))
    order = members[np.argsort(-x[members], kind="stable")]
    ws = e[order].astype(np.float64)
    before = (through[cross] - mass[cross]) + np.cumsum(ws) - ws
    cut = order[before >= limit]
    # Buckets below `cross` have heavier mass under the limit (kept); those above, over it.
    np.copyto(e, 0.0, where=np.greater(bucket, cross, out=s.mask))
    e[cut] = 0.0
    return total


_NUCLEUS_SCALE = np.float32(_NUCLEUS_BINS / _EXP_UNDERFLOW)  # buckets per logit
# The first buckets _nucleus_head tries, in turn (of _NUCLEUS_BINS; a logit range of
# head * _EXP_UNDERFLOW / _NUCLEUS_BINS below the maximum: 13 and 52): top_p = 0.9-0.99 of a
# real model's row crossed at bucket 170-900 in every step measured (T 0.6-1.5).
_NUCLEUS_HEADS = (1024, 4096)


def _buckets(m: np.float32, x: np.ndarray) -> np.ndarray:
    """_nucleus_dense's bucket of each logit, as it computes them for the whole row (the same
    float32 operations element by element, so the same values)."""
    g = np.subtract(m, x)
    np.multiply(g, _NUCLEUS_SCALE, out=g)
    np.minimum(g, _NUCLEUS_BINS - 1, out=g)
    return g.astype(np.intp)


def _nucleus_head(x: np.ndarray, m: np.float32, e: np.ndarray, limit: np.float64, head: int, s: _Scratch) -> bool:
    """_nucleus_dense's cut when the mass crosses top_p within the first `head` buckets,
    computed on the tokens of those buckets only: True when done, False (nothing changed)
    when the mass does not cross there.

    Exactly the whole-row computation's result: a bucket's mass is the float64 sum of its
    tokens' weights in token order, and these are all of its tokens, in that order (a bucket
    only depends on its own tokens, and the cumulative mass up to the crossing only on the
    buckets before it). The tokens are those with a logit >= a threshold one bucket lower than
    the head needs; the bucket is non-increasing in the logit, so the threshold's own bucket
    being past the head proves no token under it falls in the head."""
    threshold = m - np.float32((head + 1) / _NUCLEUS_SCALE)
    if _buckets(m, np.asarray([threshold], np.float32))[0] < head:
        return False  # logits so large that float32 cannot resolve buckets here
    cand = np.flatnonzero(np.greater_equal(x, threshold, out=s.mask))
    b = _buckets(m, x[cand])
    inside = b < head
    cand, b = cand[inside], b[inside]
    mass = np.bincount(b, weights=e[cand], minlength=head)
    through = np.cumsum(mass)
    if not through[-1] >= limit:
        return False
    cross = int(np.searchsorted(through, limit, side="left"))
    members = cand[b == cross]
    order = members[np.argsort(-x[members], kind="stable")]
    ws = e[order].astype(np.float64)
    before = (through[cross] - mass[cross]) + np.cumsum(ws) - ws
    cut = order[before >= limit]
    kept = cand[b <= cross]
    if cut.size:
        kept = np.setdiff1d(kept, cut, assume_unique=True)
    values = e[kept]
    e.fill(0.0)
    e[kept] = values
    return True


_DRAW_BLOCK = 1024


def draw_index(w: np.ndarray, u: float) -> int:
    """Index i with probability w[i] / sum(w), from one uniform u in [0, 1): inverse CDF,
    by block sums first so a 150k vocabulary needs no full cumulative sum."""
    n = w.size
    if n <= 4 * _DRAW_BLOCK:
        return _draw_small(w, u * float(w.sum(dtype=np.float64)))
    full = n // _DRAW_BLOCK * _DRAW_BLOCK
    sums = w[:full].reshape(-1, _DRAW_BLOCK).sum(axis=1, dtype=np.float64)
    if full < n:
        sums = np.append(sums, w[full:].sum(dtype=np.float64))
    through = np.cumsum(sums)
    target = u * through[-1]
    b = min(int(np.searchsorted(through, target, side="right")), sums.size - 1)
    while sums[b] == 0.0:  # only after clipping a rounding overshoot
        b -= 1
    offset = target - (through[b - 1] if b else 0.0)
    seg = w[b * _DRAW_BLOCK:(b + 1) * _DRAW_BLOCK]
    return b * _DRAW_BLOCK + _draw_small(seg, offset * float(seg.sum(dtype=np.float64)) / sums[b])


def _draw_small(w: np.ndarray, target: float) -> int:
    cdf = np.cumsum(w, dtype=np.float64)
    j = min(int(np.searchsorted(cdf, target, side="right")), w.size - 1)
    while w[j] == 0.0:  # a rounding overshoot past the last positive weight
        j -= 1
    return j


def _raw_logsumexp(raw: np.ndarray, raw_max: np.float32, s: _Scratch) -> float:
    e = np.exp(np.subtract(raw, raw_max, out=s.e), out=s.e)
    return float(raw_max) + float(np.log(np.add.reduce(e, dtype=np.float64)))  # = e.sum(dtype=float64)


def _top_n(raw: np.ndarray, raw_max: np.float32, n: int, s: _Scratch) -> np.ndarray:
    """Indices of the n largest entries, descending; ties go to the lower token id."""
    if n >= raw.size:
        return np.argsort(-raw, kind="stable")
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    idx = _top_k_indices(raw, raw_max, n, s)  # n or more, with ties
    return idx[np.lexsort((idx, -raw[idx]))][:n]


def raw_logprobs(raw: np.ndarray, raw_max: np.float32, token: int, num: int | None,
                  s: _Scratch, lse: float | None = None) -> SampleResult:
    """The chosen token's SampleResult: with its logprob, rank and top-`num` when `num` is not
    None (the request asked for logprobs), else the token alone. lse: the row's logsumexp when
    the caller has it (_raw_logsumexp's value)."""
    if num is None:
        return SampleResult(token_id=token, logprob=None)
    if lse is None:
        lse = _raw_logsumexp(raw, raw_max, s)
    result = SampleResult(token_id=token, logprob=float(raw[token]) - lse)
    if num is not None:
        # vLLM's rank: how many tokens have a (float32) logprob >= the chosen one's.
        lp = np.subtract(raw, np.float32(lse), out=s.g)
        result.rank = int(np.count_nonzero(np.greater_equal(lp, lp[token], out=s.mask)))
        idx = _top_n(raw, raw_max, raw.size if num == -1 else num, s)
        values = raw[idx].astype(np.float64) - lse
        result.top_logprobs = list(zip(idx.tolist(), values.tolist()))
    return result


def prompt_logprobs(logits_for_prompt: np.ndarray, prompt_ids: Sequence[int],
                    k: int) -> list[dict[int, Logprob] | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then for each later token a
    dict holding that token (with its rank) and the top-k (-1: the whole vocabulary).

    Row j of `logits_for_prompt` is the model's output at prompt position j, which predicts
    token j+1; it may have len(prompt_ids) rows (the last, predicting the first generated
    token, is unused) or len(prompt_ids) - 1.
    """
    logits = np.asarray(logits_for_prompt, dtype=np.float32)
    ids = [int(t) for t in prompt_ids]
    if logits.ndim != 2 or logits.shape[0] not in (len(ids), max(len(ids) - 1, 0)):
        raise VtoolError(f"prompt_logprobs needs [{len(ids)} or {len(ids) - 1}, vocab] logits for "
                         f"{len(ids)} prompt tokens, got {logits.shape}")
    if not (k == -1 or k >= 0):
        raise VtoolError(f"prompt_logprobs k must be -1 or >= 0, got {k}")
    out: list[dict[int, Logprob] | None] = [None] if ids else []
    scratch = _Scratch(logits.shape[1])
    for pos in range(1, len(ids)):
        raw = logits[pos - 1]
        raw_max = raw.max()
        if not np.isfinite(raw_max):
            raise VtoolError(f"prompt logits row {pos - 1} has no finite maximum ({raw_max})")
        result = raw_logprobs(raw, raw_max, ids[pos], k, scratch)
        out.append(result.logprobs_dict())
    return out
