"""The model runner: one SchedulerOutput in, one ModelRunnerOutput out.

It turns the scheduled sequences into device calls (embed, then `decode` / `batch_decode`
when every sequence computes one token, else `batch_prefill` over the packed tokens with the
positions whose logits are wanted), and samples the sequences that asked for it: on the
device with the library's compiled sampler when every such sequence allows it (grammar rows
included, masked on the device, when the library has the masking functions), else on the
host. It knows nothing of queues, requests' text or stop strings.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Hashable
from typing import Any

import numpy as np

from vtool import VtoolError
from vtool.runtime.artifact.tvm_runtime import global_func
from vtool.runtime.engine.block_decode import prompt_path_rows, tensor_core_batches
from vtool.runtime.engine.chained_steps import DeviceTokens, fill_token_ids
from vtool.runtime.engine.decode_buckets import CAPTURED_VERIFY_ENTRY, DecodeBuckets, captured_verify_tokens
from vtool.runtime.engine.kv_cache import PagedKVCache
from vtool.runtime.engine.mixed_steps import gather_rows, row_sources, split_rows, splits_mixed_steps
from vtool.runtime.engine.model_thread import Beside, ModelThread
from vtool.runtime.engine.step_types import ModelRunnerOutput, ScheduledSequence, SchedulerOutput, SequenceResult
from vtool.runtime.sampling.bitmask_batch import prefill_grammars
from vtool.runtime.sampling.device import ARGMAX, DeviceSampler, PreparedDraw
from vtool.runtime.sampling.host import SampleResult, sample_batch
from vtool.runtime.sampling.spec_verify import greedy_on_device, verify_drafts, verify_greedy_argmax

log = logging.getLogger("vtool.engine")


# decode as two entry points, layers then logits (CUDA builds; models/decoder.py)
SPLIT_DECODE = ("decode_hidden", "decode_logits")


class StepLogits:
    """One step's logits, left where the model wrote them (rows [n, V] of float32), with
    the sequence each row belongs to (owners[r]; -1 for a row no sequence needs). They come
    to the host once, and only if a host sampler or returned rows ask for them."""

    def __init__(self, model: Any, tensor: Any, vocab_size: int, owners: list[int]):
        self.model, self.tensor, self.vocab_size = model, tensor, vocab_size
        self._owner_list = owners
        self._owners: np.ndarray | None = None  # the array, made when first asked for
        self._host: np.ndarray | None = None

    @property
    def owners(self) -> np.ndarray:
        if self._owners is None:
            self._owners = np.asarray(self._owner_list)
        return self._owners

    @property
    def num_rows(self) -> int:
        return len(self._owner_list)

    def rows_are(self, items: list[int]) -> bool:
        """Whether the rows are exactly these sequences' rows, one each, in this order (then
        the tensor itself can be sampled on the device)."""
        return self._owner_list == list(items)

    def host(self) -> np.ndarray:
        """Every row on the host, [n, V] (copied from the device once)."""
        if self._host is None:
            self._host = self.model.to_numpy(self.tensor).reshape(len(self._owner_list), self.vocab_size)
        return self._host

    def last_rows(self, items: list[int]) -> np.ndarray:
        """The last row of each of these sequences, [len(items), V]: the host array itself
        (no copy) when the rows are exactly these sequences', one each, in order."""
        if self.rows_are(items):
            return self.host()
        return np.stack([self.rows(i)[-1] for i in items])

    def rows(self, item: int) -> np.ndarray | None:
        """A sequence's rows on the host, [k, V], or None when the step computed none for it."""
        if item not in self._owner_list:
            return None
        return self.host()[self.owners == item]


def logit_owners(step: SchedulerOutput) -> list[int]:
    """The sequence each row of the step's logits belongs to (-1: a row only there because
    an entry point needs one), as _forward lays them out."""
    if step.all_decode:
        return [i if s.num_logit_rows else -1 for i, s in enumerate(step.sequences)]
    owners = [i for i, s in enumerate(step.sequences) for _ in range(s.num_logit_rows)]
    return owners or [-1]


@dataclasses.dataclass
class InFlightStep:
    """A launched step: its logits (on the device) and, when the device draws, the draw."""

    step: SchedulerOutput
    logits: StepLogits
    to_sample: list[int]
    samplers: list[Any]
    on_device: bool
    draw: Any = None
    # a greedy verification step's argmax of every row, drawn on the device (_greedy_rows_on_device)
    argmax_rows: Any = None
    # a draw whose grammar mask is still being filled: queue_draw() queues it (finish() at the latest)
    pending_draw: PreparedDraw | None = None
    # the host work launch() was given ran beside the model's call (engine/model_thread.py)
    beside_ran: bool = False


