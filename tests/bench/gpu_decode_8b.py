"""Llama-3-8B-shaped bf16 decode on one GPU: vtool against transformers, in one run.

    python tests/bench/gpu_decode_8b.py --artifact DIR [--checkpoint DIR] [--steps 128]
    python tests/bench/gpu_decode_8b.py --artifact DIR --checkpoint FILE.gguf    # weights kept in blocks
    python tests/bench/gpu_decode_8b.py --artifact BF16_DIR --artifact FP8_DIR    # several builds, one run

A .gguf checkpoint (tests/bench/shape_gguf.py writes one of the same shape) is measured with
its own bytes as the roofline's numerator, and without the transformers peers (they run the
bf16 checkpoint: run them in the same call with the bf16 artifact).

Random weights (the speed does not depend on them): transformers makes the checkpoint on
the GPU with a fixed seed and saves it as safetensors, vtool loads that same checkpoint
through its normal loader. Measured in the same process:
  * device-to-device copy bandwidth (torch), the roofline denominator;
  * vtool batch-1 decode through the `decode` entry point, the host synchronised once per
    loop (the model step alone), and through the single-sequence generator, which copies
    logits to the host every step (what `vtool run` pays);
  * vtool `batch_decode` steps at batch 1, 8, 32, 64;
  * vtool prefill of 128 and 2048 tokens;
  * transformers with StaticCache + torch.compile(mode="reduce-overhead") at batch 1, and
    its eager prefill of 128/2048 tokens.
Prints one JSON line per measurement and a summary; writes them to $OUT/gpu8b.json when set.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The config the artifact was built from (tests/bench/shape_checkpoint.py builds it here
# without weights); written over transformers' own config.json so the runtime's config
# check compares like with like whatever transformers version saved the weights.
CONFIG_PATH = Path(__file__).with_name("llama8b_config.json")
CONFIG = {k: v for k, v in json.loads(CONFIG_PATH.read_text()).items()
          if k not in ("architectures", "model_type", "torch_dtype")}
RESULTS: list[dict] = []
LABEL: dict[str, str] = {}  # the artifact being measured, added to every record while set


def record(**kw) -> None:
    kw = {**LABEL, **kw}
    RESULTS.append(kw)
    print(json.dumps(kw), flush=True)


def manifest_weight_bytes(artifact: Path) -> int:
    """Bytes of weights a decode step reads, from the artifact's own parameters: every one once
    (bf16, FP8 with its row scales, GGUF block parts) except an untied embedding table, read one
    row at a time."""
    params = json.loads((Path(artifact) / "manifest.json").read_text())["params"]
    names = {p["name"] for p in params}
    skip = {"model.embed_tokens.weight"} if "lm_head.weight" in names else set()
    sizes = {"float8_e4m3fn": 1, "uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2, "float32": 4}
    return sum(int(np.prod(p["shape"])) * sizes[p["dtype"]] for p in params if p["name"] not in skip)


def make_checkpoint(folder: Path) -> None:
    from random_checkpoint import make_random_checkpoint

    seconds = make_random_checkpoint(CONFIG_PATH, folder)
    if seconds:
        record(step="checkpoint_saved", seconds=round(seconds, 1))


def dirty_kib() -> int:
    """Dirty + Writeback page-cache kB (/proc/meminfo): file data not yet on disk."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    return sum(int(fields.get(name, "0 kB").split()[0]) for name in ("Dirty", "Writeback"))


def settle_page_cache() -> None:
    """Write back a just-saved checkpoint's pages before anything is timed, so no timing shares
    the machine with that write-back (12.6 GB of a 16 GB checkpoint were still dirty after the
    save on the GPU machine; writing them took 5 s)."""
    dirty = dirty_kib()
    t0 = time.perf_counter()
    os.sync()
    record(step="page_cache_written_back", dirty_mib=round(dirty / 1024, 1), seconds=round(time.perf_counter() - t0, 1))


def copy_bandwidth() -> float:
    import torch

    a = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 20
    for _ in range(n):
        b.copy_(a)
    torch.cuda.synchronize()
    gbps = 2 * a.numel() * n / (time.perf_counter() - t) / 1e9
    del a, b
    torch.cuda.empty_cache()
    return gbps


