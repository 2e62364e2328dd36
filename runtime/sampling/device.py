"""Sampling on the model's device: call the compiled sampling functions (schedules/cuda/sampler.py)
on device-resident logits and copy back only the token ids and their logprobs (issue #4).

Same tokens as the host sampler (runtime/sampling/host.py) for the same per-request Generator,
except at float near-ties: each random row draws its one uniform from its request's
Generator here, exactly as the host does, and the device applies the host's temperature,
min_p, top_k, top_p and inverse-CDF draw to it (schedules/cuda/sampler.py says how, and why the
draw and top_p travel as float64). Greedy rows draw nothing, as on the host.

Grammar rows (structured output) sample here too when the library has the masking functions
(APPLY_TOKEN_BITMASK, TOKEN_LOGPROB; libraries built before them do not, and their grammar rows
stay on the host): at prepare time the batch's [b, W] int32 token bitmask is filled on the host
(runtime/sampling/bitmask_batch.py: the grammars' masks in one parallel call; a row without a
grammar allows every token) and uploaded; at launch the logits are masked on the device, the
usual draw runs on the masked rows, and the drawn token's raw logprob is taken from the unmasked
ones, as the host reports it. Any logits processor of such a row must be a BitmaskSource whose
mask is all it does (GrammarProcessor is one).

Rows with logit_bias, min_tokens masking or the repetition / frequency / presence penalties
sample here too when the library has APPLY_LOGIT_EDITS (schedules/cuda/logit_edits.py): at
prepare time the batch's edits (SequenceSampler.edit_lists: flat positions and float32 values,
one list per kind) are uploaded; at launch the edits are applied to a copy of the (masked)
logits in the host's order and arithmetic, the draw runs on it, and token_logprob reports the
raw logprob, as for grammar rows. So a batch with one penalized request no longer sends every
row's logits to the host.

Requests asking for logprobs draw here too (DeviceSampler, with_logprobs): after the draw only
the span of their raw rows is copied to the host, where the host sampler's raw_logprobs reports
logprob, rank and top-N from them, the same values as the host path, without the whole batch's
logits crossing. Requests whose logits processors are not bitmasks stay on the host path:
can_sample_on_device says which (speculative verification keeps logprobs rows on the host).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from vtool import VtoolError
from vtool.runtime.sampling.bitmask_batch import fill_batch_bitmask
from vtool.runtime.sampling.host import SampleResult, SequenceSampler, raw_logprobs, scratch_buffers
from vtool.runtime.sampling.logits_processors import bitmask_words
from vtool.runtime.sampling.params import SamplingParams, SamplingParamsError
from vtool.runtime.artifact.tvm_runtime import global_func

# The compiled functions' names (schedules/cuda/sampler.py builds them under these names).
ARGMAX = "sample_argmax"
TEMPERATURE = "sample_temperature"
TOP_P_TOP_K = "sample_top_p_top_k"
FUNCTIONS = (ARGMAX, TEMPERATURE, TOP_P_TOP_K)
# Optional (grammar rows on the device): mask the logits, and the raw logprob of a drawn token.
APPLY_TOKEN_BITMASK = "apply_token_bitmask"
TOKEN_LOGPROB = "token_logprob"
MASK_FUNCTIONS = (APPLY_TOKEN_BITMASK, TOKEN_LOGPROB)
ARGMAX_MASKED = "sample_argmax_masked"  # optional too: greedy grammar rows in one pass
# Optional (libraries of 64K+ vocabularies since it exists): TOP_P_TOP_K with fewer kernel
# launches, for draws of fewer than FEW_ROWS rows, which the host's launches bound.
TOP_P_TOP_K_FEW_ROWS = "sample_top_p_top_k_few_rows"
FEW_ROWS = 16
# Optional (libraries built since it exists; with TOKEN_LOGPROB): logit_bias, min_tokens masking
# and the penalties applied on the device (schedules/cuda/logit_edits.py), so such rows draw here.
APPLY_LOGIT_EDITS = "apply_logit_edits"
# Below this many rows a batch with edits samples on the host, unless it has a random row and at
# least two: one row's edits, uploads and extra launches cost more on the device than its copy to
# the host and the host's pass (H100 host, 128,256 tokens, tests/bench/edited_rows.py: one greedy
# row 0.56 ms against 0.23 on the host, one random row 1.18 against 1.00; 8 rows 0.79 / 1.59 against
# 1.15 / 7.70; 64 rows 2.19 / 3.94 against 7.71 / 60.6).
EDITS_MIN_ROWS = 4
_EDIT_SLOTS = ("bias_at", "bias", "mask_at", "repetition_at", "repetition", "penalty_at", "frequency", "presence")


def can_sample_on_device(params: SamplingParams, num_generated: int | None = None, edits: bool = False,
                         logprobs: bool = False) -> bool:
    """Whether a request's next token can be drawn by the device functions; False means
    the host sampler (runtime/sampling/host.py) must see its logits row:

    - unless `logprobs` (a DeviceSampler draws such rows and copies only their raw rows to the
      host for the top-N and rank): logprobs (the chosen token's own logprob is computed on the
      device),
    - unless `edits` (a library with APPLY_LOGIT_EDITS): logit_bias, repetition/frequency/
      presence penalties (per-request logit edits), and min_tokens while fewer than min_tokens
      are generated (eos/stop ids are masked then; num_generated None: assume not yet).

    prompt_logprobs does not matter here (the engine computes it from prompt rows, apart
    from sampling). Structured output arrives as a logits processor (a GrammarProcessor
    among the sequence's logits_processors), not through these parameters:
    sequence_on_device says whether such a sequence can sample on the device.
    """
    p = params
    if p.logprobs is not None and not logprobs:
        return False
    if edits:
        return True
    if p.logit_bias:
        return False
    if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        return False
    if p.min_tokens > 0 and (num_generated is None or num_generated < p.min_tokens):
        return False
    return True


def bitmask_only(processor: Any) -> bool:
    """Whether a logits processor is a BitmaskSource (fill_bitmask/accept_token), whose effect
    the device reproduces with its mask (GrammarProcessor, sampling/reasoning_gate.ReasoningGate)."""
    return callable(getattr(processor, "fill_bitmask", None)) and callable(getattr(processor, "accept_token", None))


def sequence_on_device(seq: SequenceSampler, with_masks: bool = False, with_edits: bool = False,
                       with_logprobs: bool = False) -> bool:
    """can_sample_on_device for a sequence at its current step. Its logits processors run on
    the host, unless with_masks (a DeviceSampler whose library can mask: masks_supported) and
    every one of them is bitmask_only: then the device applies their mask. with_edits: the
    library applies logit edits (edits_supported); with_logprobs: a DeviceSampler's draw, which
    reports logprobs from the row copied to the host."""
    if seq.logits_processors and not (with_masks and all(bitmask_only(p) for p in seq.logits_processors)):
        return False
    return can_sample_on_device(seq.params, seq.num_generated, edits=with_edits, logprobs=with_logprobs)


def edits_pay(seqs: Sequence[SequenceSampler]) -> bool:
    """Whether a batch is large enough that its logit edits are cheaper on the device than its rows'
    copy to the host and the host sampler (EDITS_MIN_ROWS)."""
    return len(seqs) >= EDITS_MIN_ROWS or (len(seqs) >= 2 and any(not seq.params.greedy for seq in seqs))


def batch_edit_lists(seqs: Sequence[SequenceSampler], vocab: int) -> tuple[np.ndarray, ...] | None:
    """APPLY_LOGIT_EDITS' eight arguments for a batch (row i: seqs[i]'s SequenceSampler.edit_lists):
    per kind the flat positions row * vocab + token (int64) and their float32 values, one -1
    padding entry in a kind no row has (a kernel of no threads cannot launch); None when no row
    has an edit."""
    if not any(seq.has_edits for seq in seqs):  # the common step: no arrays built
        return None
    lists = [seq.edit_lists() for seq in seqs]

    def at(ids_of) -> tuple[np.ndarray, list[int]]:  # noqa: ANN001 - EditLists -> ids
        ids = [ids_of(e) for e in lists]
        for row, row_ids in enumerate(ids):  # a token past the row would edit another row's logits
            if row_ids.size and (row_ids.min() < 0 or row_ids.max() >= vocab):
                raise VtoolError(f"row {row}: a logit edit names token {int(row_ids.max())} or "
                                 f"{int(row_ids.min())}, outside the vocabulary of {vocab} (eos or stop ids?)")
        parts = [row_ids.astype(np.int64) + row * vocab for row, row_ids in enumerate(ids)]
        sizes = [p.size for p in parts]
        flat = np.concatenate(parts) if sum(sizes) else np.full(1, -1, np.int64)
        return flat, sizes

    def values(parts: list[np.ndarray], sizes: list[int]) -> np.ndarray:
        return np.concatenate(parts).astype(np.float32) if sum(sizes) else np.zeros(1, np.float32)

    bias_at, sizes = at(lambda e: e.bias_ids)
    bias = values([e.bias for e in lists], sizes)
    mask_at, _ = at(lambda e: e.mask_ids)
    rep_at, sizes = at(lambda e: e.repetition_ids)
    rep = values([np.full(n, e.repetition, np.float32) for n, e in zip(sizes, lists)], sizes)
    pen_at, sizes = at(lambda e: e.penalty_ids)
    freq = values([e.frequency for e in lists], sizes)
    pres = values([np.full(n, e.presence, np.float32) for n, e in zip(sizes, lists)], sizes)
    return bias_at, bias, mask_at, rep_at, rep, pen_at, freq, pres


@dataclasses.dataclass(frozen=True)
class PreparedDraw:
    """A draw ready to launch: how many rows, which compiled function, its arguments (on the
    device), and the [rows, W] int32 token bitmask to apply first (on the device; None: no mask)."""

    rows: int
    function: str
    args: tuple
    bitmask: Any = None
    # APPLY_LOGIT_EDITS' lists on the device (None: no row has edits this step)
    edits: tuple | None = None
    # rows whose request asked for logprobs: their raw rows come to the host after the draw
    logprob_rows: tuple[int, ...] = ()
    # prepare_batch(defer_mask=True): the mask being filled on a worker (a Future of the words or
    # None); launch() uploads it once the model step is queued
    mask_job: Any = None


@dataclasses.dataclass(frozen=True)
class LaunchedDraw:
    """A queued draw's outputs on the device: token ids int32 [b], raw logprobs float64 [b]."""

    tokens: Any
    logprobs: Any
    masked: bool
    # the [rows, V] logits drawn from, and the rows whose raw row the host reads for logprobs
    logits: Any = None
    logprob_rows: tuple[int, ...] = ()


