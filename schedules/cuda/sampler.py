"""Token sampling as compiled Relax functions, so a GPU step copies token ids to the host
instead of the whole float32 logits [b, vocab] (issue #4).

The functions reproduce runtime/sampling/host.py's host sampler for requests that need no
per-request logit processing (no logit_bias, penalties, min_tokens masking or logprobs;
runtime/sampling/device.py's can_sample_on_device says which). For the same uniform draw u
they pick the same token as the host, except where float rounding decides (a near-tie):

  greedy (temperature == 0 here; the host's temperature < 1e-5): argmax of the raw
      logits, ties to the lowest token id (numpy's argmax);
  random: x = logits / temperature (float32); w = exp(x - max x) (float32, the max weighs
      exactly 1); keep the tokens with x >= the k-th largest x (vLLM keeps ties at the
      cut), and w >= min_p; then top-p: in descending-logit order (ties by token id), keep
      the tokens whose heavier kept mass is < top_p of the kept total (float64). Draw by
      inverse CDF in token-id order: the first token whose float64 cumulative weight
      exceeds u * total weight.

Every function returns (token_ids int32[b], logprobs float64[b]): logprobs is the raw
log-softmax of the chosen token (what SampleResult.logprob holds, for cumulative_logprob).
A row whose logits hold a NaN or no finite maximum (or whose scaled logits overflow) gets
token -1: the caller raises, as the host sampler does.

Why float64 for top_p, the uniform draw and the cumulative sums: the host draws
u = Generator.random() (float64) and compares cumulative float64 weights with u * total.
Measured in numpy over 128256 standard-normal logits (x1, x2, x4) at temperature 1, no
filters: with u rounded to float32, 0.07-0.17% of draws pick another token; with a
sequential float32 cumulative sum as well, 9-22%. In float64 the disagreement is a
near-tie of ~1e-12 relative.

TVM pieces: relax.op.sort (DispatchSortScan: topi.gpu.sort on CUDA, tvm.contrib.sort on
the CPU) and relax.op.cumsum (the GPU 2-D scan kernel); everything else is elementwise or a
row reduction, which LegalizeOps/FuseOps turn into kernels vtool's schedules handle.
relax.op.multinomial_from_uniform is not used: its CUDA kernel compares float32 cumulative
sums with u - 1e-6, which is not the host's draw.

Vocabularies of CHUNKED_VOCAB (65,536) tokens or more reduce a row in chunks of CHUNK tokens
(one thread block per row and chunk, then a reduction over the chunks' partials): the
argmax and its max from one pass (TIR's argmax-with-tie-break reducer, so the lowest index
wins across chunks as within one), the log-sum-exp's float64 sum, the temperature row max,
and the draw in two levels (chunk sums and their cumulative sum pick a chunk, one scan over
that chunk picks the token) instead of a float64 scan over the whole row; top-p's nucleus
and the ties kept at its cut are counts found the same way (_nucleus_chunked). Smaller
vocabularies keep one block per row: there the extra launches of the combine steps cost
more than the chunks save (measured on an H100, docs/BENCHMARKS.md). For the same reason a
chunked vocabulary also gets sample_top_p_top_k_few_rows, the row-wise nucleus, which the
runtime calls for a few rows (their draw is bound by the host's launches). CUDA builds of
chunked vocabularies sort with CUB (toolchain/row_sort.py, `sort_symbol`): TVM's sort was
most of a top-p draw.

Grammar-constrained rows (structured output) draw on the device too, with two more functions
(MASK_FUNCTIONS): apply_token_bitmask(logits, bitmask) sets the tokens a packed int32 bitmask
[b, ceil(V/32)] disallows to -inf (llguidance's layout: bit j of word i allows token 32*i + j),
one of the functions above draws on the masked logits, and token_logprob(logits, token) gives the
drawn token's raw log-softmax from the unmasked logits (the drawing function's own is the masked
row's; the host reports the raw one). The mask is one elementwise kernel (DLight's Fallback
schedules it on CUDA); token_logprob is a row max/sum (sampling_rules.RowReduction) and a
gather. runtime/sampling/device.py calls them when the library has them (older ones do not).

On the CPU, sample_top_p_top_k calls tvm.contrib.sort.sort, which lives in
libtvm_runtime_extra.so, not in the libtvm_runtime.so the vtool runtime loads (importing
tvm registers it). The CPU needs no device sampling (its logits are read in place), so
build these functions into CUDA libraries; the CPU build is for testing them.

They live with the CUDA schedules, not with the models: they hold no weights and depend on a
model only through its vocabulary size; schedules/cuda/sampling_rules.py schedules their
kernels, and the toolchain adds them to every CUDA library (toolchain/families.py).
"""
from __future__ import annotations

import tvm
from tvm import relax, te, tirx

from vtool.schedules.cuda.logit_edits import logit_edits_func