class ModelRunner:
    def __init__(self, model: Any, kv: PagedKVCache, device_sampling: bool = True, continuations: bool = False,
                 model_thread: ModelThread | None = None):
        """continuations: every multi-token step holds tokens already decided elsewhere (a
        draft model catching up with its target), so it runs with decode's numerics too.
        model_thread: where an entry-point call runs beside the host work launch() is given
        (engine/model_thread.py); None: every call runs on the caller's thread."""
        self.model = model
        self.model_thread = model_thread
        self._beside: Beside | None = None  # launch()'s host work, until an entry call takes it
        self._beside_seconds = 0.0
        self.continuations = continuations
        self.kv = kv
        self.vocab_size = model.vocab_size
        self._create_view = global_func("runtime.TVMTensorCreateView")
        # The entry points return (logits, kv cache) as a tvm_ffi Array: its first item in one
        # call (Array[0] makes two, len and get, behind Python index checks).
        self._first = global_func("ffi.ArrayGetItem")
        self.device_sampler = self._make_device_sampler() if device_sampling else None
        # Host seconds spent in each half of execute: launching the model (on a GPU the
        # kernels are queued, not waited for) and sampling (on a GPU: the wait for the step).
        self.seconds = {"forward": 0.0, "sample": 0.0}
        self._shapes: dict[tuple[int, ...], Any] = {}  # _shape's
        self.decode_buckets = DecodeBuckets.for_model(model, kv)  # None: no captured batch_decode
        # the library's decode in two calls (models/decoder.py): a chained one-sequence step's
        # fence goes between its layers and its lm_head
        self.split_decode = set(SPLIT_DECODE) <= set(getattr(model, "manifest", {}).get("entry_points", ()))
        self.verify_graph_tokens = captured_verify_tokens(model)  # 0: no captured batch_verify
        # weights kept in blocks on a GPU: decode steps past this many sequences run as
        # batch_verify, through the prompt path's matmuls (block_decode.py); None: never
        self.block_gemv_rows = prompt_path_rows(model)
        # batch_decode over blocks on the tensor cores costs about 1.6x the block GEMV of
        # `decode` for one sequence (block_decode.py): a lone sequence takes `decode`
        self.single_on_decode = tensor_core_batches(model)
        # a step of prompt chunks beside decodes runs as two calls (mixed_steps.py; opt-in)
        self.split_mixed = splits_mixed_steps()
        self.split_steps = 0  # mixed steps run as two calls
        if self.split_mixed and getattr(model, "on_gpu", False):
            from vtool.runtime.artifact.tvm_runtime import cuda_runtime

            # the second call may not rewrite TVM's page tables under the first (a split step has 2+ rows)
            kv.fence_steps(cuda_runtime(), min_rows=2)
        self._copy = global_func("runtime.TVMTensorCopyFromTo")

    def _make_device_sampler(self) -> DeviceSampler | None:
        """The library's sampling functions on a GPU (the full logits then stay there), or
        None: on the CPU the host sampler reads the logits in place anyway, and a library
        built without the functions samples on the host too."""
        if not getattr(self.model, "on_gpu", False):
            return None
        try:
            return DeviceSampler(self.model)
        except VtoolError as err:
            log.warning("sampling on the host: %s", err)
            return None

    @property
    def queues_work(self) -> bool:
        """Whether launch() returns before the device has finished (a GPU): then the engine
        can do the host work of one step while the device runs the next."""
        return bool(getattr(self.model, "on_gpu", False))

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.finish(self.launch(step))

    def launch(self, step: SchedulerOutput, device_tokens: DeviceTokens | None = None,
               beside: Beside | None = None) -> InFlightStep:
        """Queue the step: the model, and the draw when the device samples every row that
        samples (its inputs, grammar masks included, uploaded first: a host-to-device copy
        waits for the queued work). device_tokens: an all-decode step whose input tokens the
        step before drew on the device (engine/chained_steps.py). beside: host work to run
        while the model's call queues the step (engine/model_thread.py); the result's
        beside_ran says whether it ran (if not, the caller runs it)."""
        t0 = time.perf_counter()
        self._beside, self._beside_seconds = beside, 0.0
        sequences = step.sequences
        to_sample = [i for i, s in enumerate(sequences) if s.sample]
        samplers = [sequences[i].sampler for i in to_sample]
        prepared = None
        if (to_sample and self.device_sampler is not None and logit_owners(step) == to_sample
                and self.device_sampler.can_sample(samplers)):
            # a grammar mask is filled on a worker while the model step is queued
            prepared = self.device_sampler.prepare_batch(samplers, defer_mask=True)
        try:
            logits = self._forward(step, device_tokens)
        finally:
            beside_ran, self._beside = self._beside is None and beside is not None, None
        draw = pending = None
        if prepared is not None and prepared.mask_job is not None:
            pending = prepared  # queue_draw: after the caller's host work, while the model step runs
        elif prepared is not None:
            draw = self.device_sampler.launch(logits.tensor, prepared)
        argmax_rows = None
        if prepared is None and to_sample and self._greedy_rows_on_device(step, logits, samplers):
            argmax_rows = self.device_sampler.launch(logits.tensor, PreparedDraw(logits.num_rows, ARGMAX, ()))
        self.seconds["forward"] += time.perf_counter() - t0 - self._beside_seconds
        return InFlightStep(step, logits, to_sample, samplers, prepared is not None, draw, argmax_rows, pending,
                            beside_ran)

    def call_entry(self, key: Hashable, fn: Any, *args: Any) -> Any:
        """A decode entry-point call of a step being launched, beside the launch's host work when
        there is a model thread (the work runs once per launch, at its first such call);
        `key` names the call's CUDA graphs (model_thread.py: unseen ones run alone). Only
        all-decode steps come here (the only ones chained), so the keys seen stay few: one per
        batch size. Multi-token steps call their entry directly."""
        beside = self._beside
        if self.model_thread is None or beside is None or not self.model_thread.knows(key):
            return self.model_thread.call(key, fn, args, None) if self.model_thread is not None else fn(*args)
        self._beside = None  # taken: launch() reports it ran
        t0 = time.perf_counter()

        def timed() -> None:
            try:
                beside()
            finally:
                self._beside_seconds += time.perf_counter() - t0

        return self.model_thread.call(key, fn, args, timed)

    def queue_draw(self, flight: InFlightStep) -> None:
        """Queue a launched step's draw if it waits for a grammar mask (launch() left it
        pending). The mask is filled on a worker while the model step runs; the engine calls
        this after its host work for the previous step (building outputs), so that work does
        not wait behind the fill and the mask's copy, which queues after the model step."""
        if flight.pending_draw is None:
            return
        t0 = time.perf_counter()
        prepared, flight.pending_draw = flight.pending_draw, None
        flight.draw = self.device_sampler.launch(flight.logits.tensor, prepared)
        self.seconds["forward"] += time.perf_counter() - t0

    def _greedy_rows_on_device(self, step: SchedulerOutput, logits: StepLogits, samplers: list[Any]) -> bool:
        """Whether a step with speculative verification can take every row's argmax on the
        device: every row is a sampling sequence's and every such sequence is greedy with
        nothing that edits or reads its rows. Then only the tokens come to the host, not
        k+1 rows of the vocabulary per sequence."""
        if self.device_sampler is None or not any(s.draft_ids for s in step.sequences):
            return False
        owners = logits.owners
        sampling = {i for i, s in enumerate(step.sequences) if s.sample}
        return (bool(owners.size) and set(owners.tolist()) == sampling
                and all(greedy_on_device(seq) for seq in samplers))

    def argmax_rows(self, step: SchedulerOutput) -> tuple[np.ndarray, np.ndarray]:
        """Run the step and take every logit row's argmax on the device: (token ids, the
        sequence each row belongs to, -1 for none). Only the ids come to the host, not rows of
        the vocabulary (a greedy draft model's proposals: on a GPU, copying a 150k-entry row
        back and scanning it in numpy costs more than the draft's step itself)."""
        if self.device_sampler is None:
            raise VtoolError("argmax_rows needs the device sampler (a GPU library with sampling functions)")
        t0 = time.perf_counter()
        logits = self._forward(step)
        launched = self.device_sampler.launch(logits.tensor, PreparedDraw(logits.num_rows, ARGMAX, ()))
        self.seconds["forward"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        tokens, _ = self.device_sampler.collect(launched)
        self.seconds["sample"] += time.perf_counter() - t0
        return tokens, logits.owners

    def finish(self, flight: InFlightStep) -> ModelRunnerOutput:
        """Wait for a launched step and sample what the device did not: the results."""
        self.queue_draw(flight)
        t0 = time.perf_counter()
        try:
            sequences = flight.step.sequences
            results = [SequenceResult(s.request_id) for s in sequences]
            for i, s in enumerate(sequences):
                if s.return_logits:
                    results[i].logits = flight.logits.rows(i)
            if flight.to_sample:
                if flight.on_device:
                    drawn = self.device_sampler.finish_batch(flight.samplers, flight.draw)
                elif flight.argmax_rows is not None:
                    self._finish_greedy_rows(flight, results)
                    return ModelRunnerOutput(results)
                else:
                    plain = [i for i in flight.to_sample if not sequences[i].draft_ids]
                    # The grammar rows' masks in one parallel call, before the logits come to
                    # the host (on a GPU, while the step may still run); sample_batch uses them.
                    rows = [sequences[i].sampler.logits_processors for i in plain]
                    if any(rows):
                        prefill_grammars(rows)
                    drawn = sample_batch(flight.logits.last_rows(plain), [sequences[i].sampler for i in plain]) \
                        if plain else []
                    for i in flight.to_sample:
                        if sequences[i].draft_ids:
                            self._verify(sequences[i], flight.logits.rows(i), results[i])
                    flight.to_sample = plain
                for i, result in zip(flight.to_sample, drawn):
                    results[i].sampled = result
            return ModelRunnerOutput(results)
        finally:
            self.seconds["sample"] += time.perf_counter() - t0

    def _finish_greedy_rows(self, flight: InFlightStep, results: list[SequenceResult]) -> None:
        """Each sampling sequence's tokens from the device's argmax of its rows: a plain
        sequence takes its row's, a speculating one what verification keeps."""
        tokens, logprobs = self.device_sampler.collect(flight.argmax_rows)
        owners = flight.logits.owners
        for i in flight.to_sample:
            s = flight.step.sequences[i]
            rows = np.flatnonzero(owners == i)
            if s.draft_ids:
                taken, results[i].num_accepted = verify_greedy_argmax(
                    tokens[rows].tolist(), logprobs[rows].tolist(), s.draft_ids, s.sampler, len(s.draft_ids) + 1)
                results[i].sampled, results[i].more = taken[0], taken[1:]
            else:
                row = int(rows[-1])
                s.sampler.append_token(int(tokens[row]))
                results[i].sampled = SampleResult(token_id=int(tokens[row]), logprob=float(logprobs[row]))

    @staticmethod
    def _verify(sequence: ScheduledSequence, rows: np.ndarray, result: SequenceResult) -> None:
        """Keep what the target model accepts of the sequence's drafts (sampling/spec_verify.py);
        the engine proposed no more drafts than the request has room for after its next token."""
        drafts = sequence.draft_ids
        taken, result.num_accepted = verify_drafts(rows, drafts, sequence.sampler, len(drafts) + 1,
                                                   sequence.draft_probs)
        result.sampled, result.more = taken[0], taken[1:]

    def _multi_token_entry(self, step: SchedulerOutput, num_rows: int) -> str:
        """batch_verify (decode's numerics) for a step of decodes and speculative verifications
        only (or any step of a continuations runner), so greedy speculation gives decoding's
        tokens: captured in a CUDA graph when the library has it, the step wants logits at every
        position and it holds few enough tokens. batch_prefill when a prompt chunk is in the step
        (or the library predates batch_verify)."""
        verify = self.continuations or all(s.num_tokens == 1 + len(s.draft_ids) for s in step.sequences)
        if not verify or not self.model.has_function("batch_verify"):
            return "batch_prefill"
        if num_rows == step.num_tokens <= self.verify_graph_tokens:
            return CAPTURED_VERIFY_ENTRY
        return "batch_verify"

    def _shape(self, *dims: int) -> Any:
        """The tvm_ffi Shape of these dimensions, made once (a Shape costs microseconds)."""
        shape = self._shapes.get(dims)
        if shape is None:
            if len(self._shapes) >= 256:  # prefill shapes follow the packed token count
                self._shapes.clear()
            shape = self._shapes[dims] = self.model.ffi.Shape(list(dims))
        return shape

    def _forward_split(self, step: SchedulerOutput, parts: tuple[list[int], list[int]],
                       owners: list[int]) -> StepLogits:
        """A mixed step as an all-decode step and a prompt step, its wanted rows gathered into
        one device buffer in the step's order (mixed_steps.py)."""
        sequences = step.sequences
        self.split_steps += 1
        done: list[tuple[list[int], StepLogits]] = []
        with self.kv.one_step(len(sequences)):  # the fence sees the whole step's rows
            for k, indices in enumerate(parts):
                # TVM copies each forward's page tables into one device buffer on a copy stream that
                # does not wait for queued kernels (kv_cache.py fence_steps): the second call's
                # begin_forward waits for the first call's model work
                sub = SchedulerOutput(tuple(sequences[i] for i in indices))
                done.append((indices, self._forward(sub, queued_early=k > 0)))
        sources = row_sources(owners, [(indices, logits._owner_list) for indices, logits in done])
        tensor = gather_rows(self.model, self._create_view, self._copy, self.vocab_size, sources,
                             [logits.tensor for _, logits in done])
        return StepLogits(self.model, tensor, self.vocab_size, owners)

    def _forward(self, step: SchedulerOutput, device_tokens: DeviceTokens | None = None,
                 queued_early: bool = False) -> StepLogits:
        """Run the batch; the logits of the rows the sequences want, left on the device.
        queued_early: queued behind another forward of the same step (a split mixed step's second
        call), so its begin_forward waits for that one's model work; a chained step (device_tokens)
        always is."""
        m = self.model
        sequences = step.sequences
        all_decode = step.all_decode
        if all_decode and device_tokens is None and self.block_gemv_rows is not None \
                and len(sequences) > self.block_gemv_rows:
            all_decode = False  # one token per sequence through batch_verify (block_decode.py)
        if device_tokens is not None and not all_decode:
            raise VtoolError("a step whose tokens are on the device must be all decode")
        if not all_decode and self.split_mixed and (parts := split_rows(step)) is not None:
            owners = logit_owners(step)
            if -1 not in owners:
                return self._forward_split(step, parts, owners)
        if all_decode and self.decode_buckets is not None and not (len(sequences) == 1 and self.single_on_decode):
            # CUDA graphs, padded (decode_buckets.py)
            padded = self.decode_buckets.forward(step, device_tokens, self.call_entry)
            if padded is not None:
                owners = [i if s.num_logit_rows else -1 for i, s in enumerate(sequences)]
                return StepLogits(m, padded, self.vocab_size, owners)
        if all_decode:
            tokens = [s.token_ids[0] for s in sequences]
            lengths = [1] * len(sequences)
        else:
            tokens = [t for s in sequences for t in s.token_ids]
            lengths = [s.num_tokens for s in sequences]
        seq_ids = [s.seq_id for s in sequences]
        ids = m.upload_ints(tokens, "ids") if device_tokens is None else \
            fill_token_ids(m, tokens, device_tokens, self._create_view)
        flat = m.function("embed")(ids, m.params)
        self.kv.begin_forward(seq_ids, lengths, queued_early=queued_early or device_tokens is not None)
        ended = False
        try:
            if all_decode:
                embeds = self._create_view(flat, self._shape(len(sequences), 1, m.hidden_size), m.dtype, 0)
                owners = [i if s.num_logit_rows else -1 for i, s in enumerate(sequences)]
                if len(sequences) == 1 and device_tokens is not None and self.split_decode:
                    # A chained step (queued behind the last): its layers, then the fence, then its
                    # lm_head, so the step chained behind it waits for the layers only.
                    hidden = self._first(self.call_entry((SPLIT_DECODE[0], 1), m.function(SPLIT_DECODE[0]),
                                                         embeds, self.kv.tvm, m.params), 0)
                    ended = True
                    self.kv.end_forward()
                    logits = m.function(SPLIT_DECODE[1])(hidden, m.params)
                    return StepLogits(m, logits, self.vocab_size, owners)
                # One sequence takes the static-shape `decode`: on CUDA it is a captured graph
                # of GEMV kernels, where batch_decode's symbolic batch runs uncaptured matmuls.
                entry = "decode" if len(sequences) == 1 else "batch_decode"
                logits = self._first(self.call_entry((entry, len(sequences)), m.function(entry),
                                                     embeds, self.kv.tvm, m.params), 0)
                return StepLogits(m, logits, self.vocab_size, owners)
            positions: list[int] = []
            owners: list[int] = []
            offset = 0
            for i, s in enumerate(sequences):
                end = offset + s.num_tokens
                picked = range(end - s.num_logit_rows, end)
                positions.extend(picked)
                owners.extend([i] * len(picked))
                offset = end
            if not positions:
                positions, owners = [offset - 1], [-1]  # the entry point needs one; its row is dropped
            embeds = self._create_view(flat, self._shape(1, len(tokens), m.hidden_size), m.dtype, 0)
            logits = self._first(m.function(self._multi_token_entry(step, len(positions)))(
                embeds, m.upload_ints(positions, "positions"), self.kv.tvm, m.params), 0)
            return StepLogits(m, logits, self.vocab_size, owners)
        finally:
            if not ended:
                self.kv.end_forward()