class DeviceSampler:
    """The compiled sampling functions of one loaded library.

    `model` is a vtool.runtime.artifact.library.CompiledModel (or anything with its `vm`, `upload`,
    `to_numpy` and `ffi`): the library must hold FUNCTIONS, built by
    schedules/cuda/sampler.sampler_module(vocab_size) for the model's vocabulary; with
    MASK_FUNCTIONS too (libraries built since they exist), masks_supported is True and
    sequences with grammars (bitmask-only logits processors) can sample here.
    """

    def __init__(self, model: Any, vocab_size: int | None = None):
        self.model = model
        self.vocab_size = int(vocab_size if vocab_size is not None else model.vocab_size)
        self._fns: dict[str, Any] = {}
        missing = []
        for name in FUNCTIONS:
            try:
                self._fns[name] = model.vm[name]
            except Exception:  # noqa: BLE001 - the VM answers a missing name with an FFI error
                missing.append(name)
        if missing:
            raise VtoolError(f"the library has no device sampling functions ({', '.join(missing)}); "
                             "rebuild it with a vtool that compiles them")
        for name in (*MASK_FUNCTIONS, ARGMAX_MASKED, TOP_P_TOP_K_FEW_ROWS, APPLY_LOGIT_EDITS):
            try:
                self._fns[name] = model.vm[name]
            except Exception:  # noqa: BLE001 - an older library: grammar rows sample on the host
                pass
        self.masks_supported = all(name in self._fns for name in MASK_FUNCTIONS)
        self.edits_supported = APPLY_LOGIT_EDITS in self._fns and TOKEN_LOGPROB in self._fns
        self._mask_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._create_view = global_func("runtime.TVMTensorCreateView")

    def can_sample(self, seqs: Sequence[SequenceSampler]) -> bool:
        """Whether every one of these sequences should sample here this step (prepare_batch
        takes them): sequence_on_device, with masks where the library has them, and with logit
        edits where the library has them and the batch is large enough for them to pay
        (EDITS_MIN_ROWS)."""
        edits = self.edits_supported and edits_pay(seqs)
        return all(sequence_on_device(seq, self.masks_supported, edits, with_logprobs=True) for seq in seqs)

    # -- the calls ------------------------------------------------------------------------
    def sample(self, logits: Any, params: Sequence[SamplingParams],
               rngs: Sequence[np.random.Generator | None]) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int32 [b], raw logprobs of those tokens float64 [b]) for the first b =
        len(params) rows of `logits`: a device tensor holding b or more rows of vocab_size
        float32 (any shape, e.g. batch_decode's [b, 1, V]), or a numpy array (uploaded).

        rngs[i] is row i's request Generator; random rows draw one uniform from it (greedy
        rows none, and may pass None). Refuses a row whose parameters are outside the
        ranges SamplingParams.validate accepts (the same SamplingParamsError); top_k past
        the vocabulary is off, as on the host. A row whose logits hold a NaN or no finite
        maximum raises VtoolError, as the host sampler does.
        """
        prepared = self.prepare(params, rngs)
        return self.collect(self.launch(logits, prepared))

    def prepare(self, params: Sequence[SamplingParams],
                rngs: Sequence[np.random.Generator | None]) -> PreparedDraw:
        """Everything a draw needs but the logits, on the device: the parameters and each
        random row's uniform (drawn now, one per random step). Done before the model step is
        queued, because a host-to-device copy waits for the work queued before it."""
        b = len(params)
        if len(rngs) != b:
            raise VtoolError(f"DeviceSampler.sample: {b} params but {len(rngs)} generators")
        greedy = np.fromiter((p.greedy for p in params), dtype=bool, count=b)
        if b == 0:
            return PreparedDraw(0, ARGMAX, ())
        temperature, top_p, top_k, min_p = self._parameters(params, greedy)  # refuses, whatever the batch
        if greedy.all():
            return PreparedDraw(b, ARGMAX, ())
        uniform = np.zeros(b, np.float64)
        for i in np.flatnonzero(~greedy):
            rng = rngs[i]
            if rng is None:
                raise VtoolError(f"DeviceSampler.sample: row {i} samples at random but has no Generator")
            uniform[i] = rng.random()  # one per random step, as the host's _sample_filtered
        m, V = self.model, self.vocab_size
        args_t = m.upload(temperature, "float32", slot="sampler.temperature")
        args_m = m.upload(min_p, "float32", slot="sampler.min_p")
        args_u = m.upload(uniform, "float64", slot="sampler.uniform")
        filtered = (top_p < 1.0) | ((top_k > 0) & (top_k < V))
        if filtered[~greedy].any():
            function = TOP_P_TOP_K_FEW_ROWS if b < FEW_ROWS and TOP_P_TOP_K_FEW_ROWS in self._fns else TOP_P_TOP_K
            return PreparedDraw(b, function, (args_t, m.upload(top_p, "float64", slot="sampler.top_p"),
                                                 m.upload(top_k, "int32", slot="sampler.top_k"), args_m, args_u))
        return PreparedDraw(b, TEMPERATURE, (args_t, args_m, args_u))  # no sort needed

    def launch(self, logits: Any, prepared: PreparedDraw) -> LaunchedDraw | None:
        """Queue the draw on the device (the mask first, when the draw has one); collect()
        waits for it."""
        if prepared.rows == 0:
            return None
        view = self._rows(logits, prepared.rows)
        out = self._launch(view, prepared)
        if prepared.logprob_rows:
            return dataclasses.replace(out, logits=view, logprob_rows=prepared.logprob_rows)
        return out

    def _launch(self, view: Any, prepared: PreparedDraw) -> LaunchedDraw:
        if prepared.mask_job is not None:
            words = prepared.mask_job.result()
            bitmask = self.model.upload(words, "int32", slot="sampler.bitmask") if words is not None else None
            prepared = dataclasses.replace(prepared, bitmask=bitmask, mask_job=None)
        if prepared.bitmask is None and prepared.edits is None:
            out = self._fns[prepared.function](view, *prepared.args)
            return LaunchedDraw(out[0], out[1], False)
        if prepared.function == ARGMAX and ARGMAX_MASKED in self._fns and prepared.edits is None:
            out = self._fns[ARGMAX_MASKED](view, prepared.bitmask)
            return LaunchedDraw(out[0], out[1], True)
        # The host's order: the logits processors' mask, then the edits (process_logits).
        edited = view if prepared.bitmask is None else self._fns[APPLY_TOKEN_BITMASK](view, prepared.bitmask)
        if prepared.edits is not None:
            edited = self._fns[APPLY_LOGIT_EDITS](edited, *prepared.edits)
        tokens = self._fns[prepared.function](edited, *prepared.args)[0]
        # The sampling function's logprob is the processed row's; the host reports the raw one.
        return LaunchedDraw(tokens, self._fns[TOKEN_LOGPROB](view, tokens), True)

    def collect(self, out: LaunchedDraw | None) -> tuple[np.ndarray, np.ndarray]:
        """The drawn (token ids, logprobs) on the host: waits for the device."""
        if out is None:
            return np.zeros(0, np.int32), np.zeros(0, np.float64)
        tokens = np.array(self.model.to_numpy(out.tokens), dtype=np.int32, copy=True)
        logprobs = np.array(self.model.to_numpy(out.logprobs), dtype=np.float64, copy=True)
        # A drawn token has a finite logit, so its raw logprob is finite unless the unmasked
        # row has a NaN/inf (the host refuses such a row, masked or not).
        bad = np.flatnonzero((tokens < 0) | ~np.isfinite(logprobs))
        if bad.size:
            i = int(bad[0])
            if out.masked and tokens[i] < 0:
                raise VtoolError(f"logits row {i}: its grammar mask or min_tokens' masking of eos/stop ids "
                                 "allows no token with a finite logit, or the row holds NaN/inf")
            raise VtoolError(f"logits row {i} has no finite maximum (NaN/inf in the row): "
                             "the model produced NaN/inf")
        return tokens, logprobs

    def sample_batch(self, logits: Any, seqs: Sequence[SequenceSampler]) -> list[SampleResult]:
        """runtime.sampling.sample_batch on the device: one token per row for seqs[i], which
        records it (its logits processors, grammars, accept it). The sequences must pass
        can_sample (else the host must sample them: a ValueError, a caller's mistake)."""
        prepared = self.prepare_batch(seqs)
        return self.finish_batch(seqs, self.launch(logits, prepared))

    def prepare_batch(self, seqs: Sequence[SequenceSampler], defer_mask: bool = False) -> PreparedDraw:
        """prepare() for these sequences (checked as sample_batch checks them), with the
        batch's token bitmask filled and uploaded when a sequence has a grammar. Before the
        model step is queued: the upload waits for the work queued before it.

        defer_mask: the mask is filled on a worker thread while the caller queues the model
        step (llguidance drops the GIL while it fills), and launch() uploads it: that upload
        waits for the model step, but the filling no longer keeps the device idle."""
        for i, seq in enumerate(seqs):
            if not sequence_on_device(seq, self.masks_supported, self.edits_supported, with_logprobs=True):
                raise ValueError(f"sequence {i} needs the host sampler (logits processors this library cannot "
                                 "mask, or penalties, logit_bias or min_tokens on a library without "
                                 f"{APPLY_LOGIT_EDITS}); check can_sample first")
            seq._check_vocab(self.vocab_size)  # the host's per-vocabulary validation
        words = job = None
        if any(seq.logits_processors for seq in seqs):  # before any uniform is drawn: it may raise
            if defer_mask:
                for seq in seqs:
                    for processor in seq.logits_processors:
                        check = getattr(getattr(processor, "active_grammar", processor), "check", None)
                        if check is not None:
                            check()  # a grammar in an error state raises here, not on the worker
                if self._mask_pool is None:
                    self._mask_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vtool-mask")
                job = self._mask_pool.submit(self._fill, [seq.logits_processors for seq in seqs])
            else:
                words = self._fill([seq.logits_processors for seq in seqs])
        prepared = self.prepare([s.params for s in seqs], [s.rng for s in seqs])
        wanted = tuple(i for i, seq in enumerate(seqs) if seq.params.logprobs is not None)
        if wanted and prepared.rows:
            prepared = dataclasses.replace(prepared, logprob_rows=wanted)
        if prepared.rows and self.edits_supported:
            edits = batch_edit_lists(seqs, self.vocab_size)
            if edits is not None:
                prepared = dataclasses.replace(prepared, edits=tuple(
                    self.model.upload(a, str(a.dtype), slot=f"sampler.{name}") for name, a in zip(_EDIT_SLOTS, edits)))
        if job is not None:
            return dataclasses.replace(prepared, mask_job=job) if prepared.rows else prepared
        if words is None or prepared.rows == 0:
            return prepared
        return dataclasses.replace(prepared, bitmask=self.model.upload(words, "int32", slot="sampler.bitmask"))

    def _fill(self, processors: list[Sequence[Any]]) -> np.ndarray | None:
        """The batch's [rows, W] mask; None when it masks nothing (say, grammars that wait for
        the reasoning's end)."""
        words = np.empty((len(processors), bitmask_words(self.vocab_size)), np.int32)
        fill_batch_bitmask(processors, words)
        return None if (words == -1).all() else words

    def finish_batch(self, seqs: Sequence[SequenceSampler], out: LaunchedDraw | None) -> list[SampleResult]:
        """Wait for a launched draw; each sequence records its token (append_token: its logits
        processors accept it, once)."""
        tokens, logprobs = self.collect(out)
        raw = self._raw_rows(out) if out is not None and out.logprob_rows else {}
        scratch = scratch_buffers(self.vocab_size) if raw else None
        results = []
        for i, (seq, token, logprob) in enumerate(zip(seqs, tokens.tolist(), logprobs.tolist())):
            if i in raw:  # the host's report from the raw row: logprob, rank and top-N
                row = raw[i]
                results.append(raw_logprobs(row, row.max(), token, seq.params.logprobs, scratch))
            else:
                results.append(SampleResult(token_id=token, logprob=logprob))
            seq.append_token(token)
        return results

    def _raw_rows(self, out: LaunchedDraw) -> dict[int, np.ndarray]:
        """The raw logits rows of out.logprob_rows on the host, copied in one span (first to last
        such row) rather than the whole batch."""
        rows = out.logprob_rows
        first, last = min(rows), max(rows)
        V, m = self.vocab_size, self.model
        span = self._create_view(out.logits, m.ffi.Shape([last - first + 1, V]), "float32", first * V * 4)
        host = np.asarray(m.to_numpy(span), dtype=np.float32).reshape(-1, V)
        return {i: host[i - first] for i in rows}

    # -- helpers --------------------------------------------------------------------------
    def _parameters(self, params: Sequence[SamplingParams],
                    greedy: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        b = len(params)
        t = np.fromiter((p.temperature for p in params), dtype=np.float64, count=b)
        top_p = np.fromiter((p.top_p for p in params), dtype=np.float64, count=b)
        min_p = np.fromiter((p.min_p for p in params), dtype=np.float64, count=b)
        top_k = np.fromiter((p.top_k for p in params), dtype=np.int64, count=b)
        # SamplingParams.validate's ranges; NaN fails every comparison.
        ok = ((t >= 0) & (t <= 2) & (top_p > 0) & (top_p <= 1) & (min_p >= 0) & (min_p <= 1)
              & (top_k >= -1))
        ok &= np.fromiter((isinstance(p.top_k, (int, np.integer)) and not isinstance(p.top_k, bool)
                           for p in params), dtype=bool, count=b)
        for i in np.flatnonzero(~ok):
            params[i].validate(self.vocab_size)  # raises SamplingParamsError naming the field
            raise SamplingParamsError("sampling parameters", params[i], "inside SamplingParams' ranges")
        temperature = np.where(greedy, 0.0, np.maximum(t, 0.01)).astype(np.float32)  # sampling_temperature
        # top_k past the vocabulary is off, as the host's `0 < top_k < V`; the device treats
        # k <= 0 and k >= V alike, so clip into int32 range.
        top_k32 = np.clip(top_k, -1, self.vocab_size).astype(np.int32)
        return temperature, top_p, top_k32, min_p.astype(np.float32)

    def _rows(self, logits: Any, b: int) -> Any:
        """A [b, V] float32 view of the first b rows of `logits`."""
        V, m = self.vocab_size, self.model
        if isinstance(logits, np.ndarray):
            array = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1, V)
            if array.shape[0] < b:
                raise VtoolError(f"logits hold {array.shape[0]} rows of {V}, {b} needed")
            return m.upload(array[:b], "float32")
        shape = [int(d) for d in logits.shape]
        size = int(np.prod(shape)) if shape else 1
        if str(logits.dtype) != "float32" or size % V or size // V < b:
            raise VtoolError(f"logits tensor {shape} {logits.dtype} does not hold {b} float32 rows of {V}")
        if shape == [b, V]:
            return logits
        return self._create_view(logits, m.ffi.Shape([b, V]), "float32", 0)
