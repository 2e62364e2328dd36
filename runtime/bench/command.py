"""`vtool bench`: a serving benchmark of an OpenAI-compatible server, measured and reported as
`vllm bench serve` does (metric definitions: shared/notes/serving-metrics.md).

The CLI builds a BenchOptions (vLLM's flag names) and calls bench_main(); a caller that already
has prompts calls run_bench() directly.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime as _dt
import json
import math
import os
import random
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from vtool import VtoolError
from vtool.runtime.bench.client import (ENDPOINT_PATHS, RequestInput, api_base, auth_headers, endpoint_url,
                                        fetch_models, httpx, make_client, run_requests)
from vtool.runtime.bench.metrics import (DEFAULT_PERCENTILES, METRIC_NAMES, BenchMetrics, RequestRecord,
                                         calculate_metrics, format_percentile)

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_NUM_PROMPTS = 1000      # vLLM --num-prompts
DEFAULT_INPUT_LEN = 1024        # vLLM --random-input-len
DEFAULT_OUTPUT_LEN = 128        # vLLM --random-output-len
UNLIMITED = 0                   # a concurrency level of 0 means no limit (vLLM without --max-concurrency)

SECTION_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


@dataclasses.dataclass
class BenchPrompt:
    prompt: str
    prompt_len: int                 # the client's own count; the server's usage.prompt_tokens replaces it
    output_len: int | None = None   # None: run_bench's output_len


@dataclasses.dataclass
class BenchOptions:
    """`vtool bench` flags, named as vLLM's `vllm bench serve` names them."""

    model: str | None = None                    # --model; None: the first id of GET /v1/models
    url: str = DEFAULT_URL                      # --url (server root, .../v1 or a full endpoint URL)
    endpoint: str = "completions"               # --endpoint completions|chat
    dataset_path: str | None = None             # --dataset-path (ShareGPT .json, .jsonl, .txt)
    num_prompts: int = DEFAULT_NUM_PROMPTS      # --num-prompts
    input_len: int = DEFAULT_INPUT_LEN          # --input-len (synthetic prompts)
    output_len: int | None = None               # --output-len; None: 128, or ShareGPT's own lengths
    concurrency: Sequence[int] | str = (UNLIMITED,)  # --concurrency 1,4,16 (parse_concurrency); 0 = no limit
    request_rate: float = math.inf              # --request-rate
    burstiness: float = 1.0                     # --burstiness
    ignore_eos: bool = False                    # --ignore-eos
    api_key: str | None = None                  # --api-key (else $OPENAI_API_KEY, as vLLM)
    seed: int = 0                               # --seed
    result_json: str | None = None              # --result-json PATH
    save_result: bool = False                   # --save-result (default file name in the cwd)
    save_detailed: bool = False                 # --save-detailed (per-request lists in the JSON)
    percentiles: Sequence[float] = DEFAULT_PERCENTILES   # --metric-percentiles
    goodput: dict[str, float] | None = None     # --goodput ttft:ms tpot:ms e2el:ms (parse_goodput)
    warmup: bool = True                         # one untimed test request first, as vLLM

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get("OPENAI_API_KEY") or None

    def json_path(self, model: str) -> Path | None:
        if self.result_json:
            return Path(self.result_json)
        if self.save_result:
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model.split("/")[-1]) or "model"
            return Path(f"vtool-bench-{self.endpoint}-{safe}-{stamp}.json")
        return None


# --------------------------------------------------------------------------- option parsing

