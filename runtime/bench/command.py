"""`vtool bench`: a serving benchmark of an OpenAI-compatible server, measured and reported as
`vllm bench serve` does (metric definitions: shared/notes/serving-metrics.md).

The CLI builds a BenchOptions (vLLM's flag names) and calls bench_main(); a caller that already
has prompts calls run_bench() directly.

Against any OpenAI-compatible server (vLLM, vtool, llama.cpp's llama-server, ...):
* prompts are measured in the served model's tokens with a local tokenizer (--tokenizer: a
  tokenizer.json, a model folder or a .gguf file, as `vtool tokenize` reads them), as vLLM's
  bench does; without one, the server's /tokenize is used only if it answers vLLM's shape
  ({model, prompt, add_special_tokens} -> {count, tokens}), else the synthetic dataset is
  refused (llama-server's /tokenize takes {"content"} and answers {"tokens": []} to vLLM's
  request: trusting it built prompts ~11x too long);
* output tokens come from the server's usage wherever it sends it (client.py), else from the
  generated text re-tokenized; each run says which (`output_tokens_counted_by`);
* every run (concurrency level), and the warm-up request, gets prompts of its own, and the
  seed is fresh per invocation unless --seed is given, so no prompt cache helps one run from
  another (`fresh_prompts`); the server's usage.prompt_tokens is checked against what the
  local tokenizer expects (`prompt_tokens_check`).
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
from vtool.runtime.bench import server_steps
from vtool.runtime.bench.client import (ENDPOINT_PATHS, RequestInput, api_base, auth_headers, endpoint_url,
                                        fetch_models, run_requests)
from vtool.runtime.bench.client_processes import default_client_processes
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
    expected_server_len: int | None = None   # what usage.prompt_tokens should say (BOS / chat template in)


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
    seed: int | None = 0                        # --seed; None: a fresh one per invocation (reported)
    tokenizer: str | None = None                # --tokenizer: tokenizer.json, model folder or .gguf
    fresh_prompts: bool = True                  # each run (level) gets prompts of its own
    extra_body: dict[str, Any] | None = None    # --extra-body: merged into every request body, over the below
    temperature: float | None = None            # --temperature; None: 0.0 (greedy), as vLLM's bench
    top_p: float | None = None                  # --top-p (sent only when given)
    top_k: int | None = None                    # --top-k
    min_p: float | None = None                  # --min-p
    result_json: str | None = None              # --result-json PATH
    save_result: bool = False                   # --save-result (default file name in the cwd)
    save_detailed: bool = False                 # --save-detailed (per-request lists in the JSON)
    percentiles: Sequence[float] = DEFAULT_PERCENTILES   # --metric-percentiles
    goodput: dict[str, float] | None = None     # --goodput ttft:ms tpot:ms e2el:ms (parse_goodput)
    warmup: bool = True                         # one untimed test request first, as vLLM
    client_processes: int | None = None         # --client-processes; None: default_client_processes per level

    def request_body(self) -> dict[str, Any]:
        """What every request carries besides the prompt and max_tokens (sampling_body)."""
        return sampling_body(self.temperature, self.top_p, self.top_k, self.min_p, self.extra_body)

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


def parse_request_rate(value: str | float) -> float:
    """--request-rate: requests a second (> 0), or inf (every request at once), as vLLM."""
    try:
        rate = float(value)
    except (TypeError, ValueError):
        raise VtoolError(f"--request-rate {value!r} is not a number; give requests a second or inf") from None
    if math.isnan(rate) or rate <= 0:
        raise VtoolError(f"--request-rate {value!r}: give a positive number of requests a second, or inf")
    return rate


def parse_percentiles(value: str | Iterable[float | str] | None) -> tuple[float, ...]:
    """'25,50,99' -> (25.0, 50.0, 99.0) (vLLM's --metric-percentiles); None: the default set."""
    if value is None:
        return DEFAULT_PERCENTILES
    items = value.replace(" ", "").split(",") if isinstance(value, str) else list(value)
    out: list[float] = []
    for v in items:
        if v == "":
            continue
        try:
            p = float(v)
        except (TypeError, ValueError):
            raise VtoolError(f"--metric-percentiles: {v!r} is not a number; give e.g. 50,90,99") from None
        if not 0.0 <= p <= 100.0:
            raise VtoolError(f"--metric-percentiles: {p:g} is outside 0-100")
        out.append(p)
    if not out:
        raise VtoolError("--metric-percentiles: no percentile given; give e.g. 50,90,99")
    return tuple(out)


def parse_extra_body(value: str | None) -> dict[str, Any] | None:
    """--extra-body: a JSON object merged into every request body (vLLM's flag)."""
    if value is None:
        return None
    try:
        body = json.loads(value)
    except json.JSONDecodeError as err:
        raise VtoolError(f"--extra-body is not valid JSON ({err.msg} at character {err.pos}); "
                         "give an object, e.g. '{\"top_k\": 20}'") from None
    if not isinstance(body, dict):
        raise VtoolError(f"--extra-body must be a JSON object, got {type(body).__name__}")
    return body


def sampling_body(temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                  min_p: float | None = None, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling fields every request carries, as `vllm bench serve` builds them: the flags
    given, temperature 0.0 (greedy) when none is, then --extra-body over them. Greedy by
    default is what makes two servers' figures comparable: a server's own default temperature
    (1.0 in vLLM and vtool, 0.8 in llama-server) would otherwise decide what is measured."""
    for name, value, high in (("temperature", temperature, math.inf), ("top-p", top_p, 1.0), ("min-p", min_p, 1.0)):
        if value is not None and not (math.isfinite(value) and 0.0 <= value <= high):
            raise VtoolError(f"--{name} {value!r}: give a number in [0, {high:g}]")
    if top_p is not None and top_p == 0.0:
        raise VtoolError("--top-p 0 keeps no token; give a number in (0, 1]")
    if top_k is not None and (top_k == 0 or top_k < -1):
        raise VtoolError(f"--top-k {top_k}: give -1 (no limit) or a positive number of tokens")
    body: dict[str, Any] = {k: v for k, v in (("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
                                               ("temperature", temperature)) if v is not None}
    body.setdefault("temperature", 0.0)
    return {**body, **(extra_body or {})}


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


def allowed_ids(tokenizer: Any) -> np.ndarray:
    """The ids synthetic prompts are made of: every non-special id of the vocabulary."""
    specials = _special_ids(tokenizer)
    allowed = np.array([i for i in range(_vocab_size(tokenizer)) if i not in specials], dtype=np.int64)
    if len(allowed) == 0:
        raise VtoolError("the tokenizer has no non-special tokens to build synthetic prompts from")
    return allowed


def synthetic_prompts(tokenizer: Any, num_prompts: int, input_len: int, seed: int = 0,
                      starts: Sequence[int] | None = None) -> list[BenchPrompt]:
    """vLLM's random dataset (range ratio 0): each prompt is a run of consecutive non-special token
    ids from a random offset, decoded and re-encoded until it is exactly `input_len` tokens.
    `starts` gives each prompt's first position in allowed_ids instead (distinct starts: no two
    prompts share a first token, so none is a prefix-cache hit for another)."""
    if input_len < 1:
        raise VtoolError(f"--input-len must be at least 1, got {input_len}")
    rng = np.random.default_rng(seed)
    allowed = allowed_ids(tokenizer)
    offsets = rng.integers(0, len(allowed), size=num_prompts)
    if starts is not None:
        if len(starts) != num_prompts:
            raise ValueError(f"{len(starts)} starts for {num_prompts} prompts")
        offsets = np.asarray(starts, dtype=np.int64) - np.arange(num_prompts)
    prompts = []
    for i in range(num_prompts):
        ids = allowed[(int(offsets[i]) + i + np.arange(input_len)) % len(allowed)].tolist()
        text, n = decode_to_target_len(tokenizer, ids, input_len, rng, allowed)
        prompts.append(BenchPrompt(text, n))
    return prompts


def distinct_starts(n_allowed: int, counts: Sequence[int], seed: int) -> list[list[int]]:
    """One list of start positions per entry of `counts`, all distinct across the lists while the
    vocabulary has room (else drawn with repetition)."""
    rng = np.random.default_rng(seed)
    total = sum(counts)
    flat = rng.choice(n_allowed, size=total, replace=total > n_allowed).tolist()
    out, at = [], 0
    for c in counts:
        out.append(flat[at:at + c])
        at += c
    return out


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


def _vllm_tokenize_count(body: Any) -> int:
    """The count of a vLLM-shaped /tokenize answer ({"count": n, "tokens": [n ids], ...}); raises
    ValueError for any other shape (llama-server's {"tokens": [...]} without "count", say)."""
    if not isinstance(body, dict):
        raise ValueError(f"not a JSON object: {str(body)[:200]}")
    count, tokens = body.get("count"), body.get("tokens")
    if isinstance(count, bool) or not isinstance(count, int):
        raise ValueError(f"no integer 'count' in {json.dumps(body)[:200]}")
    if not isinstance(tokens, list) or len(tokens) != count or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ValueError(f"'tokens' is not a list of {count} ids in {json.dumps(body)[:200]}")
    return count


TOKENIZE_PROBES = ("hello", "hello world, this is a tokenizer probe: 12345 tokens.")


def probe_server_tokenizer(client: httpx.Client, url: str, model: str, api_key: str | None = None,
                           add_special_tokens: bool = False) -> tuple[Callable[[str], int] | None, str]:
    """(a counter backed by the server's POST /tokenize, "") when it answers vLLM's shape
    ({model, prompt, add_special_tokens} -> {count, tokens}) with plausible counts (both probes
    counted, the longer one longer); else (None, why not)."""
    base = api_base(url)

    def count(text: str) -> int:
        r = client.post(base + "/tokenize", headers=auth_headers(api_key),
                        json={"model": model, "prompt": text, "add_special_tokens": add_special_tokens})
        r.raise_for_status()
        return _vllm_tokenize_count(r.json())

    try:
        short, long = (count(t) for t in TOKENIZE_PROBES)
    except httpx.HTTPStatusError as e:
        return None, f"answered HTTP {e.response.status_code}"
    except httpx.HTTPError as e:
        return None, f"could not be reached ({type(e).__name__})"
    except ValueError as e:   # JSON errors included
        return None, f"does not answer vLLM's shape ({e})"
    if not 0 < short < long:
        return None, (f"counted {short} tokens in {TOKENIZE_PROBES[0]!r} and {long} in a longer text "
                      "(a server that reads another request shape answers 0)")
    return count, ""


def server_token_counter(client: httpx.Client, url: str, model: str, api_key: str | None = None,
                         add_special_tokens: bool = False) -> Callable[[str], int] | None:
    """probe_server_tokenizer's counter, or None."""
    return probe_server_tokenizer(client, url, model, api_key, add_special_tokens)[0]


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer `vtool tokenize` reads: a tokenizer.json, a model folder or a .gguf file."""
    from vtool.runtime.text.tokenizer import Tokenizer

    return Tokenizer.load(path)


def run_seed(seed: int, run: int) -> int:
    """The seed of run `run` (0: the warm-up request, 1..: the levels) under the invocation seed."""
    return int(np.random.SeedSequence([int(seed) & (2**63 - 1), run]).generate_state(1, np.uint64)[0])


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


@dataclasses.dataclass
class PromptPlan:
    """The prompts of one invocation: the warm-up request's, one set per run, and how the
    generated text is counted when the server sends no usage."""

    warmup: BenchPrompt
    runs: list[list[BenchPrompt]]
    count_tokens: Callable[[str], int] | None
    count_method: str                   # metrics' name for count_tokens ("tokenizer", "server /tokenize")
    prompt_source: str                  # how prompt lengths were measured, for the report


def _server_counter(url: str, model: str, api_key: str | None) -> Callable[[str], int]:
    """Counts text (no special tokens) with the server's vLLM-shaped /tokenize, one keep-alive
    client for the whole invocation."""
    client = httpx.Client(timeout=60)
    base = api_base(url)

    def count(text: str) -> int:
        r = client.post(base + "/tokenize", headers=auth_headers(api_key),
                        json={"model": model, "prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return _vllm_tokenize_count(r.json())
    return count


def _token_counter(tokenizer: Any) -> Callable[[str], int]:
    def count(text: str) -> int:
        return len(_encode(tokenizer, text, add_special_tokens=False))
    return count


def expected_server_len(tokenizer: Any, prompt: str, endpoint: str) -> int | None:
    """The prompt tokens a server running this tokenizer should report: completions, the text
    with the tokenizer's own special tokens (BOS where the model asks for it); chat, the chat
    template around one user message (None when the tokenizer has no template to render)."""
    try:
        if endpoint == "chat":
            if not callable(getattr(tokenizer, "apply_chat_template", None)) or \
                    getattr(tokenizer, "chat_template", None) is None:
                return None
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            return len(_encode(tokenizer, text, add_special_tokens=False))
        return len(_encode(tokenizer, prompt, add_special_tokens=True))
    except Exception:  # noqa: BLE001 - a template that does not render leaves the check out
        return None


def _with_expected(prompts: list[BenchPrompt], tokenizer: Any, endpoint: str) -> list[BenchPrompt]:
    for bp in prompts:
        bp.expected_server_len = expected_server_len(tokenizer, bp.prompt, endpoint)
    return prompts


def plan_prompts(opts: BenchOptions, model: str, levels: Sequence[int], seed: int, tokenizer: Any = None,
                 console: Console | None = None) -> PromptPlan:
    """The prompts opts describe, for `levels` runs plus the warm-up request: the dataset file,
    or synthetic prompts of exactly --input-len tokens of `tokenizer`; without a tokenizer, of
    the server's vLLM-shaped /tokenize, else refused. Fresh prompts: run i draws with
    run_seed(seed, i); otherwise every run sends run 1's prompts."""
    console = console or Console(stderr=True, emoji=False)
    if opts.num_prompts < 1:
        raise VtoolError(f"--num-prompts must be at least 1, got {opts.num_prompts}")
    n_runs = len(levels) if opts.fresh_prompts else 1
    count_tokens = _token_counter(tokenizer) if tokenizer is not None else None
    count_method = "tokenizer"
    why = ""
    if tokenizer is None:
        with httpx.Client(timeout=60) as client:
            found, why = probe_server_tokenizer(client, opts.url, model, opts.resolved_api_key())
        if found is not None:
            count_tokens = _server_counter(opts.url, model, opts.resolved_api_key())
            count_method = "server /tokenize"

    starts: list[list[int]] | None = None
    if not opts.dataset_path and tokenizer is not None:   # no first token shared by two prompts
        starts = distinct_starts(len(allowed_ids(tokenizer)), [1] + [opts.num_prompts] * n_runs, run_seed(seed, 0))

    def build(run: int, n: int) -> list[BenchPrompt]:
        rs = run_seed(seed, run)
        if opts.dataset_path:
            return load_dataset_prompts(opts.dataset_path, n, rs, opts.output_len, tokenizer)
        if tokenizer is not None:
            return _with_expected(synthetic_prompts(tokenizer, n, opts.input_len, rs, starts[run] if starts else None),
                                  tokenizer, opts.endpoint)
        return word_prompts(n, opts.input_len, rs, count_tokens)

    if opts.dataset_path:
        source = f"dataset {opts.dataset_path}" + (" (lengths by the local tokenizer)" if tokenizer is not None
                                                  else " (lengths from the server's usage)")
    elif tokenizer is not None:
        source = f"synthetic, exactly {opts.input_len} tokens of the local tokenizer"
    elif count_tokens is not None:
        source = f"synthetic words, fitted to {opts.input_len} tokens by the server's /tokenize"
    else:
        raise VtoolError(
            f"--input-len {opts.input_len}: building prompts of that many tokens needs the served model's "
            f"tokenizer, and the server's /tokenize at {api_base(opts.url)} {why}. Pass --tokenizer (the "
            f"model's tokenizer.json, its folder or its .gguf file), or --dataset-path")
    with console.status("building prompts"):
        warmup = build(0, 1)[0]
        runs = [build(i + 1, opts.num_prompts) for i in range(n_runs)]
    if not opts.fresh_prompts:
        runs = runs * len(levels)
    if tokenizer is not None and opts.dataset_path:
        for prompts in runs:
            _with_expected(prompts, tokenizer, opts.endpoint)
    return PromptPlan(warmup, runs, count_tokens, count_method, source)


def prepare_prompts(opts: BenchOptions, model: str, tokenizer: Any = None,
                    console: Console | None = None) -> list[BenchPrompt]:
    """One run's prompts (plan_prompts' first set, seed opts.seed or 0)."""
    seed = opts.seed if opts.seed is not None else 0
    return plan_prompts(opts, model, [0], seed, tokenizer, console).runs[0]


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

def _inputs(prompts: Sequence[BenchPrompt], model: str, api_url: str, output_len: int, ignore_eos: bool,
            api_key: str | None, extra_body: dict[str, Any] | None) -> list[RequestInput]:
    return [RequestInput(prompt=bp.prompt, prompt_len=bp.prompt_len,
                         output_len=bp.output_len if bp.output_len is not None else output_len,
                         model=model, api_url=api_url, ignore_eos=ignore_eos, api_key=api_key,
                         extra_body=extra_body) for bp in prompts]


async def _run_all(url: str, model: str, prompt_sets: Sequence[Sequence[BenchPrompt]], warmup_prompt: BenchPrompt | None,
                   output_len: int, levels: Sequence[int], endpoint: str, api_key: str | None, console: Console,
                   request_rate: float, burstiness: float, ignore_eos: bool, seed: int, warmup: bool,
                   extra_body: dict[str, Any] | None,
                   processes: Sequence[int]) -> list[tuple[int, list[RequestRecord], float, Any]]:
    api_url = endpoint_url(url, endpoint)  # type: ignore[arg-type]
    if warmup:
        console.print("Starting initial single prompt test run...", highlight=False)
        first = _inputs([warmup_prompt or prompt_sets[0][0]], model, api_url, output_len, ignore_eos, api_key,
                        extra_body)
        recs, _ = await run_requests(first, endpoint, max_concurrency=1)  # type: ignore[arg-type]
        if not recs[0].success:
            raise VtoolError(f"initial test request to {api_url} failed: {recs[0].error}; check --url, --model, "
                             f"--endpoint and --api-key")
        console.print("Initial test run completed.", highlight=False)
    results = []
    for level, prompts, level_processes in zip(levels, prompt_sets, processes):
        inputs = _inputs(prompts, model, api_url, output_len, ignore_eos, api_key, extra_body)
        # A level that sends the prompts of an earlier one would be served from the prefix
        # cache that one filled: reset it. Best effort: a server without the endpoint (not
        # vLLM-compatible) is measured as it is; fresh prompts per level need no reset.
        await _reset_prefix_cache(url, api_key)
        before = await server_steps.scrape(url, api_key)
        with Progress(TextColumn("[bold]concurrency {task.fields[level]}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("[red]{task.fields[failed]} failed"), TimeElapsedColumn(),
                      console=console, transient=False) as bar:
            task = bar.add_task("bench", total=len(inputs), level=level or "no limit", failed=0)
            failed = 0

            def done(rec: RequestRecord) -> None:
                nonlocal failed
                failed += 0 if rec.success else 1
                bar.update(task, advance=1, failed=failed)

            records, duration = await run_requests(
                inputs, endpoint, max_concurrency=level or None,  # type: ignore[arg-type]
                request_rate=request_rate, burstiness=burstiness, seed=seed, on_done=done,
                processes=level_processes)
        after = await server_steps.scrape(url, api_key) if before is not None else None
        results.append((level, records, duration, server_steps.between(before, after)))
    return results


async def _reset_prefix_cache(url: str, api_key: str | None) -> bool:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(f"{api_base(url)}/reset_prefix_cache", headers=headers)
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def _no_prompt_reused(prompt_sets: Sequence[Sequence[BenchPrompt]], warmup_prompt: BenchPrompt | None,
                      warmup: bool) -> bool:
    """True when no prompt text is sent in two runs, nor both as the warm-up and in a run."""
    seen: set[str] = {warmup_prompt.prompt} if warmup and warmup_prompt is not None else set()
    for ps in prompt_sets:
        texts = {bp.prompt for bp in ps}
        if texts & seen:
            return False
        seen |= texts
    return True


def prompt_tokens_check(prompts: Sequence[BenchPrompt], records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The prompt lengths asked for against what the server's usage said, per successful request:
    `requested` (the client's count, --input-len for synthetic prompts), `expected` (the same text
    with the tokenizer's special tokens or chat template, where the client knows them), `server`
    (usage.prompt_tokens), and the requests where server != expected (or, with no expectation,
    where server < requested)."""
    requested = expected = server = 0
    mismatched: list[dict[str, Any]] = []
    have_expected = have_usage = 0
    for bp, rec in zip(prompts, records):
        if not rec.success:
            continue
        requested += bp.prompt_len
        if bp.expected_server_len is not None:
            expected += bp.expected_server_len
            have_expected += 1
        if rec.usage_prompt_tokens is None:
            continue
        have_usage += 1
        server += rec.usage_prompt_tokens
        want = bp.expected_server_len
        if (want is not None and rec.usage_prompt_tokens != want) or \
                (want is None and rec.usage_prompt_tokens < bp.prompt_len):
            mismatched.append({"requested": bp.prompt_len, "expected": want, "server": rec.usage_prompt_tokens})
    return {"requested_total": requested, "expected_total": expected if have_expected else None,
            "server_total": server if have_usage else None, "requests_with_usage": have_usage,
            "mismatched_requests": len(mismatched), "mismatch_examples": mismatched[:5]}


def run_bench(url: str, model: str | None, prompts: Sequence[BenchPrompt] | Sequence[Sequence[BenchPrompt]],
              output_len: int, concurrency_levels: Sequence[int] | str, endpoint: str = "completions",
              api_key: str | None = None, console: Console | None = None, json_path: str | Path | None = None, *,
              request_rate: float = math.inf, burstiness: float = 1.0, ignore_eos: bool = False, seed: int = 0,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES, goodput: dict[str, float] | None = None,
              warmup: bool = True, save_detailed: bool = False, count_tokens: Callable[[str], int] | None = None,
              count_method: str = "tokenizer", warmup_prompt: BenchPrompt | None = None,
              extra_body: dict[str, Any] | None = None, dataset: str | None = None,
              report_extra: dict[str, Any] | None = None, client_processes: int | None = None) -> dict[str, Any]:
    """Run the prompts once per concurrency level (0 = no limit), print vLLM's result block per
    level (and a summary when there are several), and return the report; write it as JSON to
    `json_path` when given. `prompts` is one list sent at every level, or one list per level
    (fresh prompts); `warmup_prompt` is the untimed first request's (default: the first prompt).
    Output tokens: the server's usage, else `count_tokens` on the generated text (reported as
    `count_method`), else one per content chunk. `client_processes` reads the streams in that many
    worker processes at every level (None: default_client_processes for each level)."""
    console = console or Console(emoji=False)  # names and prompts printed as given
    if endpoint not in ENDPOINT_PATHS:
        raise VtoolError(f"--endpoint {endpoint!r}: give one of {', '.join(sorted(ENDPOINT_PATHS))}")
    if not prompts:
        raise VtoolError("no prompts to benchmark")
    if output_len < 1:
        raise VtoolError(f"--output-len must be at least 1, got {output_len}")
    levels = parse_concurrency(concurrency_levels if isinstance(concurrency_levels, str) else list(concurrency_levels))
    per_level = not isinstance(prompts[0], BenchPrompt)
    prompt_sets: list[list[BenchPrompt]] = [list(p) for p in prompts] if per_level else \
        [list(prompts)] * len(levels)  # type: ignore[list-item]
    if len(prompt_sets) != len(levels) or not all(prompt_sets):
        raise VtoolError(f"{len(prompt_sets)} prompt sets for {len(levels)} concurrency levels (one non-empty set each)")
    if client_processes is not None and client_processes < 1:
        raise VtoolError(f"--client-processes must be at least 1, got {client_processes}")
    processes = [client_processes or default_client_processes(level or None) for level in levels]
    if model is None:
        model = discover_model(url, api_key)
        console.print(f"model: {model} (from {api_base(url)}/v1/models)", highlight=False)

    results = asyncio.run(_run_all(url, model, prompt_sets, warmup_prompt, output_len, levels, endpoint, api_key,
                                   console, request_rate, burstiness, ignore_eos, seed, warmup, extra_body,
                                   processes))
    fresh = _no_prompt_reused(prompt_sets, warmup_prompt if warmup_prompt is not None or not warmup
                              else prompt_sets[0][0], warmup)
    report: dict[str, Any] = {
        "date": _dt.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "vtool",
        "endpoint_type": "openai-chat" if endpoint == "chat" else "openai",
        "endpoint": ENDPOINT_PATHS[endpoint],
        "base_url": api_base(url),
        "model_id": model,
        "dataset": dataset,
        "num_prompts": len(prompt_sets[0]),
        "output_len": output_len,
        "request_rate": request_rate,
        "burstiness": burstiness,
        "ignore_eos": ignore_eos,
        "seed": seed,
        "fresh_prompts": fresh,
        "output_token_fallback": count_method if count_tokens is not None else "chunks",
        **(report_extra or {}),
        "percentiles": [float(p) for p in percentiles],
        "goodput_slo_ms": goodput,
        "runs": [],
    }
    for (level, records, duration, steps), prompts_sent, level_processes in zip(results, prompt_sets, processes):
        m = calculate_metrics(records, duration, percentiles, count_tokens, goodput, count_method)
        errors = [r.error for r in records if not r.success]
        if errors:
            console.print(f"[red]{len(errors)} failed request(s) (showing up to 10):[/]", highlight=False)
            for i, e in enumerate(errors[:10]):
                console.print(f"  Error {i}: {e}", highlight=False, markup=False)
        console.print(result_table(m, level or None, request_rate))
        if (line := server_steps.describe(steps)) is not None:
            console.print(line, highlight=False)
        check = prompt_tokens_check(prompts_sent, records)
        _warn_counts(console, level, m, check)
        run: dict[str, Any] = {"max_concurrency": level or None, "request_rate": request_rate,
                               "burstiness": burstiness, "num_prompts": len(records), **m.to_dict(),
                               "prompt_tokens_check": check,
                               "stale_connection_retries": sum(r.retries for r in records),
                               "client_processes": level_processes,
                               "failed_errors": errors[:10],
                               # a vtool server's own steps by kind during the level (None: another server)
                               "server_steps": steps}
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
                "usage_prompt_tokens": [r.usage_prompt_tokens for r in records],
                "usage_completion_tokens": [r.usage_completion_tokens for r in records],
                "usage_cached_tokens": [r.usage_cached_tokens for r in records],
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


def _warn_counts(console: Console, level: int, m: BenchMetrics, check: dict[str, Any]) -> None:
    """Say how tokens were counted where it is not the server's usage, and any prompt-length
    mismatch, under the level's result table."""
    conc = f"concurrency {level or 'no limit'}"
    others = {k: v for k, v in m.output_count_methods.items() if k != "usage"}
    if others:
        how = ", ".join(f"{v} by {k}" for k, v in sorted(others.items()))
        note = " (one token per content chunk: a lower bound; pass --tokenizer)" if "chunks" in others else ""
        console.print(f"[yellow]{conc}: the server sent no usage for some requests; output tokens counted: "
                      f"{how}{note}[/]", highlight=False)
    if check["mismatched_requests"]:
        ex = check["mismatch_examples"][0]
        console.print(f"[yellow]warning: {conc}: {check['mismatched_requests']} request(s) where the server counted "
                      f"another prompt length than the client (e.g. requested {ex['requested']}, expected "
                      f"{ex['expected']}, server {ex['server']}): is --tokenizer the served model's?[/]",
                      highlight=False)


def bench_main(opts: BenchOptions, tokenizer: Any = None, console: Console | None = None) -> dict[str, Any]:
    """`vtool bench` end to end: discover the model, build the prompts, run every level, report.
    `tokenizer` (encode/decode/vocab_size; the local server's) makes synthetic prompts exact;
    without it opts.tokenizer is loaded, and without that the server's vLLM-shaped /tokenize is
    used or synthetic prompts are refused."""
    console = console or Console(emoji=False)  # names and prompts printed as given
    api_key = opts.resolved_api_key()
    model = opts.model or discover_model(opts.url, api_key)
    if not opts.model:
        console.print(f"model: {model} (from {api_base(opts.url)}/v1/models)", highlight=False)
    levels = parse_concurrency(opts.concurrency)
    seed = opts.seed if opts.seed is not None else fresh_seed()
    tokenizer_source = "the local server's model" if tokenizer is not None else None
    if opts.tokenizer:
        tokenizer = load_tokenizer(opts.tokenizer)
        tokenizer_source = str(opts.tokenizer)
    plan = plan_prompts(opts, model, levels, seed, tokenizer, console)
    output_len = opts.output_len if opts.output_len is not None else DEFAULT_OUTPUT_LEN
    dataset = opts.dataset_path or f"random(input_len={opts.input_len})"
    body = opts.request_body()
    extra = {"tokenizer": tokenizer_source, "prompt_lengths": plan.prompt_source, "sampling_params": body}
    return run_bench(opts.url, model, plan.runs, output_len, levels, opts.endpoint,
                     api_key, console, opts.json_path(model), request_rate=opts.request_rate,
                     burstiness=opts.burstiness, ignore_eos=opts.ignore_eos, seed=seed,
                     percentiles=opts.percentiles, goodput=opts.goodput, warmup=opts.warmup,
                     save_detailed=opts.save_detailed, count_tokens=plan.count_tokens,
                     count_method=plan.count_method, warmup_prompt=plan.warmup, dataset=dataset,
                     extra_body=body, report_extra=extra, client_processes=opts.client_processes)