def weight_bytes_per_step(gguf_file: Path | None = None) -> int:
    """Bytes of weights a decode step reads: every matrix once (the embedding table one row at a
    time, so not counted); bf16, or the GGUF file's own blocks."""
    if gguf_file is not None:
        import gguf

        return sum(int(t.n_bytes) for t in gguf.GGUFReader(gguf_file).tensors if t.name != "token_embd.weight")
    c = CONFIG
    h, i, L, d = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["head_dim"]
    per_layer = h * (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d + c["num_attention_heads"] * d * h \
        + 3 * h * i + 2 * h
    return 2 * (L * per_layer + h + c["vocab_size"] * h)  # bf16; the embedding table is read one row at a time


def kernel_times(run, steps: int) -> tuple[dict[str, float], dict[str, int], list[tuple[float, float, str]]]:  # noqa: ANN001
    """GPU microseconds per step and launches per step of each kernel name while `run()`
    does `steps` steps, from torch.profiler: its CUPTI tracing sees every kernel of the
    process, TVM's included; and the timeline (start us, end us, name) of every kernel and copy.
    `run` may carry a `prepare()` attribute (a timer's `steps_only`): called and finished before
    the profile starts, so only the `steps` steps are in it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    prepare = getattr(run, "prepare", None)
    if prepare is not None:
        prepare()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    groups: dict[str, list[float]] = {}
    timeline: list[tuple[float, float, str]] = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        groups.setdefault(event.name, []).append(event.device_time_total if hasattr(event, "device_time_total")
                                                 else event.cuda_time_total)
        timeline.append((float(event.time_range.start), float(event.time_range.end), event.name))
    return ({k: sum(v) / steps for k, v in groups.items()}, {k: len(v) // steps for k, v in groups.items()},
            timeline)


def idle_between(timeline: list[tuple[float, float, str]], steps: int, top: int = 12) -> tuple[float, list]:
    """Where the GPU sits idle: microseconds per step with no kernel running, from a profile's
    timeline (start, end, name), and the `top` pairs of kernels around the idle stretches
    (the one that ended last before it, the one that starts it) with their idle us per step and
    how many stretches a step. Kernels that overlap (concurrent streams) leave no idle."""
    if not timeline:
        return 0.0, []
    spans = sorted(timeline)
    pairs: dict[tuple[str, str], list[float]] = {}
    busy_until, last = spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > busy_until:
            pairs.setdefault((kernel_label(last, 60), kernel_label(name, 60)), []).append(start - busy_until)
        if end >= busy_until:
            busy_until, last = end, name
    total = sum(sum(v) for v in pairs.values()) / steps
    ranked = sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:top]
    return total, [(a, b, round(sum(v) / steps, 1), round(len(v) / steps, 1)) for (a, b), v in ranked]


def kernel_label(name: str, width: int = 120) -> str:
    """A profiled kernel's name, readable: C++ template kernels (toolchain/native/*.cu) lose
    `void`, the anonymous namespace and their parameter list, so their template arguments (the
    format, the epilogue), where instances differ, fit in `width`."""
    name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    depth = 0
    for i, c in enumerate(name):
        depth += (c == "<") - (c == ">")
        if c == "(" and depth == 0 and i > 0 and name[i - 1] != " ":  # a parameter list, not "Memcpy HtoD (...)"
            name = name[:i]
            break
    return name[:width]


def profile_kernels(name: str, run, weight_bytes: int, steps: int = 16) -> None:  # noqa: ANN001
    """Where a step's time goes: per-kernel GPU time of `run` (`steps` decode steps), how
    much of it is kernels at all (the rest is gaps between launches), and the bandwidth
    the GEMV kernels reach on their own."""
    per_step, launches, timeline = kernel_times(run, steps)
    total = sum(per_step.values())
    idle, idle_pairs = idle_between(timeline, steps)
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[:40]
    gemv = sum(v for k, v in per_step.items() if "matmul" in k.lower())
    record(step=f"{name}_profile", kernel_us_per_step=round(total, 1), gemv_us_per_step=round(gemv, 1),
           gemv_gb_s=round(weight_bytes / (gemv * 1e-6) / 1e9, 1) if gemv else None,
           launches_per_step=sum(launches.values()), idle_us_per_step=round(idle, 1),
           top=[(kernel_label(k), round(v, 1), launches[k]) for k, v in top], idle_between=idle_pairs)


def decode_timer(model, gen, prompt: int = 128):  # noqa: ANN001, ANN201 - () -> seconds per step
    """Seconds per batch-1 `decode` step after a `prompt`-token prefill: the model step
    alone, the host synchronised once per loop (the timer's argument: steps)."""
    from vtool.runtime.artifact.tvm_runtime import global_func

    sync = global_func("runtime.Device_StreamSync")
    S = model.ffi.Shape

    def fresh(n: int):  # noqa: ANN202 - a prefilled sequence with room for n steps, and its input
        gen._fresh_sequence(prompt + n + 16)
        gen.prefill_logits(list(range(1000, 1000 + prompt)))
        return gen._embed([1234])

    def steps(embeds, n: int) -> None:  # noqa: ANN001
        for _ in range(n):
            gen._begin(gen._kv, S([gen.SEQ_ID]), S([1]))
            model.function("decode")(embeds, gen._kv, model.params)
            gen._end(gen._kv)

    def timed_decode(n: int) -> float:
        embeds = fresh(n)
        sync(model.device, 0)
        t0 = time.perf_counter()
        steps(embeds, n)
        sync(model.device, 0)
        return (time.perf_counter() - t0) / n

    def steps_only(n: int):  # noqa: ANN202 - for kernel_times: the prefill in prepare(), outside the profile
        state = {}

        def run() -> None:
            steps(state["embeds"], n)

        run.prepare = lambda: state.update(embeds=fresh(n))
        return run

    timed_decode.steps_only = steps_only
    return timed_decode


def own_cache_timer(model, prompt: int = 128):  # noqa: ANN001, ANN201 - (rounds) -> seconds per step
    """Seconds per one-sequence `draft_step` (a library built with --draft-cache-len): the step
    on the library's own cache, captured whole in one CUDA graph with its attention, against
    `decode`'s TVM paged cache, whose kernels run between the captured pieces. Rounds of the
    most steps a round takes (runtime/engine/draft_chain.py propose: one state write, the steps
    queued, one read), after a `prompt`-token draft_extend; the timer's argument is rounds."""
    from vtool.runtime.engine.draft_chain import DraftChain

    chain = DraftChain(model)
    k = chain.max_steps - chain.max_forced + 1
    ids = list(range(1000, 1000 + prompt))

    def start() -> None:
        ids[prompt:] = []
        ids.extend(chain.propose("bench", ids, 1))

    def rounds(n: int) -> None:
        for _ in range(n):
            ids.extend(chain.propose("bench", ids, k))

    def timed(n: int) -> float:
        start()
        rounds(1)  # warm: the graph captured
        t0 = time.perf_counter()
        rounds(n)
        return (time.perf_counter() - t0) / (n * k)

    def steps_only(n: int):  # noqa: ANN202 - for kernel_times: n rounds of k steps
        def run() -> None:
            rounds(n)

        run.prepare = lambda: (start(), rounds(1))
        return run

    timed.steps_only = steps_only
    timed.steps_per_round = k
    return timed


def batch_decode_timer(model, batch: int, tokens: int = 384, entry: str = "batch_decode"):  # noqa: ANN001, ANN201
    """Seconds per `entry` step of `batch` one-token sequences (a fresh paged cache with room
    for `tokens` steps, warm-up steps included, per sequence); `batch_decode_captured` runs
    from CUDA graphs (captured in the warm-up)."""
    from vtool.runtime.engine.kv_cache import PagedKVCache
    from vtool.runtime.artifact.tvm_runtime import global_func

    sync = global_func("runtime.Device_StreamSync")
    S = model.ffi.Shape
    kv = PagedKVCache(model, num_blocks=batch * (tokens // 16 + 1) + 8, block_size=16, max_num_seqs=batch, prefill_chunk=2048)
    for seq in range(batch):
        kv.add(seq)
    ids = model.upload(np.full(batch, 1234, dtype=np.int32))
    flat = model.function("embed")(ids, model.params)
    embeds = global_func("runtime.TVMTensorCreateView")(flat, S([batch, 1, model.hidden_size]), model.dtype, 0)

    def one() -> None:
        kv.begin_forward(list(range(batch)), [1] * batch)
        model.function(entry)(embeds, kv.tvm, model.params)
        kv.end_forward()

    def timed(n: int) -> float:
        warm_up()
        sync(model.device, 0)
        t0 = time.perf_counter()
        marks = []
        for _ in range(n):
            one()
            marks.append(time.perf_counter())
        sync(model.device, 0)
        end = time.perf_counter()
        # where a slow timing's time went (explain_slow_step): the host's time to queue each
        # step (steps run ahead of the device until something blocks), then the final wait
        LAST_TIMING.update(queue_ms=[round((b - a) * 1e3, 1) for a, b in zip([t0, *marks], marks)],
                           final_wait_ms=round((end - marks[-1]) * 1e3, 1))
        return (end - t0) / n

    def warm_up() -> None:  # and, for batch_decode_captured, each graph captured
        for _ in range(4):
            one()

    def steps_only(n: int):  # noqa: ANN202 - for kernel_times: the warm-up in prepare(), outside the profile
        def run() -> None:
            for _ in range(n):
                one()

        run.prepare = warm_up
        return run

    timed.steps_only = steps_only
    return timed


LAST_TIMING: dict = {}  # batch_decode_timer's last timing, step by step
SLOW_STEP_MS = 100.0  # a batch step this slow is the rare stall this bench has met at 64 sequences


def explain_slow_step(step: str, timed) -> None:  # noqa: ANN001 - timed: batch_decode_timer's closure
    """A step that took over SLOW_STEP_MS: is the same cache still slow, and is the time in the
    kernels (GPU time a step) or between them (the GPU idle)? Recorded beside the step."""
    import torch

    free, total = torch.cuda.mem_get_info()
    queue = LAST_TIMING.get("queue_ms", [])
    slowest = sorted(range(len(queue)), key=lambda i: -queue[i])[:5]
    record(step=f"{step}_slow_timing", slowest_queue_ms=[(i, queue[i]) for i in slowest],
           median_queue_ms=sorted(queue)[len(queue) // 2] if queue else None,
           final_wait_ms=LAST_TIMING.get("final_wait_ms"))
    t0 = time.perf_counter()
    again = timed(2) * 1e3
    per_step, launches, _ = kernel_times(lambda: timed(2), 6)  # timed(2): 4 warm-up + 2 timed steps
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[:8]
    record(step=f"{step}_slow", again_ms_per_step=round(again, 3), kernel_us_per_step=round(sum(per_step.values()), 1),
           top=[(kernel_label(k), round(v, 1), launches[k]) for k, v in top], gpu_free_gib=round(free / 2**30, 1),
           gpu_total_gib=round(total / 2**30, 1), dirty_mib=round(dirty_kib() / 1024, 1),
           seconds=round(time.perf_counter() - t0, 1))


def serving_split(model, batch: int = 64, steps: int = 32, tokens: int = 384) -> None:  # noqa: ANN001
    """Where a serving step's time goes beyond the model step (issue 13): the same captured
    batch_decode at `batch`, run the way the engine runs it (token ids uploaded and embedded
    each step, the host waiting for every step) and then with the device sampler's draw, at
    temperature 1 and greedy; the host time spent queueing is recorded apart. Against the
    pipelined figure (batch_decode_timer: steps queued back to back, one wait at the end),
    the difference is what waiting for each step and the draw cost."""
    from vtool.runtime.artifact.tvm_runtime import global_func
    from vtool.runtime.engine.kv_cache import PagedKVCache
    from vtool.runtime.sampling.device import DeviceSampler
    from vtool.runtime.sampling.params import SamplingParams

    sync = global_func("runtime.Device_StreamSync")
    view = global_func("runtime.TVMTensorCreateView")
    S = model.ffi.Shape
    entry = batched_entry(model)
    sampler = DeviceSampler(model)
    for mode in ("forward", "sample_t1", "sample_greedy"):
        kv = PagedKVCache(model, num_blocks=batch * (tokens // 16 + 1) + 8, block_size=16, max_num_seqs=batch,
                          prefill_chunk=2048)
        for seq in range(batch):
            kv.add(seq)
        params = [SamplingParams(temperature=0.0 if mode == "sample_greedy" else 1.0, seed=i) for i in range(batch)]
        rngs = [np.random.default_rng(i) for i in range(batch)]
        ids = np.full(batch, 1234, dtype=np.int32)
        launch_s = 0.0

        def one() -> None:
            nonlocal launch_s
            t = time.perf_counter()
            prepared = sampler.prepare(params, rngs) if mode != "forward" else None
            flat = model.function("embed")(model.upload(ids, slot="ids"), model.params)
            embeds = view(flat, S([batch, 1, model.hidden_size]), model.dtype, 0)
            kv.begin_forward(list(range(batch)), [1] * batch)
            logits, _ = model.function(entry)(embeds, kv.tvm, model.params)
            kv.end_forward()
            out = sampler.launch(logits, prepared) if prepared is not None else None
            launch_s += time.perf_counter() - t
            if out is not None:
                sampler.collect(out)
            else:
                sync(model.device, 0)

        for _ in range(4):
            one()
        launch_s = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            one()
        ms = (time.perf_counter() - t0) / steps * 1e3
        record(step=f"vtool_serving_split_{mode}_b{batch}", entry=entry, ms_per_step=round(ms, 3),
               host_queueing_ms=round(launch_s / steps * 1e3, 3))
        del kv


def time_prefills(model, gen, sync, rounds: int = 1) -> None:  # noqa: ANN001
    """vtool prefill of 128 and 2048 tokens (the generator's chunks), warmed once, the median
    of `rounds` timings."""
    for n_prompt in (128, 2048):
        gen._fresh_sequence(n_prompt + 16)
        ids = list(range(1000, 1000 + n_prompt))
        logits = np.asarray(gen.prefill_logits(ids), dtype=np.float32)  # warm
        times = []
        for _ in range(rounds):
            gen._fresh_sequence(n_prompt + 16)
            sync(model.device, 0)
            t0 = time.perf_counter()
            gen.prefill_logits(ids)
            sync(model.device, 0)
            times.append(time.perf_counter() - t0)
        # the last position's logits, to hold builds that must compute alike to the same bits
        digest = hashlib.sha256(logits.tobytes()).hexdigest()[:16]
        record(step=f"vtool_prefill_{n_prompt}", ms=round(float(np.median(times)) * 1e3, 2), rounds=rounds,
               logits_digest=digest, top1=int(logits.reshape(-1).argmax()))


def batched_entry(model) -> str:  # noqa: ANN001
    """The batched decode entry a library runs fastest: its CUDA-graph one where it has it."""
    return "batch_decode_captured" if "batch_decode_captured" in model.manifest.get("entry_points", []) else "batch_decode"


def profile_batch_step(model, batch: int, weight_bytes: int) -> None:  # noqa: ANN001
    """The captured batched step of `batch` sequences (batch_decode where none is captured):
    timed, then profiled as profile_kernels does the one-sequence step."""
    entry = batched_entry(model)
    timed = batch_decode_timer(model, batch, entry=entry)
    ms = timed(32) * 1e3
    record(step=f"vtool_{entry}_b{batch}", ms_per_step=round(ms, 3), tok_s=round(batch * 1e3 / ms, 1))
    profile_kernels(f"vtool_{entry}_b{batch}", timed.steps_only(16), weight_bytes)


def bench_vtool(artifact: Path, checkpoint_dir: Path, steps: int, profile: bool = False,
                split: bool = False, prefill_only: bool = False, decode_only: bool = False,
                profile_batches: tuple[int, ...] = ()) -> None:
    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.runtime.engine.generate import Generator
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.artifact.tvm_runtime import global_func

    t = time.perf_counter()
    model = CompiledModel(artifact, open_checkpoint(checkpoint_dir))
    record(step="vtool_load", seconds=round(time.perf_counter() - t, 1))
    sync = global_func("runtime.Device_StreamSync")
    gen = Generator(model, max_model_len=4096)
    if prefill_only:
        time_prefills(model, gen, sync, rounds=5)
        del model
        return
    timed_decode = decode_timer(model, gen)
    timed_decode(8)
    step = timed_decode(steps)
    record(step="vtool_decode_b1_model_only", ms_per_token=round(step * 1e3, 3), tok_s=round(1 / step, 1))
    if profile or profile_batches:
        gguf_file = Path(checkpoint_dir) if Path(checkpoint_dir).suffix == ".gguf" else None
        weight_bytes = weight_bytes_per_step(gguf_file)
    if profile:
        profile_kernels("vtool_decode_b1", timed_decode.steps_only(16), weight_bytes)
    if "draft_chain" in model.manifest:  # the same step on the library's own cache, one graph
        timed_own = own_cache_timer(model)
        timed_own(1)
        step = timed_own(8)
        record(step="vtool_draft_step_b1_own_cache", ms_per_token=round(step * 1e3, 3), tok_s=round(1 / step, 1))
        if profile:
            profile_kernels("vtool_draft_step_b1", timed_own.steps_only(2), weight_bytes,
                            steps=2 * timed_own.steps_per_round)
    for batch in profile_batches:
        profile_batch_step(model, batch, weight_bytes)
    if decode_only:
        return
    result = gen.generate(list(range(1000, 1128)), SamplingParams(temperature=0, max_tokens=steps))
    record(step="vtool_generate_b1_host_sampling", tok_s=round(result.decode_tokens_per_second, 1),
           ms_per_token=round(1e3 / max(result.decode_tokens_per_second, 1e-9), 3))

    time_prefills(model, gen, sync)

    for batch in (1, 8, 32, 64):
        timed = batch_decode_timer(model, batch)
        ms = timed(32) * 1e3
        record(step=f"vtool_batch_decode_b{batch}", ms_per_step=round(ms, 3), tok_s=round(batch * 1e3 / ms, 1))
        if ms > SLOW_STEP_MS:
            explain_slow_step(f"vtool_batch_decode_b{batch}", timed)
    if split:
        for batch in (1, 64):
            serving_split(model, batch)
    if "batch_decode_captured" in model.manifest.get("entry_points", []):
        for batch in (8, 16, 32, 64):
            timed = batch_decode_timer(model, batch, entry="batch_decode_captured")
            ms = timed(32) * 1e3
            record(step=f"vtool_batch_decode_captured_b{batch}", ms_per_step=round(ms, 3),
                   tok_s=round(batch * 1e3 / ms, 1))
            if ms > SLOW_STEP_MS:
                explain_slow_step(f"vtool_batch_decode_captured_b{batch}", timed)
    del model


def bench_transformers(checkpoint_dir: Path, steps: int, prefill_only: bool = False) -> None:
    import torch
    from transformers import AutoModelForCausalLM, StaticCache

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.bfloat16, device_map="cuda").eval()
    rounds = 5 if prefill_only else 1
    for n_prompt in (128, 2048):
        ids = torch.arange(1000, 1000 + n_prompt, device="cuda")[None]
        times = []
        with torch.no_grad():
            model(ids)
            for _ in range(rounds):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(ids)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        record(step=f"hf_eager_prefill_{n_prompt}", ms=round(float(np.median(times)) * 1e3, 2), rounds=rounds)
    if prefill_only:
        return
    cache = StaticCache(config=model.config, max_batch_size=1, max_cache_len=128 + steps + 32, device="cuda",
                        dtype=torch.bfloat16)
    step_fn = torch.compile(lambda tok, pos: model(tok, position_ids=pos, cache_position=pos[0],
                                                   past_key_values=cache, use_cache=True).logits,
                            mode="reduce-overhead", fullgraph=False)
    ids = torch.arange(1000, 1128, device="cuda")[None]
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(128, device="cuda"))
        tok = out.logits[:, -1:].argmax(-1)
        t_compile = time.perf_counter()
        for i in range(3):  # compile + warm
            pos = torch.tensor([[128 + i]], device="cuda")
            tok = step_fn(tok, pos)[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        record(step="hf_compile_warmup", seconds=round(time.perf_counter() - t_compile, 1))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(3, steps):
            pos = torch.tensor([[128 + i]], device="cuda")
            tok = step_fn(tok, pos)[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / (steps - 3) * 1e3
    record(step="hf_static_compile_decode_b1", ms_per_token=round(ms, 3), tok_s=round(1e3 / ms, 1))


def logits_check(artifact: Path, checkpoint_dir: Path, n: int = 128) -> None:
    """The 8B-shape bf16 question: how far are vtool's and transformers' bf16 logits from the
    float32 truth (transformers in float32, TF32 off) on the same random weights?"""
    import torch
    from transformers import AutoModelForCausalLM

    from vtool.runtime.artifact.library import CompiledModel
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.runtime.engine.generate import Generator

    ids = list(range(1000, 1000 + n))
    model = CompiledModel(artifact, open_checkpoint(checkpoint_dir))
    ours = Generator(model, max_model_len=1024).prompt_logits(ids).astype(np.float32)
    del model
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        hf = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype, device_map="cuda").eval()
        with torch.no_grad():
            out[dtype] = hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
        del hf
        torch.cuda.empty_cache()
    truth, hf16 = out[torch.float32], out[torch.bfloat16]

    def compare(name: str, x: np.ndarray) -> None:
        d = np.abs(x - truth)
        record(step=f"logits_{name}_vs_float32", max_abs=round(float(d.max()), 4), mean_abs=round(float(d.mean()), 4),
               top1_agreement=round(float((x.argmax(-1) == truth.argmax(-1)).mean()), 4),
               logit_std=round(float(truth.std()), 4))

    compare("vtool_bf16", ours)
    compare("hf_bf16", hf16)
    record(step="logits_vtool_bf16_vs_hf_bf16", top1_agreement=round(float((ours.argmax(-1) == hf16.argmax(-1)).mean()), 4),
           mean_abs=round(float(np.abs(ours - hf16).mean()), 4))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", required=True, type=Path, action="append",
                    help="repeat to measure several builds of the same checkpoint in one run (bf16, fp8, ...)")
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/llama8b-random"))
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile", action="store_true", help="per-kernel times of 16 decode steps (torch.profiler)")
    ap.add_argument("--serving-split", action="store_true",
                    help="also time batch_decode steps waited for one by one, with and without the device draw")
    ap.add_argument("--prefill-only", action="store_true",
                    help="only the prefill timings (vtool and transformers eager), median of 5")
    ap.add_argument("--decode-only", action="store_true",
                    help="only the model-only batch-1 decode step (what served TPOT at one user is held to), "
                         "and its profile with --profile")
    ap.add_argument("--profile-batch", type=int, action="append", default=[],
                    help="also time and profile the captured batched step of this many sequences (repeatable)")
    ap.add_argument("--logits-check", action="store_true", help="only compare bf16 logits with the float32 truth")
    args = ap.parse_args()
    gguf_file = args.checkpoint if args.checkpoint.suffix == ".gguf" else None  # tests/bench/shape_gguf.py's
    if gguf_file is None:
        make_checkpoint(args.checkpoint)
    settle_page_cache()
    if args.logits_check:
        logits_check(args.artifact[0], args.checkpoint)
        return
    bw = copy_bandwidth()
    record(step="copy_bandwidth", gb_s=round(bw, 1))
    for artifact in args.artifact:
        manifest = json.loads((artifact / "manifest.json").read_text())
        LABEL["artifact"] = f"{artifact.name} ({manifest['dtype']}, quantization {manifest['quantization']})"
        weight_bytes = weight_bytes_per_step(gguf_file) if gguf_file else manifest_weight_bytes(artifact)
        record(step="roofline", weight_gb=round(weight_bytes / 1e9, 2), roofline_ms=round(weight_bytes / bw / 1e6, 3))
        bench_vtool(artifact, args.checkpoint, args.steps, args.profile, args.serving_split, args.prefill_only,
                    args.decode_only, tuple(args.profile_batch))
        if args.prefill_only:
            continue
        by = {r["step"]: r for r in RESULTS if r.get("artifact") == LABEL["artifact"]}
        record(step="vtool_decode_b1_model_only_vs_roofline",
               percent_of_copy_bw=round(100 * by["roofline"]["roofline_ms"] / by["vtool_decode_b1_model_only"]
                                        ["ms_per_token"], 1))
    LABEL.clear()
    if not args.skip_hf and gguf_file is None:  # the peers run the bf16 safetensors checkpoint
        bench_transformers(args.checkpoint, args.steps, args.prefill_only)
        if not args.prefill_only:
            ms = next(r["ms_per_token"] for r in RESULTS if r["step"] == "hf_static_compile_decode_b1")
            record(step="hf_static_compile_decode_b1_vs_roofline",
                   percent_of_copy_bw=round(100 * weight_bytes_per_step() / bw / 1e6 / ms, 1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu8b.json").write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