def parse_concurrency(value: str | int | Iterable[int | str] | None) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; 'inf' / 'none' / 'unlimited' / 0 -> 0 (no limit)."""
    if value is None:
        return [UNLIMITED]
    items: list[Any]
    if isinstance(value, int):
        items = [value]
    elif isinstance(value, str):
        items = [v for v in value.replace(" ", "").split(",") if v]
    else:
        items = []
        for v in value:
            items.extend([v] if isinstance(v, int) else [x for x in str(v).replace(" ", "").split(",") if x])
    levels: list[int] = []
    for v in items:
        if isinstance(v, str) and v.lower() in ("inf", "none", "unlimited", "max"):
            levels.append(UNLIMITED)
            continue
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise VtoolError(f"--concurrency: {v!r} is not a whole number; "
                             f"give e.g. 1,4,16 (or inf for no limit)") from None
        if n < 0:
            raise VtoolError(f"--concurrency: {n} is negative; give positive levels, e.g. 1,4,16 (or inf for no limit)")
        levels.append(n)
    if not levels:
        raise VtoolError("--concurrency: no level given; give e.g. 1,4,16")
    return levels


def parse_goodput(items: Iterable[str] | None) -> dict[str, float] | None:
    """['ttft:200', 'tpot:50'] -> {'ttft': 200.0, 'tpot': 50.0} (vLLM's --goodput KEY:VALUE, ms)."""
    out: dict[str, float] = {}
    for item in items or ():
        for part in str(item).split():
            key, sep, val = part.partition(":")
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise VtoolError(f"--goodput: {part!r}; give KEY:MS with KEY one of ttft, tpot, e2el")
            try:
                out[key] = float(val)
            except ValueError:
                raise VtoolError(f"--goodput: {part!r}: {val!r} is not a number of milliseconds") from None
            if out[key] < 0:
                raise VtoolError(f"--goodput: {part!r}: an SLO cannot be negative")
    return out or None


# --------------------------------------------------------------------------- tokenizer adapters

def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    try:
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except TypeError:
        ids = tokenizer.encode(text)
    if hasattr(ids, "ids"):         # a `tokenizers.Encoding`
        ids = ids.ids
    return [int(i) for i in ids]


def _vocab_size(tokenizer: Any) -> int:
    for name in ("vocab_size", "get_vocab_size"):
        v = getattr(tokenizer, name, None)
        if callable(v):
            v = v()
        if isinstance(v, (int, np.integer)) and v > 0:
            return int(v)
    try:
        return len(tokenizer)
    except TypeError:
        raise VtoolError("synthetic prompts need the tokenizer's vocabulary size (vocab_size)") from None


def _special_ids(tokenizer: Any) -> set[int]:
    """Ids synthetic prompts must not use: transformers' all_special_ids, vtool's bos_id/eos_id and
    special_tokens, and the `tokenizers` backend's added tokens marked special."""
    ids: set[int] = set()
    for name in ("all_special_ids", "special_ids", "special_token_ids"):
        v = getattr(tokenizer, name, None)
        if callable(v):
            v = v()
        if v:
            ids.update(int(i) for i in v)
    for name in ("bos_id", "eos_id", "bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, (int, np.integer)):
            ids.add(int(v))
    to_id = getattr(tokenizer, "token_to_id", None)
    specials = getattr(tokenizer, "special_tokens", None)
    if callable(to_id) and isinstance(specials, dict):
        for tok in specials.values():
            i = to_id(tok) if isinstance(tok, str) else None
            if i is not None:
                ids.add(int(i))
    backend = getattr(tokenizer, "backend", None)
    added = getattr(backend, "get_added_tokens_decoder", None)
    if callable(added):
        try:
            ids.update(int(i) for i, t in added().items() if getattr(t, "special", False))
        except Exception:  # noqa: BLE001 - a best effort over an optional API
            pass
    return ids


# --------------------------------------------------------------------------- datasets

def decode_to_target_len(tokenizer: Any, token_ids: list[int], target_len: int, rng: np.random.Generator,
                         allowed: np.ndarray, max_retry: int = 10) -> tuple[str, int]:
    """vLLM's gen_prompt_decode_to_target_len: decode, re-encode (no special tokens), then cut or
    pad with random allowed ids and try again, until the text re-encodes to `target_len` tokens
    or the retries run out. Returns (prompt, its token count)."""
    seq = list(token_ids)
    tries = max_retry
    while True:
        prompt = tokenizer.decode(seq)
        seq = _encode(tokenizer, prompt, add_special_tokens=False)
        if tries <= 0 or len(seq) == target_len:
            return prompt, len(seq)
        if len(seq) < target_len:
            seq.extend(int(allowed[i]) for i in rng.integers(0, len(allowed), size=target_len - len(seq)))
        else:
            seq = seq[:target_len]
        tries -= 1


def synthetic_prompts(tokenizer: Any, num_prompts: int, input_len: int, seed: int = 0) -> list[BenchPrompt]:
    """vLLM's random dataset (range ratio 0): each prompt is a run of consecutive non-special token
    ids from a random offset, decoded and re-encoded until it is exactly `input_len` tokens."""
    if input_len < 1:
        raise VtoolError(f"--input-len must be at least 1, got {input_len}")
    rng = np.random.default_rng(seed)
    specials = _special_ids(tokenizer)
    allowed = np.array([i for i in range(_vocab_size(tokenizer)) if i not in specials], dtype=np.int64)
    if len(allowed) == 0:
        raise VtoolError("the tokenizer has no non-special tokens to build synthetic prompts from")
    offsets = rng.integers(0, len(allowed), size=num_prompts)
    prompts = []
    for i in range(num_prompts):
        ids = allowed[(int(offsets[i]) + i + np.arange(input_len)) % len(allowed)].tolist()
        text, n = decode_to_target_len(tokenizer, ids, input_len, rng, allowed)
        prompts.append(BenchPrompt(text, n))
    return prompts


_WORDS = ("time year people way day man thing woman life child world school state family student group "
          "country problem hand part place case week company system program question work government "
          "number night point home water room mother area money story fact month lot right study book eye "
          "job word business issue side kind head house service friend father power hour game line end "
          "member law car city community name president team minute idea kid body information back parent "
          "face others level office door health person art war history party result change morning reason "
          "research girl guy moment air teacher force education").split()


def word_prompts(num_prompts: int, input_len: int, seed: int = 0,
                 count_tokens: Callable[[str], int] | None = None, max_retry: int = 10) -> list[BenchPrompt]:
    """Synthetic prompts without a local tokenizer: random common words. With `count_tokens` (the
    server's /tokenize) the word count is adjusted until the prompt is `input_len` tokens;
    without it a word is taken as one token."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        words = [rng.choice(_WORDS) for _ in range(input_len)]
        n = input_len
        if count_tokens is not None:
            for _ in range(max_retry):
                n = count_tokens(" ".join(words))
                if n == input_len:
                    break
                if n > input_len:
                    words = words[:max(1, len(words) - (n - input_len))]
                else:
                    words += [rng.choice(_WORDS) for _ in range(input_len - n)]
            else:
                n = count_tokens(" ".join(words))
        prompts.append(BenchPrompt(" ".join(words), n))
    return prompts


def _sharegpt_pair(entry: Any) -> tuple[str, str | None] | None:
    conv = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(conv, list) or len(conv) < 2:
        return None
    first, second = conv[0], conv[1]
    if not isinstance(first, dict) or not isinstance(second, dict):
        return None
    return str(first.get("value", "")), str(second.get("value", ""))


def _plain_prompt(item: Any) -> str | None:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        for key in ("prompt", "text", "input", "question"):
            if isinstance(item.get(key), str):
                return item[key]
    return None


def load_dataset_prompts(path: str | Path, num_prompts: int, seed: int = 0, output_len: int | None = None,
                         tokenizer: Any = None) -> list[BenchPrompt]:
    """Prompts from a file:
    * ShareGPT JSON (a list of {"conversations": [{"from": "human", "value": ...}, {...}, ...]}):
      as vLLM, entries with fewer than 2 turns are dropped, the rest shuffled with `seed`; the first
      turn is the prompt and the second's token count the output length (unless `output_len`);
      with a tokenizer, vLLM's filter applies (prompt >= 4 tokens, output >= 4 unless fixed,
      prompt <= 1024, prompt + output <= 2048);
    * a JSON list or .jsonl whose items are strings or objects with "prompt"/"text" (ShareGPT
      lines are accepted too); a .txt file with one prompt per non-empty line; kept in order.
    Fewer prompts than `num_prompts`: repeated by random choice (vLLM's oversampling)."""
    p = Path(path)
    if not p.is_file():
        raise VtoolError(f"--dataset-path {p}: no such file")
    text = p.read_text(encoding="utf-8")
    items: list[Any]
    if p.suffix.lower() == ".txt":
        items = [line.strip() for line in text.splitlines() if line.strip()]
    else:
        try:
            loaded = json.loads(text)
            items = loaded if isinstance(loaded, list) else [loaded]
        except json.JSONDecodeError:
            items = []
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise VtoolError(f"--dataset-path {p}: line {lineno} is not JSON ({e.msg}); give a ShareGPT "
                                     f".json, a .jsonl of prompts, or a .txt with one prompt per line") from None

    sharegpt = [pair for pair in map(_sharegpt_pair, items) if pair is not None]
    prompts: list[BenchPrompt] = []
    if sharegpt:
        random.Random(seed).shuffle(sharegpt)
        for prompt, completion in sharegpt:
            if len(prompts) >= num_prompts:
                break
            if tokenizer is None:
                if prompt.strip():
                    prompts.append(BenchPrompt(prompt, 0, output_len))
                continue
            prompt_len = len(_encode(tokenizer, prompt, add_special_tokens=True))
            out_len = output_len if output_len is not None else len(_encode(tokenizer, completion or "", True))
            if prompt_len < 4 or (output_len is None and out_len < 4) or prompt_len > 1024 \
                    or prompt_len + out_len > 2048:
                continue
            prompts.append(BenchPrompt(prompt, prompt_len, out_len))
    else:
        for item in items:
            if len(prompts) >= num_prompts:
                break
            s = _plain_prompt(item)
            if s is None or not s.strip():
                continue
            n = len(_encode(tokenizer, s, add_special_tokens=True)) if tokenizer is not None else 0
            prompts.append(BenchPrompt(s, n, output_len))
    if not prompts:
        raise VtoolError(f"--dataset-path {p}: no usable prompts; give a ShareGPT .json (conversations of 2+ "
                         f"turns), a .jsonl of {{\"prompt\": ...}} lines, or a .txt with one prompt per line")
    if len(prompts) < num_prompts:
        rnd = random.Random(seed)
        prompts += [dataclasses.replace(x) for x in rnd.choices(prompts, k=num_prompts - len(prompts))]
    return prompts


# --------------------------------------------------------------------------- server helpers

def discover_model(url: str, api_key: str | None = None) -> str:
    """The first model GET /v1/models lists."""
    try:
        ids = asyncio.run(fetch_models(url, api_key))
    except httpx.HTTPError as e:
        raise VtoolError(f"could not list models at {api_base(url)}/v1/models ({e}); is the server running? "
                         f"Pass --model to skip discovery") from None
    if not ids:
        raise VtoolError(f"{api_base(url)}/v1/models lists no model; pass --model")
    return ids[0]


def server_token_counter(client: httpx.Client, url: str, model: str, api_key: str | None = None,
                         add_special_tokens: bool = False) -> Callable[[str], int] | None:
    """A counter backed by the server's POST /tokenize (vLLM's: {model, prompt, add_special_tokens}
    -> {count, tokens}), or None when the server does not offer it."""
    base = api_base(url)

    def count(text: str) -> int:
        r = client.post(base + "/tokenize", headers=auth_headers(api_key),
                        json={"model": model, "prompt": text, "add_special_tokens": add_special_tokens})
        r.raise_for_status()
        body = r.json()
        return int(body["count"]) if "count" in body else len(body["tokens"])

    try:
        count("hello")
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None
    return count


def prepare_prompts(opts: BenchOptions, model: str, tokenizer: Any = None,
                    console: Console | None = None) -> list[BenchPrompt]:
    """The prompts opts describe: the dataset file, or synthetic prompts of --input-len tokens
    (exact with a tokenizer, checked against the server's /tokenize when it has one)."""
    console = console or Console(stderr=True)
    if opts.num_prompts < 1:
        raise VtoolError(f"--num-prompts must be at least 1, got {opts.num_prompts}")
    if opts.dataset_path:
        return load_dataset_prompts(opts.dataset_path, opts.num_prompts, opts.seed, opts.output_len, tokenizer)
    with httpx.Client(timeout=60) as client:
        return _synthetic(opts, model, tokenizer, console,
                          server_token_counter(client, opts.url, model, opts.resolved_api_key()))


def _synthetic(opts: BenchOptions, model: str, tokenizer: Any, console: Console,
               server_count: Callable[[str], int] | None) -> list[BenchPrompt]:
    if tokenizer is None:
        if server_count is None:
            console.print(f"[yellow]warning: no tokenizer and no /tokenize on the server: synthetic prompts are "
                          f"{opts.input_len} random words, about {opts.input_len} tokens[/]", highlight=False)
        return word_prompts(opts.num_prompts, opts.input_len, opts.seed, server_count)
    prompts = synthetic_prompts(tokenizer, opts.num_prompts, opts.input_len, opts.seed)
    if server_count is not None:
        off = 0
        for bp in prompts:
            n = server_count(bp.prompt)
            if n != bp.prompt_len:
                off += 1
                bp.prompt_len = n
        if off:
            console.print(f"[yellow]warning: {off} of {len(prompts)} synthetic prompts tokenize to a different "
                          f"length on the server than with the local tokenizer[/]", highlight=False)
    return prompts


# --------------------------------------------------------------------------- reporting

def result_table(m: BenchMetrics, max_concurrency: int | None, request_rate: float = math.inf) -> Table:
    """vLLM's 'Serving Benchmark Result' block as a rich table."""
    conc = "no limit" if not max_concurrency else str(max_concurrency)
    t = Table(title=f"Serving Benchmark Result (concurrency {conc})", show_header=False, title_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("Successful requests", str(m.completed))
    t.add_row("Failed requests", str(m.failed))
    if max_concurrency:
        t.add_row("Maximum request concurrency", str(max_concurrency))
    if not math.isinf(request_rate):
        t.add_row("Request rate configured (RPS)", f"{request_rate:.2f}")
    t.add_row("Benchmark duration (s)", f"{m.duration_s:.2f}")
    t.add_row("Total input tokens", str(m.total_input))
    t.add_row("Total generated tokens", str(m.total_output))
    t.add_row("Request throughput (req/s)", f"{m.request_throughput:.2f}")
    if m.request_goodput is not None:
        t.add_row("Request goodput (req/s)", f"{m.request_goodput:.2f}")
    t.add_row("Output token throughput (tok/s)", f"{m.output_throughput:.2f}")
    t.add_row("Peak output token throughput (tok/s)", f"{m.max_output_tokens_per_s:.2f}")
    t.add_row("Peak concurrent requests", f"{m.max_concurrent_requests:.2f}")
    t.add_row("Total token throughput (tok/s)", f"{m.total_token_throughput:.2f}")
    for name in METRIC_NAMES:
        title, short = SECTION_TITLES[name]
        st = getattr(m, name)
        t.add_section()
        t.add_row(Text(title, style="bold cyan"), "")
        t.add_row(f"Mean {short} (ms)", f"{st.mean_ms:.2f}")
        t.add_row(f"Median {short} (ms)", f"{st.median_ms:.2f}")
        t.add_row(f"Std {short} (ms)", f"{st.std_ms:.2f}")
        for p, v in st.percentiles_ms:
            t.add_row(f"P{format_percentile(p)} {short} (ms)", f"{v:.2f}")
    return t


def summary_table(runs: Sequence[dict[str, Any]], percentiles: Sequence[float]) -> Table:
    """One row per concurrency level."""
    top = format_percentile(max(percentiles)) if percentiles else None
    t = Table(title="Summary", title_style="bold")
    cols = ["conc.", "ok/fail", "req/s", "out tok/s", "total tok/s", "mean TTFT ms", "mean TPOT ms",
            "mean ITL ms", "mean E2EL ms"]
    if top:
        cols += [f"P{top} TTFT ms", f"P{top} ITL ms"]
    for c in cols:
        t.add_column(c, justify="right")
    for r in runs:
        row = [str(r["max_concurrency"] or "no limit"), f"{r['completed']}/{r['failed']}",
               f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.2f}", f"{r['total_token_throughput']:.2f}",
               f"{r['mean_ttft_ms']:.2f}", f"{r['mean_tpot_ms']:.2f}", f"{r['mean_itl_ms']:.2f}",
               f"{r['mean_e2el_ms']:.2f}"]
        if top:
            row += [f"{r[f'p{top}_ttft_ms']:.2f}", f"{r[f'p{top}_itl_ms']:.2f}"]
        t.add_row(*row)
    return t


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else None)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


# --------------------------------------------------------------------------- the benchmark

async def _run_all(url: str, model: str, prompts: Sequence[BenchPrompt], output_len: int, levels: Sequence[int],
                   endpoint: str, api_key: str | None, console: Console, request_rate: float, burstiness: float,
                   ignore_eos: bool, seed: int, warmup: bool,
                   extra_body: dict[str, Any] | None) -> list[tuple[int, list[RequestRecord], float]]:
    api_url = endpoint_url(url, endpoint)  # type: ignore[arg-type]
    inputs = [RequestInput(prompt=bp.prompt, prompt_len=bp.prompt_len,
                           output_len=bp.output_len if bp.output_len is not None else output_len,
                           model=model, api_url=api_url, ignore_eos=ignore_eos, api_key=api_key,
                           extra_body=extra_body) for bp in prompts]
    if warmup:
        console.print("Starting initial single prompt test run...", highlight=False)
        recs, _ = await run_requests(inputs[:1], endpoint, max_concurrency=1)  # type: ignore[arg-type]
        if not recs[0].success:
            raise VtoolError(f"initial test request to {api_url} failed: {recs[0].error}; check --url, --model, "
                             f"--endpoint and --api-key")
        console.print("Initial test run completed.", highlight=False)
    results = []
    for level in levels:
        # Every level sends the same prompts: without a reset, later levels would be
        # served from the prefix cache the earlier ones filled. Best effort: a server
        # without the endpoint (not vLLM-compatible) is measured as it is.
        await _reset_prefix_cache(url, api_key)
        with Progress(TextColumn("[bold]concurrency {task.fields[level]}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("[red]{task.fields[failed]} failed"), TimeElapsedColumn(),
                      console=console, transient=False) as bar:
            task = bar.add_task("bench", total=len(inputs), level=level or "no limit", failed=0)
            failed = 0

            def done(rec: RequestRecord) -> None:
                nonlocal failed
                failed += 0 if rec.success else 1
                bar.update(task, advance=1, failed=failed)

            client = make_client(level or None)
            try:
                records, duration = await run_requests(
                    inputs, endpoint, max_concurrency=level or None,  # type: ignore[arg-type]
                    request_rate=request_rate, burstiness=burstiness, seed=seed, on_done=done, client=client)
            finally:
                await client.aclose()
        results.append((level, records, duration))
    return results


async def _reset_prefix_cache(url: str, api_key: str | None) -> bool:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(f"{api_base(url)}/reset_prefix_cache", headers=headers)
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def run_bench(url: str, model: str | None, prompts: Sequence[BenchPrompt], output_len: int,
              concurrency_levels: Sequence[int] | str, endpoint: str = "completions", api_key: str | None = None,
              console: Console | None = None, json_path: str | Path | None = None, *,
              request_rate: float = math.inf, burstiness: float = 1.0, ignore_eos: bool = False, seed: int = 0,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES, goodput: dict[str, float] | None = None,
              warmup: bool = True, save_detailed: bool = False, count_tokens: Callable[[str], int] | None = None,
              extra_body: dict[str, Any] | None = None, dataset: str | None = None) -> dict[str, Any]:
    """Run every prompt once per concurrency level (0 = no limit), print vLLM's result block per
    level (and a summary when there are several), and return the report; write it as JSON to
    `json_path` when given. `count_tokens` re-tokenizes generated text when the server sends no
    usage (vLLM's fallback; else 1 token per response)."""
    console = console or Console()
    if endpoint not in ENDPOINT_PATHS:
        raise VtoolError(f"--endpoint {endpoint!r}: give one of {', '.join(sorted(ENDPOINT_PATHS))}")
    if not prompts:
        raise VtoolError("no prompts to benchmark")
    if output_len < 1:
        raise VtoolError(f"--output-len must be at least 1, got {output_len}")
    levels = parse_concurrency(concurrency_levels if isinstance(concurrency_levels, str) else list(concurrency_levels))
    if model is None:
        model = discover_model(url, api_key)
        console.print(f"model: {model} (from {api_base(url)}/v1/models)", highlight=False)

    results = asyncio.run(_run_all(url, model, prompts, output_len, levels, endpoint, api_key, console,
                                   request_rate, burstiness, ignore_eos, seed, warmup, extra_body))

    report: dict[str, Any] = {
        "date": _dt.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "vtool",
        "endpoint_type": "openai-chat" if endpoint == "chat" else "openai",
        "endpoint": ENDPOINT_PATHS[endpoint],
        "base_url": api_base(url),
        "model_id": model,
        "dataset": dataset,
        "num_prompts": len(prompts),
        "output_len": output_len,
        "request_rate": request_rate,
        "burstiness": burstiness,
        "ignore_eos": ignore_eos,
        "seed": seed,
        "percentiles": [float(p) for p in percentiles],
        "goodput_slo_ms": goodput,
        "runs": [],
    }
    for level, records, duration in results:
        m = calculate_metrics(records, duration, percentiles, count_tokens, goodput)
        errors = [r.error for r in records if not r.success]
        if errors:
            console.print(f"[red]{len(errors)} failed request(s) (showing up to 10):[/]", highlight=False)
            for i, e in enumerate(errors[:10]):
                console.print(f"  Error {i}: {e}", highlight=False, markup=False)
        console.print(result_table(m, level or None, request_rate))
        run: dict[str, Any] = {"max_concurrency": level or None, "request_rate": request_rate,
                               "burstiness": burstiness, "num_prompts": len(records), **m.to_dict(),
                               "failed_errors": errors[:10]}
        if save_detailed:
            run.update({
                "input_lens": [r.prompt_len for r in records],
                "output_lens": list(m.output_lens),
                "ttfts": [r.ttft for r in records],
                "itls": [r.itl for r in records],
                "e2els": [r.latency for r in records],
                "start_times": [r.start_time for r in records],
                "generated_texts": [r.generated_text for r in records],
                "errors": [r.error for r in records],
            })
        report["runs"].append(run)
    if len(report["runs"]) > 1:
        console.print(summary_table(report["runs"], percentiles))
    report = _jsonable(report)
    if json_path is not None:
        path = Path(json_path)
        if path.parent and not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        console.print(f"results written to {path}", highlight=False)
    return report


def bench_main(opts: BenchOptions, tokenizer: Any = None, console: Console | None = None) -> dict[str, Any]:
    """`vtool bench` end to end: discover the model, build the prompts, run every level, report.
    `tokenizer` (encode/decode/vocab_size) makes synthetic prompts exact; it may be None."""
    console = console or Console()
    api_key = opts.resolved_api_key()
    model = opts.model or discover_model(opts.url, api_key)
    if not opts.model:
        console.print(f"model: {model} (from {api_base(opts.url)}/v1/models)", highlight=False)
    prompts = prepare_prompts(opts, model, tokenizer, console)
    count_tokens = None
    if tokenizer is not None:
        def count_tokens(text: str) -> int:
            return len(_encode(tokenizer, text, add_special_tokens=False))
    output_len = opts.output_len if opts.output_len is not None else DEFAULT_OUTPUT_LEN
    dataset = opts.dataset_path or f"random(input_len={opts.input_len})"
    return run_bench(opts.url, model, prompts, output_len, parse_concurrency(opts.concurrency), opts.endpoint,
                     api_key, console, opts.json_path(model), request_rate=opts.request_rate,
                     burstiness=opts.burstiness, ignore_eos=opts.ignore_eos, seed=opts.seed,
                     percentiles=opts.percentiles, goodput=opts.goodput, warmup=opts.warmup,
                     save_detailed=opts.save_detailed, count_tokens=count_tokens, dataset=dataset)