# The functions' names: runtime/sampling/device.py calls them by these names (it cannot import
# this package; tests/test_gpu_sampler.py calls a library built here through it).
ARGMAX = "sample_argmax"
TEMPERATURE = "sample_temperature"
TOP_P_TOP_K = "sample_top_p_top_k"
FUNCTIONS = (ARGMAX, TEMPERATURE, TOP_P_TOP_K)
# Grammar-constrained rows on the device: mask the logits with a packed token bitmask, draw with
# one of FUNCTIONS on the masked logits, then take the raw log-softmax of the drawn token from the
# unmasked logits (what the host reports). Libraries built before these lack them.
APPLY_TOKEN_BITMASK = "apply_token_bitmask"
TOKEN_LOGPROB = "token_logprob"
MASK_FUNCTIONS = (APPLY_TOKEN_BITMASK, TOKEN_LOGPROB)
# Greedy grammar rows in one call: the argmax of the masked logits and the raw logprob of the
# token, from one pass over the row (mask + argmax + token_logprob read it three times).
ARGMAX_MASKED = "sample_argmax_masked"
# sample_top_p_top_k as it is fastest for a few rows (runtime/sampling/device.py picks it under
# FEW_ROWS), where a step's draw is bound by the host's launches rather than the device: the
# row-wise nucleus (one block a row, a scan over the sorted row) for a chunked vocabulary, TVM's
# sort for one with a library sort under CHUNKED_VOCAB. Built where it differs from
# sample_top_p_top_k.
TOP_P_TOP_K_FEW_ROWS = "sample_top_p_top_k_few_rows"
# logit_bias, min_tokens masking and the penalties on the device (logit_edits.py): the edited
# logits, which a sampling function then draws from; token_logprob gives the raw logprob.
APPLY_LOGIT_EDITS = "apply_logit_edits"

BATCH_VAR = "sample_batch"
_I32_MAX = 2**31 - 1
# Vocabularies of CHUNKED_VOCAB tokens or more reduce their rows in chunks of CHUNK tokens,
# one thread block per (row, chunk), then combine the [b, chunks] partials: with one block
# per row, a batch of 1 keeps one SM busy and a 128K row takes ~25 us a pass, and the
# temperature draw scanned whole float64 rows. Measured on an H100 (tests/bench/
# sampler_kernels.py, docs/BENCHMARKS.md): at 128,256 tokens the chunks pay at every batch
# size; at 49,152 the extra launches of the combine steps cost more than they save at
# batches 1 and 8, so smaller vocabularies keep one block per row.
CHUNK = 4096
CHUNKED_VOCAB = 65536


def _first_argmax_combine(a, b):  # noqa: ANN001, ANN202 - (index, value) pairs
    bigger = tirx.GT(a[1], b[1])
    take_a = tirx.Or(bigger, tirx.And(tirx.EQ(a[1], b[1]), tirx.LT(a[0], b[0])))
    return tirx.Select(take_a, a[0], b[0]), tirx.Select(bigger, a[1], b[1])


# (int64 index, value) -> the first index of the largest value. Written out as TIR's registered
# argmax-with-index-tie-break reducer, combiner and identities alike, because the GPU
# schedule's cross-thread reduction accepts no other form: a reduction with no entry above
# the dtype's lowest value gives (-1, lowest).
_FIRST_ARGMAX = te.comm_reducer(_first_argmax_combine,
                                lambda _ti, tv: (tirx.const(-1, "int64"), tirx.min_value(tv)), name="first_argmax")


def _i64(n: int) -> tirx.PrimExpr:
    return tirx.IntImm("int64", n)


def _row(t: relax.Expr) -> relax.Expr:
    return relax.op.expand_dims(t, 1)


