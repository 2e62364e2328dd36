"""POST /v1/embeddings, and serving an embedding model (manifest task "embed").

The request is OpenAI's (and vLLM's): `input` is a string, a list of strings, a list of token
ids or a list of lists of token ids; `encoding_format` "float" or "base64" (little-endian
float32 bytes); `dimensions` truncates a Matryoshka model's vectors and renormalizes them, and
is refused, with vLLM's words, for a model that was not trained for it; vLLM's
`add_special_tokens` (default true) is read. The answer: {"object": "list", "data": [{"object":
"embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}.

An embedding model has no engine core and no KV cache: the API server holds the model itself
(an EmbeddingService) and runs it on one worker thread. Whatever requests are waiting when the
worker is free go through the model together (Embedder.pooled batches their inputs by length),
so one request's list is one batched call and concurrent requests share calls too. Such a
server refuses /v1/completions and /v1/chat/completions by name, as vLLM does ("The model does
not support Completions API"); a generation server answers /v1/embeddings the same way.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Optional

import numpy as np
from pydantic import field_validator

from vtool import VtoolError
from vtool.runtime.engine.pooling import PoolingError, to_base64
from vtool.runtime.serving.errors import BadRequestError
from vtool.runtime.serving.protocol import UsageInfo, _Request, check_truncate_prompt_tokens, random_uuid

if TYPE_CHECKING:
    from rich.console import Console

    from vtool.runtime.engine.embed import Embedder
    from vtool.runtime.serving.completions import ServingState
    from vtool.runtime.serving.serve_cmd import ServeOptions
    from vtool.runtime.weights.checkpoint import Checkpoint

log = logging.getLogger("vtool.server")

INPUT_KINDS = "a string, a list of strings, a list of token ids or a list of lists of token ids"


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_input(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """`input` as OpenAI and vLLM take it; anything else (an empty input, mixed or wrong types)
    is a ValueError naming what was sent."""
    if isinstance(value, str):
        if not value:
            raise ValueError("input: must not be an empty string")
        return value
    if not isinstance(value, list):
        raise ValueError(f"input: must be {INPUT_KINDS}, got {type(value).__name__}")
    if not value:
        raise ValueError("input: must not be an empty list")
    if all(isinstance(x, str) for x in value):
        empty = [i for i, x in enumerate(value) if not x]
        if empty:
            raise ValueError(f"input[{empty[0]}]: must not be an empty string")
        return value
    if all(_is_token(x) for x in value):
        return value
    if all(isinstance(x, list) for x in value):
        for i, ids in enumerate(value):
            if not ids:
                raise ValueError(f"input[{i}]: must not be an empty list of token ids")
            bad = [x for x in ids if not _is_token(x)]
            if bad:
                raise ValueError(f"input[{i}]: a list of token ids must hold integers only, got {bad[0]!r}")
        return value
    kinds = sorted({type(x).__name__ for x in value})
    raise ValueError(f"input: must be {INPUT_KINDS}; got a list of {', '.join(kinds)}")


class EmbeddingRequest(_Request):
    """POST /v1/embeddings (OpenAI's fields and vLLM's add_special_tokens)."""

    _LOG_IGNORED = True
    _UNSUPPORTED: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {
        "normalize": ((None,), "normalize is not supported by this server: the model's sentence-transformers "
                               "configuration (modules.json) says whether vectors are normalized"),
        "embed_dtype": ((None, "float32"), "embeddings are float32 only"),
    }

    model: Optional[str] = None
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    add_special_tokens: bool = True
    # vLLM: only each input's last k tokens (-1: as many as the context holds)
    truncate_prompt_tokens: Optional[int] = None

    _check_truncate = field_validator("truncate_prompt_tokens")(check_truncate_prompt_tokens)

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        return check_input(value)

    def token_lists(self, tokenize: Any) -> list[list[int]]:
        """Every input as token ids (strings through `tokenize(text, add_special_tokens)`)."""
        value = self.input
        if isinstance(value, str):
            return [tokenize(value, self.add_special_tokens)]
        if all(isinstance(x, str) for x in value):
            return [tokenize(x, self.add_special_tokens) for x in value]
        if all(_is_token(x) for x in value):
            return [list(value)]
        return [list(x) for x in value]


# ------------------------------------------------------------------------------- the service


@dataclasses.dataclass
class _Job:
    inputs: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    result: np.ndarray | None = None


class EmbeddingService:
    """The model of an embedding server, on one worker thread; it stands where a generation
    server has its engine client (ServingState.engine): start, shutdown, health, metrics."""

    def __init__(self, embedder: Embedder, model_name: str):
        self.embedder = embedder
        self.model_name = model_name
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.requests = 0
        self.prompt_tokens = 0
        self.calls = 0

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="vtool-embed", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(10)
            self._thread = None

    async def health(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            raise VtoolError("the embedding worker is not running")

    async def reset_prefix_cache(self) -> None:
        return None  # an encoder caches nothing between requests

    async def metrics_text(self) -> str:
        name = self.model_name.replace("\\", "\\\\").replace('"', '\\"')
        lines = []
        for metric, kind, value, help_text in (
                ("vllm:request_success_total", "counter", self.requests, "Embedding requests answered."),
                ("vllm:prompt_tokens_total", "counter", self.prompt_tokens, "Tokens embedded."),
                ("vtool:embed_calls_total", "counter", self.calls, "Batched encode calls into the model.")):
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}", f'{metric}{{model_name="{name}"}} {value}']
        return "\n".join(lines) + "\n"

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """The pooled hidden states [len(inputs), H] (checked inputs), batched with whatever
        other requests are waiting."""
        loop = asyncio.get_running_loop()
        job = _Job(inputs, loop, loop.create_future())
        self._jobs.put(job)
        return await job.future

    def _work(self) -> None:
        while True:
            first = self._jobs.get()
            if first is None:
                return
            jobs = [first]
            while True:  # everything waiting now goes through the model together
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._jobs.put(None)
                    break
                jobs.append(more)
            inputs = [ids for job in jobs for ids in job.inputs]
            try:
                pooled = self.embedder.pooled(inputs)
                self.calls += 1
            except BaseException as err:  # noqa: BLE001 - handed to every waiting request
                for job in jobs:
                    job.loop.call_soon_threadsafe(_set_exception, job.future, err)
                continue
            start = 0
            for job in jobs:
                part = pooled[start:start + len(job.inputs)]
                start += len(job.inputs)
                job.loop.call_soon_threadsafe(_set_result, job.future, part)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, err: BaseException) -> None:
    if not future.done():
        future.set_exception(err)


# ------------------------------------------------------------------------------- the endpoint


async def create_embedding(req: EmbeddingRequest, state: ServingState) -> dict[str, Any]:
    name = state.check_model(req.model)
    service: EmbeddingService = state.engine  # type: ignore[assignment]
    embedder = service.embedder
    try:
        embedder.pooler.check_dimensions(req.dimensions, name)
    except PoolingError as err:
        raise BadRequestError(str(err), param="dimensions") from None
    inputs = [state.truncate_prompt(ids, req.truncate_prompt_tokens) for ids in req.token_lists(embedder.tokenize)]
    for i, ids in enumerate(inputs):
        embedder.check(ids, "input" if len(inputs) == 1 else f"input[{i}]")  # EmbedInputError: a 400 naming it
    pooled = await service.embed(inputs)
    vectors = embedder.pooler.finish(pooled, req.dimensions)
    tokens = sum(len(ids) for ids in inputs)
    service.requests += 1
    service.prompt_tokens += tokens
    data = [{"object": "embedding", "index": i,
             "embedding": to_base64(v) if req.encoding_format == "base64" else [float(x) for x in v]}
            for i, v in enumerate(vectors)]
    usage = UsageInfo(prompt_tokens=tokens, total_tokens=tokens, completion_tokens=0)
    return {"id": f"embd-{random_uuid()}", "object": "list", "created": int(time.time()), "model": name,
            "data": data, "usage": usage.model_dump()}


def not_supported(api: str, state: ServingState) -> BadRequestError:
    """The 400 of an endpoint the served model's task has no use for (vLLM's words first)."""
    if api == "Embeddings":
        why = "it is a generation model; serve an embedding model (e.g. a BertModel checkpoint) for /v1/embeddings"
    else:
        why = "it is an embedding model; use /v1/embeddings"
    return BadRequestError(f"The model does not support {api} API: {why}")


# ------------------------------------------------------------------------------- serving


def serve_embedding_model(artifact: Path, checkpoint: Checkpoint, opts: ServeOptions, console: Console,
                          sock: Any, names: list[str]) -> None:
    """`vtool serve` for a model whose manifest says task "embed": one API-server process that
    holds the model (no engine core: nothing is scheduled step by step)."""
    from vtool.runtime.engine.embed import Embedder
    from vtool.runtime.serving.app import ServerInfo, create_app
    from vtool.runtime.serving.completions import ServingState
    from vtool.runtime.serving.serve_cmd import _run_uvicorn, _uvicorn
    from vtool.runtime.session import open_session

    if opts.api_server_count != 1:
        raise VtoolError(f"--api-server-count {opts.api_server_count}: an embedding model is served by one API "
                         "server process, which holds the model (there is no engine core to share)")
    session = open_session(artifact, checkpoint, opts.tokenizer_config, opts.max_model_len)
    embedder = Embedder(session)
    service = EmbeddingService(embedder, names[0])
    manifest = session.model.manifest
    info = ServerInfo(model_path=str(checkpoint.path), artifact=str(artifact), target=manifest["target"]["name"],
                      dtype=manifest["dtype"], engine={"task": "embed", "max_model_len": session.max_model_len,
                                                       "pooling": embedder.pooler.describe()},
                      served_model_names=names)
    state = ServingState(engine=service, tokenizer=session.tokenizer, served_names=names,  # type: ignore[arg-type]
                         max_model_len=session.max_model_len, metrics_enabled=not opts.disable_metrics,
                         sampling_defaults={}, enable_log_requests=opts.enable_log_requests,
                         max_log_len=opts.max_log_len, task="embed")
    p = embedder.pooler
    console.print(f"[dim]embedding model on {session.model.device_type}:{session.model.device_index}: "
                  f"{p.mode} pooling{', normalized' if p.normalize else ''}, {p.dim} dimensions, max_model_len "
                  f"{session.max_model_len}[/]", highlight=False)
    console.print(f"serving {checkpoint.path.name} on http://{opts.host}:{opts.port}/v1 (embeddings)", highlight=False)
    try:
        _run_uvicorn(_uvicorn(create_app(state, info, opts.api_key), opts.uvicorn_log_level), sock)
    finally:
        sock.close()