class _Graph:
    """Helpers over one BlockBuilder dataflow block: relax ops, and TE for the pieces that
    need the token position."""

    def __init__(self, bb: relax.BlockBuilder, vocab: int, sort_symbol: str | None = None):
        self.bb, self.vocab, self.sort_symbol = bb, vocab, sort_symbol
        self.chunked = vocab >= CHUNKED_VOCAB
        self.chunk = min(CHUNK, vocab)
        self.chunks = -(-vocab // self.chunk)

    def emit(self, expr: relax.Expr) -> relax.Var:
        return self.bb.emit(expr)

    def te(self, fn, *args, name: str) -> relax.Var:  # noqa: ANN001 - a TE compute
        return self.bb.emit_te(fn, *args, primfunc_name_hint=name)

    # -- chunked row reductions: [b, V] -> [b, chunks] partials -> [b, 1] ------------------
    def _chunk_index(self, s: tirx.PrimExpr, c: tirx.PrimExpr) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
        """(token index of entry c of chunk s, clamped into the row; whether it is in the row)."""
        j = self._token_of(s, c)
        return tirx.min(j, _i64(self.vocab - 1)), j < _i64(self.vocab)

    def _token_of(self, s: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
        """The token index of entry c of chunk s, int64 without a Cast: the chunked kernels'
        axes are int64 (_i64), because passes rewrite casts in some copies of an expression
        and not in others, and a reduction's combiner (which holds the index twice) then no
        longer matches TIR's registered reducer."""
        return s * _i64(self.chunk) + c

    def row_max(self, x: relax.Var) -> relax.Var:
        """Per row, the max of float32 x [b, V]: [b, 1] (fmax semantics, as relax.op.max)."""
        if not self.chunked:
            return self.emit(relax.op.max(x, axis=1, keepdims=True))

        def compute(v: te.Tensor) -> te.Tensor:
            c = te.reduce_axis((_i64(0), _i64(self.chunk)), name="c")

            def body(i, s):  # noqa: ANN001, ANN202 - TE index variables
                j, inside = self._chunk_index(s, c)
                return te.max(tirx.Select(inside, v[i, j], tirx.const(float("-inf"), "float32")), axis=c)

            return te.compute((v.shape[0], _i64(self.chunks)), body, name="chunk_max")

        part = self.te(compute, x, name="sampler_chunk_max")
        return self.emit(relax.op.max(part, axis=1, keepdims=True))

    def argmax_max(self, x: relax.Var) -> tuple[relax.Var, relax.Var]:
        """Per row of float32 x [b, V], (the first index of its max int32 [b], the max float32
        [b, 1]): each chunk's first argmax and max in one pass, then the same reduction over
        the chunks' (index, max) pairs, whose indices grow with the chunk: the lowest index
        of the row's max (numpy's argmax for rows without NaN)."""

        def chunks(v: te.Tensor) -> list[te.Tensor]:
            c = te.reduce_axis((_i64(0), _i64(self.chunk)), name="c")

            def body(i, s):  # noqa: ANN001, ANN202 - TE index variables
                # Past the row's end the clamped read repeats its last entry at a higher index,
                # which never wins a tie: no Select, so the combiner stays the registered one.
                j, _ = self._chunk_index(s, c)
                return _FIRST_ARGMAX((self._token_of(s, c), v[i, j]), axis=c)

            return te.compute((v.shape[0], _i64(self.chunks)), body, name="chunk_argmax")

        def rows(index: te.Tensor, value: te.Tensor) -> list[te.Tensor]:
            s = te.reduce_axis((_i64(0), _i64(self.chunks)), name="s")
            return te.compute((index.shape[0], _i64(1)), lambda i, _: _FIRST_ARGMAX((index[i, s], value[i, s]), axis=s),
                              name="row_argmax")

        part = self.te(chunks, x, name="sampler_chunk_argmax")
        row = self.te(rows, self.emit(relax.TupleGetItem(part, 0)), self.emit(relax.TupleGetItem(part, 1)),
                      name="sampler_row_argmax")
        index = self.emit(relax.op.squeeze(relax.TupleGetItem(row, 0), [1]))
        return self.emit(relax.op.astype(index, "int32")), self.emit(relax.TupleGetItem(row, 1))

    def exp_sum(self, x: relax.Var, top: relax.Var) -> relax.Var:
        """Per row, sum of exp(x - top) over float32 x [b, V], each term in float32 and the sum
        in float64 (the host's log-sum-exp): float64 [b, 1]."""

        def compute(v: te.Tensor, t: te.Tensor) -> te.Tensor:
            c = te.reduce_axis((_i64(0), _i64(self.chunk)), name="c")

            def body(i, s):  # noqa: ANN001, ANN202 - TE index variables
                j, inside = self._chunk_index(s, c)
                term = tirx.Cast("float64", te.exp(v[i, j] - t[i, 0]))
                return te.sum(tirx.Select(inside, term, tirx.const(0.0, "float64")), axis=c)

            return te.compute((v.shape[0], _i64(self.chunks)), body, name="chunk_exp_sum")

        part = self.te(compute, x, top, name="sampler_chunk_exp_sum")
        return self.emit(relax.op.sum(part, axis=1, keepdims=True))

    def chunk_sums(self, w: relax.Var) -> relax.Var:
        """Per chunk of w [b, V] (float64 weights or int32 counts), the sum: [b, chunks] of w's
        dtype."""

        def compute(v: te.Tensor) -> te.Tensor:
            c = te.reduce_axis((_i64(0), _i64(self.chunk)), name="c")

            def body(i, s):  # noqa: ANN001, ANN202 - TE index variables
                j, inside = self._chunk_index(s, c)
                return te.sum(tirx.Select(inside, v[i, j], tirx.const(0, v.dtype)), axis=c)

            return te.compute((v.shape[0], _i64(self.chunks)), body, name="chunk_sum")

        return self.te(compute, w, name="sampler_chunk_sum")

    def chunk_of(self, w: relax.Var, k: relax.Var) -> relax.Var:
        """Row i's chunk k[i] of w [b, V] (k int32 [b, 1] in [0, chunks)), zeros past the
        vocabulary: [b, chunk]."""

        def compute(v: te.Tensor, kk: te.Tensor) -> te.Tensor:
            def body(i, c):  # noqa: ANN001, ANN202 - TE index variables
                j, inside = self._chunk_index(tirx.Cast("int64", kk[i, 0]), c)
                return tirx.Select(inside, v[i, j], tirx.const(0, v.dtype))

            return te.compute((v.shape[0], _i64(self.chunk)), body, name="chunk_of")

        return self.te(compute, w, k, name="sampler_chunk_of")

    def count_rows(self, cond: relax.Expr) -> relax.Var:
        """Per row of a [b, V] condition, how many entries are true: int32 [b, 1] (chunk by
        chunk for a chunked vocabulary)."""
        if not self.chunked:
            return self.count(cond)
        part = self.chunk_sums(self.emit(relax.op.astype(cond, "int32")))
        return self.emit(relax.op.sum(part, axis=1, keepdims=True))

    def lead_count(self, w: relax.Var, target: relax.Var, strict: bool) -> relax.Var:
        """Per row of non-negative w [b, V] (float64 or int32), how many leading entries keep
        their running sum (the entry included) below target [b, 1] (strict) or at most target:
        int32 [b, 1]. In two levels: the chunks whose running sum at their end passes, then a
        scan over the next chunk only."""
        i32 = lambda n: relax.const(n, "int32")  # noqa: E731
        cmp = relax.op.less if strict else relax.op.less_equal
        ccum = self.emit(relax.op.cumsum(self.chunk_sums(w), axis=1))
        full = self.count(cmp(ccum, target))  # whole chunks that pass: a prefix
        kc = self.emit(relax.op.minimum(full, i32(self.chunks - 1)))
        previous = self.pick(ccum, self.emit(relax.op.maximum(relax.op.subtract(kc, i32(1)), i32(0))))
        before = self.emit(relax.op.where(relax.op.greater(kc, i32(0)), previous, relax.const(0, str(w.ty.dtype))))
        local = self.emit(relax.op.cumsum(self.chunk_of(w, kc), axis=1))
        j = self.count(cmp(relax.op.add(before, local), target))
        n = relax.op.where(relax.op.less(full, i32(self.chunks)),
                           relax.op.add(relax.op.multiply(kc, i32(self.chunk)), j), i32(self.vocab))
        return self.emit(relax.op.minimum(n, i32(self.vocab)))

    def ties_through(self, x: relax.Var, t: relax.Var, cut: relax.Var) -> relax.Var:
        """keep [b, V]: x > t, or x == t at an index <= cut [b, 1] (the ties kept in token
        order)."""

        def compute(v: te.Tensor, tt: te.Tensor, cc: te.Tensor) -> te.Tensor:
            return te.compute(v.shape, lambda i, j: tirx.Or(
                tirx.GT(v[i, j], tt[i, 0]),
                tirx.And(tirx.EQ(v[i, j], tt[i, 0]), tirx.LE(j, tirx.Cast(str(j.ty), cc[i, 0])))), name="ties_through")

        return self.te(compute, x, t, cut, name="sampler_ties_through")

    def pick(self, data: relax.Var, k: relax.Var) -> relax.Var:
        """data[i, k[i]] for data [b, n] and k int32 [b, 1] in [0, n): [b, 1]."""

        def compute(d: te.Tensor, kk: te.Tensor) -> te.Tensor:
            return te.compute((d.shape[0], 1), lambda i, _: d[i, kk[i, 0]], name="pick")

        return self.te(compute, data, k, name="sampler_pick")

    def count(self, cond: relax.Expr) -> relax.Var:
        """Per row, how many entries are true: int32[b, 1]."""
        return self.emit(relax.op.sum(relax.op.astype(cond, "int32"), axis=1, keepdims=True))

    def sort_desc(self, x: relax.Var, library_sort: bool = True) -> relax.Var:
        """Each row of float32 x [b, V] sorted in descending order: relax.op.sort, or the
        library's own row sort (sort_symbol: toolchain/row_sort.py's CUB sort on CUDA) unless
        library_sort is False."""
        if self.sort_symbol is None or not library_sort:
            return self.emit(relax.op.sort(x, axis=1, descending=True))
        return self.emit(relax.call_dps_packed(self.sort_symbol, [x], out_ty=relax.TensorType(x.ty.shape, "float32")))

    def sorted_at(self, sx: relax.Var, n: relax.Var) -> relax.Var:
        """Per row of a descending-sorted sx [b, V], the smallest of its first n[i] entries
        (n int32 [b, 1], 1..V): entry n - 1, a gather instead of a reduction over the row."""
        one = relax.const(1, "int32")
        last = self.emit(relax.op.clip(relax.op.subtract(n, one), 0, self.vocab - 1))
        return self.pick(sx, last)

    def last_positive(self, w: relax.Var) -> relax.Var:
        """Per row of w [b, n], the largest index with w > 0 (-1 if none): int32 [b, 1].
        (Reduced in int64, the index type call_te gives j: a cast around the max would hide
        the reducer from the GPU's cross-thread reduction.)"""

        def compute(v: te.Tensor) -> te.Tensor:
            j = te.reduce_axis((0, v.shape[1]), name="j")
            return te.compute(
                (v.shape[0], 1),
                lambda i, _: te.max(tirx.Select(v[i, j] > tirx.const(0, v.dtype), tirx.Cast("int64", j),
                                                tirx.const(-1, "int64")), axis=j),
                name="last_positive")

        last = self.te(compute, w, name="sampler_last_positive")
        return self.emit(relax.op.astype(last, "int32"))

    def tie_rank(self, x: relax.Var, t: relax.Var) -> relax.Var:
        """For each entry equal to its row's t, how many entries before it (by index) equal
        t: an int32 [b, V] inclusive cumsum minus the entry itself."""
        eq = self.emit(relax.op.astype(relax.op.equal(x, t), "int32"))
        inclusive = self.emit(relax.op.cumsum(eq, axis=1, dtype="int32"))
        return self.emit(relax.op.subtract(inclusive, eq))

    def gather_row(self, data: relax.Var, index: relax.Var) -> relax.Var:
        """data[i, index[i]] for index int32 [b] clamped into the row: [b]."""

        def compute(d: te.Tensor, idx: te.Tensor) -> te.Tensor:
            hi = tirx.const(self.vocab - 1, "int32")
            return te.compute(
                (d.shape[0],),
                lambda i: d[i, tirx.max(tirx.min(idx[i], hi), tirx.const(0, "int32"))],
                name="gather_row")

        return self.te(compute, data, index, name="sampler_gather_row")


def _lse(g: _Graph, logits: relax.Var, top: relax.Var) -> relax.Var:
    """The log-sum-exp float64 [b, 1] of the raw logits given their row max top [b, 1], the
    host's way: exp(raw - max) in float32, summed in float64 (chunk by chunk, then the
    chunks, for a chunked vocabulary)."""
    if g.chunked:
        total = g.exp_sum(logits, top)
    else:
        e = g.emit(relax.op.exp(relax.op.subtract(logits, top)))
        total = g.emit(relax.op.sum(relax.op.astype(e, "float64"), axis=1, keepdims=True))
    return g.emit(relax.op.add(relax.op.astype(top, "float64"), relax.op.log(total)))


def _raw_lse(g: _Graph, logits: relax.Var) -> relax.Var:
    return _lse(g, logits, g.row_max(logits))


def _argmax_max(g: _Graph, x: relax.Var) -> tuple[relax.Var, relax.Var]:
    """(first argmax int32 [b], max float32 [b, 1]) of each row of x."""
    if g.chunked:
        return g.argmax_max(x)
    return (g.emit(relax.op.astype(relax.op.argmax(x, axis=1), "int32")),
            g.emit(relax.op.max(x, axis=1, keepdims=True)))


def _raw_stats(g: _Graph, logits: relax.Var) -> tuple[relax.Var, relax.Var]:
    """(argmax int32 [b], log-sum-exp float64 [b, 1]) of the raw logits."""
    argmax, top = _argmax_max(g, logits)
    return argmax, _lse(g, logits, top)


def _token_bitmask(logits: te.Tensor, bitmask: te.Tensor) -> te.Tensor:
    """logits [b, V] with the tokens whose bit is clear set to -inf: bit j of int32 word i of a
    row allows token 32 * i + j (llguidance's layout, runtime/sampling/logits_processors.py).
    One elementwise kernel; the shift is arithmetic, which the `& 1` makes harmless."""
    minus_inf = tirx.const(float("-inf"), "float32")

    def value(i, j):  # noqa: ANN001, ANN202 - TE index variables
        word = bitmask[i, tirx.floordiv(j, 32)]
        bit = tirx.bitwise_and(tirx.shift_right(word, tirx.Cast("int32", tirx.floormod(j, 32))),
                               tirx.const(1, "int32"))
        return tirx.Select(bit != tirx.const(0, "int32"), logits[i, j], minus_inf)

    return te.compute(logits.shape, value, name="apply_token_bitmask")


def _finish(g: _Graph, logits: relax.Var, token: relax.Var, lse: relax.Var,
            ok: relax.Var) -> relax.Expr:
    """(token or -1 where the row is bad, raw log-softmax of the token)."""
    token = g.emit(relax.op.where(ok, token, relax.const(-1, "int32")))
    chosen = g.gather_row(logits, token)
    logprob = g.emit(relax.op.subtract(relax.op.astype(chosen, "float64"), relax.op.squeeze(lse, [1])))
    return relax.Tuple([token, logprob])


def _draw(g: _Graph, w: relax.Var, uniform: relax.Var) -> relax.Var:
    """Inverse CDF in token-id order over float64 weights w [b, V]: the first token whose
    cumulative weight exceeds uniform * total, kept off zero-weight tokens past the end.
    int32 [b]."""
    if g.chunked:
        return _draw_chunked(g, w, uniform)
    cdf = g.emit(relax.op.cumsum(w, axis=1, dtype="float64"))
    total = g.emit(relax.op.sum(w, axis=1, keepdims=True))
    target = g.emit(relax.op.multiply(_row(uniform), total))
    first_over = g.count(relax.op.less_equal(cdf, target))
    token = g.emit(relax.op.minimum(first_over, g.last_positive(w)))
    return g.emit(relax.op.squeeze(token, [1]))


def _draw_chunked(g: _Graph, w: relax.Var, uniform: relax.Var) -> relax.Var:
    """_draw in two levels, so no scan runs over a whole row: the chunks' weight sums and
    their cumulative sum pick the chunk where the cumulative weight first exceeds the target
    (the last chunk holding weight if none does), and a scan over that one chunk, from the
    weight before it, picks the token, kept at or below the chunk's last positive weight.
    The float64 sums are added in another order than one scan over the row adds them; where
    that moves the pick it is a near-tie of ~1e-16 relative."""
    i32 = lambda n: relax.const(n, "int32")  # noqa: E731
    wsum = g.chunk_sums(w)
    ccum = g.emit(relax.op.cumsum(wsum, axis=1, dtype="float64"))
    total = g.emit(relax.op.take(ccum, relax.const([g.chunks - 1], "int32"), axis=1))
    target = g.emit(relax.op.multiply(_row(uniform), total))
    k = g.count(relax.op.less_equal(ccum, target))  # the first chunk past the target; chunks if none
    last_chunk = g.emit(relax.op.maximum(g.last_positive(wsum), i32(0)))
    kc = g.emit(relax.op.where(relax.op.less(k, i32(g.chunks)), k, last_chunk))
    previous = g.pick(ccum, g.emit(relax.op.maximum(relax.op.subtract(kc, i32(1)), i32(0))))
    before = g.emit(relax.op.where(relax.op.greater(kc, i32(0)), previous, relax.const(0.0, "float64")))
    window = g.chunk_of(w, kc)
    local = g.emit(relax.op.cumsum(window, axis=1, dtype="float64"))
    j = g.count(relax.op.less_equal(relax.op.add(before, local), target))
    offset = relax.op.minimum(j, g.last_positive(window))
    token = g.emit(relax.op.add(relax.op.multiply(kc, i32(g.chunk)), offset))
    return g.emit(relax.op.squeeze(token, [1]))


def _random_sample(g: _Graph, logits: relax.Var, temperature: relax.Var, min_p: relax.Var,
                   uniform: relax.Var, top_p: relax.Var | None, top_k: relax.Var | None,
                   greedy_token: relax.Var, lse: relax.Var, rowwise_nucleus: bool = False) -> relax.Expr:
    zero = relax.const(0.0, "float32")
    greedy = g.emit(relax.op.equal(temperature, zero))
    safe_t = g.emit(relax.op.where(greedy, relax.const(1.0, "float32"), temperature))
    x = g.emit(relax.op.divide(logits, _row(safe_t)))
    m = g.row_max(x)
    if top_p is None:
        w32 = g.emit(relax.op.exp(relax.op.subtract(x, m)))
        keep = relax.op.greater_equal(w32, _row(min_p))
    else:
        v = g.vocab
        # A few rows of a vocabulary under CHUNKED_VOCAB sort faster with TVM's sort: CUB's
        # launches cost more than its sort saves there (BENCHMARKS.md).
        sx = g.sort_desc(x, library_sort=g.chunked or not rowwise_nucleus)
        k_on = relax.op.logical_and(relax.op.greater(top_k, relax.const(0, "int32")),
                                    relax.op.less(top_k, relax.const(v, "int32")))
        k_eff = g.emit(_row(relax.op.where(k_on, top_k, relax.const(v, "int32"))))
        kth = g.sorted_at(sx, k_eff)
        ws = g.emit(relax.op.exp(relax.op.subtract(sx, m)))
        keep_s = g.emit(relax.op.logical_and(relax.op.greater_equal(sx, kth),
                                             relax.op.greater_equal(ws, _row(min_p))))
        wk = g.emit(relax.op.where(keep_s, relax.op.astype(ws, "float64"), relax.const(0.0, "float64")))
        if g.chunked and not rowwise_nucleus:
            keep = _nucleus_chunked(g, x, sx, keep_s, wk, top_p)
            w32 = g.emit(relax.op.exp(relax.op.subtract(x, m)))
            return _draw_and_finish(g, logits, keep, w32, uniform, greedy, greedy_token, m, lse)
        cs = g.emit(relax.op.cumsum(wk, axis=1, dtype="float64"))
        total = g.emit(relax.op.sum(wk, axis=1, keepdims=True))
        before = relax.op.subtract(cs, wk)
        p_row = _row(top_p)
        nucleus = relax.op.logical_or(relax.op.greater_equal(p_row, relax.const(1.0, "float64")),
                                      relax.op.less(before, relax.op.multiply(p_row, total)))
        kept = g.count(relax.op.logical_and(keep_s, nucleus))  # a prefix of the sorted row, >= 1
        t = g.sorted_at(sx, kept)  # the smallest kept logit
        above = g.count(relax.op.greater(sx, t))
        rank = g.tie_rank(x, t)
        keep = relax.op.logical_or(
            relax.op.greater(x, t),
            relax.op.logical_and(relax.op.equal(x, t), relax.op.less(rank, relax.op.subtract(kept, above))))
        w32 = g.emit(relax.op.exp(relax.op.subtract(x, m)))
    return _draw_and_finish(g, logits, keep, w32, uniform, greedy, greedy_token, m, lse)


def _nucleus_chunked(g: _Graph, x: relax.Var, sx: relax.Var, keep_s: relax.Var, wk: relax.Var,
                     top_p: relax.Var) -> relax.Var:
    """The top-k / min-p / top-p keep mask [b, V] of a chunked vocabulary, as the row-wise
    path computes it (kept = the sorted prefix that passes all three; its smallest logit t;
    the ties at t kept in token order) without a scan over whole rows: keep_s is a prefix of
    the sorted row (both of its tests are monotone in the logit), the nucleus another (its
    running weight before an entry, compared with top_p * total), so each is a count, the
    nucleus's in two levels (lead_count); the last kept tie is found the same way over the
    row's ties in token order."""
    i32 = lambda n: relax.const(n, "int32")  # noqa: E731
    n_keep_s = g.count_rows(keep_s)
    total = g.emit(relax.op.sum(g.chunk_sums(wk), axis=1, keepdims=True))
    p_row = _row(top_p)
    # The entries whose running weight before them is < p * total: one more than those whose
    # running weight through them is (the first entry's "before" is 0).
    under = g.lead_count(wk, g.emit(relax.op.multiply(p_row, total)), strict=True)
    nucleus = g.emit(relax.op.where(relax.op.greater_equal(p_row, relax.const(1.0, "float64")), i32(g.vocab),
                                    relax.op.minimum(relax.op.add(under, i32(1)), i32(g.vocab))))
    kept = g.emit(relax.op.minimum(n_keep_s, nucleus))  # >= 1: the row's maximum passes all three
    t = g.sorted_at(sx, kept)  # the smallest kept logit
    above = g.count_rows(relax.op.greater(sx, t))
    ties = g.emit(relax.op.astype(relax.op.equal(x, t), "int32"))
    # The (kept - above)-th tie in token order sits after this many leading entries.
    cut = g.lead_count(ties, g.emit(relax.op.subtract(kept, above)), strict=True)
    return g.ties_through(x, t, cut)


def _draw_and_finish(g: _Graph, logits: relax.Var, keep: relax.Expr, w32: relax.Var, uniform: relax.Var,
                     greedy: relax.Var, greedy_token: relax.Var, m: relax.Var, lse: relax.Var) -> relax.Expr:
    w = g.emit(relax.op.where(keep, relax.op.astype(w32, "float64"), relax.const(0.0, "float64")))
    drawn = _draw(g, w, uniform)
    token = g.emit(relax.op.where(greedy, greedy_token, drawn))
    m_ok = g.emit(relax.op.squeeze(relax.op.isfinite(m), [1]))
    ok = g.emit(relax.op.logical_and(relax.op.squeeze(relax.op.isfinite(lse), [1]),
                                     relax.op.logical_or(greedy, m_ok)))
    return _finish(g, logits, token, lse, ok)


def sampler_module(vocab_size: int, sort_symbol: str | None = None) -> tvm.IRModule:
    """The sampling functions for a vocabulary of vocab_size tokens, over a symbolic batch:

        sample_argmax(logits f32[b, V]) -> (i32[b], f64[b])
        sample_temperature(logits f32[b, V], temperature f32[b], min_p f32[b],
                           uniform f64[b]) -> (i32[b], f64[b])
        sample_top_p_top_k(logits f32[b, V], temperature f32[b], top_p f64[b], top_k i32[b],
                           min_p f32[b], uniform f64[b]) -> (i32[b], f64[b])
        sample_top_p_top_k_few_rows(the same): where sort_symbol is given or the vocabulary is
                           chunked, the same draw with fewer launches (for a few rows)

        apply_token_bitmask(logits f32[b, V], bitmask i32[b, W]) -> f32[b, V]
        apply_logit_edits(logits f32[b, V], bias_at i64[n1], bias f32[n1], mask_at i64[n2],
                          repetition_at i64[n3], repetition f32[n3], penalty_at i64[n4],
                          frequency f32[n4], presence f32[n4]) -> f32[b, V]
        token_logprob(logits f32[b, V], token i32[b]) -> f64[b]
        sample_argmax_masked(logits f32[b, V], bitmask i32[b, W]) -> (i32[b], f64[b])

    temperature 0 makes a row greedy (its uniform is ignored); top_k <= 0 or >= V is off;
    top_p >= 1 is off; min_p 0 is off. Outputs: token ids (-1: bad logits row) and the raw
    log-softmax of each chosen token.

    apply_token_bitmask: W = ceil(V / 32); a token whose bit is clear becomes -inf (the bits
    past V in the last word are ignored). A grammar row draws with a sampling function on the
    masked logits, and token_logprob gives the drawn token's raw log-softmax from the unmasked
    ones (the sampling function's own logprob is the masked row's); a token id outside the row
    is clamped into it (the caller has refused a -1 token already).

    apply_logit_edits: logit_bias, min_tokens masking and the penalties (logit_edits.py); a
    request with them draws from the edited logits, its logprob again from token_logprob.

    sort_symbol: an external function sorting rows of float32 in descending order into a
    destination (toolchain/row_sort.py's, linked into CUDA libraries), used for top-p / top-k
    instead of relax.op.sort; None keeps relax.op.sort (the CPU's, and tests).
    """
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    bb = relax.BlockBuilder()
    g = _Graph(bb, vocab_size, sort_symbol)

    def tensor(name: str, shape: list, dtype: str) -> relax.Var:
        return relax.Var(name, relax.TensorType(shape, dtype))

    few_rows = g.chunked or sort_symbol is not None  # a variant faster for a few rows exists
    for name in FUNCTIONS + ((TOP_P_TOP_K_FEW_ROWS,) if few_rows else ()):
        b = tirx.Var(BATCH_VAR, "int64")
        logits = tensor("logits", [b, vocab_size], "float32")
        temperature = tensor("temperature", [b], "float32")
        top_p = tensor("top_p", [b], "float64")
        top_k = tensor("top_k", [b], "int32")
        min_p = tensor("min_p", [b], "float32")
        uniform = tensor("uniform", [b], "float64")
        params = {ARGMAX: [logits],
                  TEMPERATURE: [logits, temperature, min_p, uniform],
                  TOP_P_TOP_K: [logits, temperature, top_p, top_k, min_p, uniform],
                  TOP_P_TOP_K_FEW_ROWS: [logits, temperature, top_p, top_k, min_p, uniform]}[name]
        with bb.function(name, params):
            with bb.dataflow():
                argmax, lse = _raw_stats(g, logits)
                if name == ARGMAX:
                    ok = g.emit(relax.op.squeeze(relax.op.isfinite(lse), [1]))
                    out = _finish(g, logits, argmax, lse, ok)
                else:
                    sort_args = (top_p, top_k) if name in (TOP_P_TOP_K, TOP_P_TOP_K_FEW_ROWS) else (None, None)
                    out = _random_sample(g, logits, temperature, min_p, uniform, *sort_args,
                                         greedy_token=argmax, lse=lse, rowwise_nucleus=name == TOP_P_TOP_K_FEW_ROWS)
                gv = bb.emit_output(out)
            bb.emit_func_output(gv)

    b = tirx.Var(BATCH_VAR, "int64")
    logits = tensor("logits", [b, vocab_size], "float32")
    bitmask = tensor("bitmask", [b, (vocab_size + 31) // 32], "int32")
    with bb.function(APPLY_TOKEN_BITMASK, [logits, bitmask]):
        with bb.dataflow():
            gv = bb.emit_output(g.te(_token_bitmask, logits, bitmask, name="sampler_apply_token_bitmask"))
        bb.emit_func_output(gv)

    b = tirx.Var(BATCH_VAR, "int64")
    logits = tensor("logits", [b, vocab_size], "float32")
    lists = {name: tirx.Var(f"edits_{name}", "int64") for name in ("bias", "mask", "repetition", "penalty")}
    edit_params = [tensor("bias_at", [lists["bias"]], "int64"), tensor("bias", [lists["bias"]], "float32"),
                   tensor("mask_at", [lists["mask"]], "int64"),
                   tensor("repetition_at", [lists["repetition"]], "int64"),
                   tensor("repetition", [lists["repetition"]], "float32"),
                   tensor("penalty_at", [lists["penalty"]], "int64"),
                   tensor("frequency", [lists["penalty"]], "float32"),
                   tensor("presence", [lists["penalty"]], "float32")]
    edits = bb.add_func(logit_edits_func(vocab_size), "sampler_logit_edits")
    with bb.function(APPLY_LOGIT_EDITS, [logits, *edit_params]):
        with bb.dataflow():
            gv = bb.emit_output(relax.call_tir(edits, relax.Tuple([logits, *edit_params]),
                                               relax.TensorType([b, vocab_size], "float32")))
        bb.emit_func_output(gv)

    b = tirx.Var(BATCH_VAR, "int64")
    logits = tensor("logits", [b, vocab_size], "float32")
    token = tensor("token", [b], "int32")
    with bb.function(TOKEN_LOGPROB, [logits, token]):
        with bb.dataflow():
            lse = _raw_lse(g, logits)
            chosen = g.gather_row(logits, token)
            gv = bb.emit_output(relax.op.subtract(relax.op.astype(chosen, "float64"), relax.op.squeeze(lse, [1])))
        bb.emit_func_output(gv)

    b = tirx.Var(BATCH_VAR, "int64")
    logits = tensor("logits", [b, vocab_size], "float32")
    bitmask = tensor("bitmask", [b, (vocab_size + 31) // 32], "int32")
    with bb.function(ARGMAX_MASKED, [logits, bitmask]):
        with bb.dataflow():
            masked = g.te(_token_bitmask, logits, bitmask, name="sampler_apply_token_bitmask")
            argmax, allowed_max = _argmax_max(g, masked)
            allowed_max = g.emit(relax.op.squeeze(allowed_max, [1]))
            lse = _raw_lse(g, logits)
            # -1 where the row is bad or its mask allows no token with a finite logit
            ok = g.emit(relax.op.logical_and(relax.op.squeeze(relax.op.isfinite(lse), [1]),
                                             relax.op.isfinite(allowed_max)))
            gv = bb.emit_output(_finish(g, logits, argmax, lse, ok))
        bb.emit_func_output(gv)
    return bb.get()
