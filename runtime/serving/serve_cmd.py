"""`vtool serve`: the engine core in its own process, one or more API-server processes in
front of it (as vLLM v1), on one listening socket.

The socket is bound first, so a taken port is refused before any model loads. The engine
core starts next (serving/engine_core.py) and says when it is ready. With
--api-server-count 1 this process is the API server; with N > 1 it starts N of them (each
its own Python process and event loop, sharing the socket: the kernel spreads connections
across them) and watches them all. When any of these processes dies, the rest are stopped
and the log says which one went and how: nothing hangs waiting for a process that is gone.

VTOOL_ENGINE_IN_PROCESS=1 runs the engine on a thread of the API server instead (one
process; for debugging and for measuring what the process split buys).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import threading
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from rich.console import Console

from vtool import VtoolError
from vtool.runtime.engine.async_engine import AsyncEngine
from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.serving.app import ServerInfo, create_app
from vtool.runtime.serving.completions import ServingState
from vtool.runtime.serving.core_client import CoreClient, client_identity
from vtool.runtime.serving.engine_core import CoreLaunch, EngineCoreProcess, name_process
from vtool.runtime.serving.metrics import ServerMetrics
from vtool.runtime.serving.reasoning import reasoning_parser
from vtool.runtime.serving.tool_parsers import tool_parser
from vtool.runtime.session import load_tokenizer, open_session
from vtool.runtime.weights.checkpoint import Checkpoint, open_checkpoint

MAX_NEW_TOKENS_ENV = "VTOOL_SERVER_MAX_NEW_TOKENS"
IN_PROCESS_ENV = "VTOOL_ENGINE_IN_PROCESS"
GRACEFUL_SHUTDOWN_S = 5  # open streams after the engine is gone end at once; this only bounds a stuck one

log = logging.getLogger("vtool.server")


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: tuple[str, ...] = ()
    tokenizer_config: str | None = None
    max_model_len: int | None = None
    api_key: str | None = None
    disable_metrics: bool = False
    enable_log_requests: bool = False
    enable_log_outputs: bool = False
    max_log_len: int | None = None
    enable_force_include_usage: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:N" unless a request says
    uvicorn_log_level: str = "info"
    api_server_count: int = 1
    reasoning_parser: str | None = None  # --reasoning-parser (serving/reasoning.py)
    default_chat_template_kwargs: str | None = None  # JSON object, under each request's own
    enable_auto_tool_choice: bool = False  # tool_choice "auto", read by tool_call_parser
    tool_call_parser: str | None = None  # --tool-call-parser (serving/tool_parsers)
    structured_outputs_config: str | None = None  # JSON object: vLLM's StructuredOutputsConfig fields

    def __post_init__(self) -> None:
        reasoning_parser(self.reasoning_parser)  # refuses an unknown name before anything starts
        if self.tool_call_parser is not None:
            tool_parser(self.tool_call_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise VtoolError("--enable-auto-tool-choice needs --tool-call-parser to say how calls are read "
                             "(hermes, llama3_json, mistral, pythonic, qwen3_coder)")
        chat_template_kwargs(self.default_chat_template_kwargs)
        structured_outputs_config(self.structured_outputs_config)
        if self.api_server_count < 1:
            raise VtoolError(f"--api-server-count must be at least 1, got {self.api_server_count}")


@dataclasses.dataclass(frozen=True)
class ApiServerSpec:
    """What an API-server process needs (picklable: it crosses a spawn)."""

    model_path: str
    opts: ServeOptions
    served_names: list[str]
    max_model_len: int
    sampling_defaults: dict[str, Any]
    info: ServerInfo
    core_address: str
    core_pid: int


def server_ceiling() -> int | None:
    raw = os.environ.get(MAX_NEW_TOKENS_ENV)
    if raw in (None, ""):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise VtoolError(f"{MAX_NEW_TOKENS_ENV}={raw!r} is not an integer") from None
    if value <= 0:
        raise VtoolError(f"{MAX_NEW_TOKENS_ENV} must be positive, got {value}")
    return value


def sampling_defaults(generation_config: dict | None) -> dict:
    """The model's generation_config sampling defaults, used when a request leaves a field
    unset (vLLM's --generation-config auto)."""
    if not generation_config:
        return {}
    return {k: generation_config[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
            if isinstance(generation_config.get(k), (int, float)) and not isinstance(generation_config.get(k), bool)}


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise VtoolError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _json_object(raw: str, flag: str) -> dict[str, Any]:
    """A flag's value that must be a JSON object; a VtoolError naming the flag otherwise."""
    try:
        value = json.loads(raw)
    except ValueError as err:
        raise VtoolError(f"{flag} is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise VtoolError(f"{flag} must be a JSON object, got {raw!r}")
    return value


def chat_template_kwargs(raw: str | None) -> dict[str, Any]:
    """--default-chat-template-kwargs: a JSON object (e.g. {"enable_thinking": false})."""
    return {} if raw in (None, "") else _json_object(raw, "--default-chat-template-kwargs")


# vLLM's StructuredOutputsConfig fields this server reads; its backends by vLLM's names
SO_BACKENDS = ("auto", "guidance")  # "guidance" is llguidance, the one engine here


def structured_outputs_config(raw: str | None) -> dict[str, Any]:
    """--structured-outputs-config: a JSON object of vLLM's StructuredOutputsConfig fields.
    `enable_in_reasoning` (default false): the grammar covers the reasoning section too, instead
    of starting after it; `backend`: "auto" or "guidance" (llguidance)."""
    if raw in (None, ""):
        return {"enable_in_reasoning": False}
    value = _json_object(raw, "--structured-outputs-config")
    unknown = sorted(set(value) - {"enable_in_reasoning", "backend"})
    if unknown:
        raise VtoolError(f"--structured-outputs-config: {', '.join(unknown)} not supported here (known: "
                         "enable_in_reasoning, backend)")
    if value.get("backend", "auto") not in SO_BACKENDS:
        raise VtoolError(f"--structured-outputs-config: backend {value['backend']!r} is not available; this "
                         f"server's grammar engine is llguidance ({' or '.join(map(repr, SO_BACKENDS))})")
    if not isinstance(value.get("enable_in_reasoning", False), bool):
        raise VtoolError("--structured-outputs-config: enable_in_reasoning must be true or false")
    return {"enable_in_reasoning": value.get("enable_in_reasoning", False)}


def _state(spec: ApiServerSpec, engine: CoreClient | AsyncEngine, tokenizer: Any) -> ServingState:
    o = spec.opts
    return ServingState(
        reasoning_parser=reasoning_parser(o.reasoning_parser),
        # as vLLM: the parser reads "auto" answers only when auto tool choice is enabled
        tool_parser=tool_parser(o.tool_call_parser) if o.enable_auto_tool_choice else None,
        grammar_in_reasoning=structured_outputs_config(o.structured_outputs_config)["enable_in_reasoning"],
        default_chat_template_kwargs=chat_template_kwargs(o.default_chat_template_kwargs),
        engine=engine, tokenizer=tokenizer, served_names=spec.served_names, max_model_len=spec.max_model_len,
        metrics_enabled=not o.disable_metrics, sampling_defaults=spec.sampling_defaults,
        enable_log_requests=o.enable_log_requests, enable_log_outputs=o.enable_log_outputs,
        max_log_len=o.max_log_len, force_include_usage=o.enable_force_include_usage,
        return_tokens_as_token_ids=o.return_tokens_as_token_ids)


def _uvicorn(app: Any, level: str) -> Any:
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level=level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))


def _run_uvicorn(server: Any, sock: socket.socket) -> None:
    """server.run, then back here however it was stopped. uvicorn raises the SIGTERM or
    SIGINT that stopped it again once it has shut down, which with the default handlers
    ends the process on the spot: the engine core would then be left to notice its parent
    is gone, and the socket folder to stay behind. While it runs, those signals only
    record; uvicorn's own handlers do the stopping."""
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, _frame: None) for s in stops} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        server.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_api_server(spec: ApiServerSpec, sock: socket.socket, index: int) -> int:
    """One API server on `sock`, a client of the engine core; returns the exit status
    (1 when it stopped because the engine core was gone)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from vtool.runtime.artifact.tvm_runtime import block_torch_import

    block_torch_import()
    tokenizer = load_tokenizer(open_checkpoint(spec.model_path), spec.opts.tokenizer_config)
    dead: list[str] = []
    server: Any = None

    def on_dead(message: str) -> None:
        dead.append(message)
        server.should_exit = True  # uvicorn's loop reads it; open streams already failed

    client = CoreClient(spec.core_address, spec.core_pid, tokenizer, client_identity(index), on_dead)
    server = _uvicorn(create_app(_state(spec, client, tokenizer), spec.info, spec.opts.api_key),
                      spec.opts.uvicorn_log_level)
    _run_uvicorn(server, sock)
    if dead:
        log.error("API server %d stopped: %s", index, dead[0])
        return 1
    return 0


def _api_server_main(spec: ApiServerSpec, sock: socket.socket, index: int) -> None:
    name_process(f"vtool-api-{index}")
    raise SystemExit(run_api_server(spec, sock, index))


def _supervise(spec: ApiServerSpec, sock: socket.socket, core: EngineCoreProcess) -> int:
    """Start spec.opts.api_server_count API servers and wait; when one process ends (or this
    one is asked to stop), stop the others. Returns the exit status."""
    context = multiprocessing.get_context("spawn")
    servers = [context.Process(target=_api_server_main, args=(spec, sock, i), name=f"vtool-api-{i}")
               for i in range(spec.opts.api_server_count)]
    for p in servers:
        p.start()
    stopping: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: stopping.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        watched = {p.sentinel: p for p in [*servers, core.process]}
        while not stopping:
            ended = wait(list(watched), timeout=0.5)
            if ended:
                gone = watched[ended[0]]
                gone.join(5)  # reaped, so its exit code is known
                log.error("%s (pid %d) exited with code %s; stopping the server", gone.name, gone.pid, gone.exitcode)
                break
        for p in servers:
            if p.is_alive():
                p.terminate()  # SIGTERM: uvicorn's graceful shutdown
        for p in servers:
            p.join(GRACEFUL_SHUTDOWN_S + 5)
            if p.is_alive():
                p.kill()
                p.join(5)
        return 0 if stopping else 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def serve(artifact: Path, checkpoint: Checkpoint, engine_config: EngineConfig, opts: ServeOptions,
          console: Console) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sock = bind_socket(opts.host, opts.port)
    config = dataclasses.replace(engine_config, max_new_tokens_ceiling=server_ceiling())
    names = list(opts.served_model_name) or [str(checkpoint.path)]
    from vtool.runtime.artifact.manifest import read_manifest

    if read_manifest(artifact).get("task") == "embed":  # no engine core: serving/embeddings.py
        from vtool.runtime.serving.embeddings import serve_embedding_model

        serve_embedding_model(artifact, checkpoint, opts, console, sock, names)
        return
    defaults = sampling_defaults(checkpoint.generation_config())
    if os.environ.get(IN_PROCESS_ENV, "") not in ("", "0"):
        if opts.api_server_count != 1:
            raise VtoolError(f"{IN_PROCESS_ENV}=1 runs one API server with the engine inside it; "
                             f"--api-server-count {opts.api_server_count} needs the engine core process")
        _serve_in_process(artifact, checkpoint, config, opts, console, sock, names, defaults)
        return
    with tempfile.TemporaryDirectory(prefix="vtool-serve-") as folder:
        address = f"ipc://{folder}/engine-core"
        core = EngineCoreProcess(CoreLaunch(
            artifact=str(artifact), model_path=str(checkpoint.path), tokenizer_config=opts.tokenizer_config,
            max_model_len=opts.max_model_len, engine_config=config,
            metrics_model_name=None if opts.disable_metrics else names[0], address=address))
        i = core.info
        info = ServerInfo(model_path=str(checkpoint.path), artifact=str(artifact), target=i.target, dtype=i.dtype,
                          engine={**dataclasses.asdict(config), "num_blocks": i.num_blocks,
                                  "max_model_len": i.max_model_len, "engine_core_pid": i.pid,
                                  "kv_window_freeing_active": i.frees_window,
                                  "api_server_count": opts.api_server_count},
                          served_model_names=names)
        console.print(f"[dim]engine core (pid {i.pid}) on {i.device}: {i.num_blocks} KV blocks of {i.block_size} "
                      f"tokens, max_model_len {i.max_model_len}, max_num_seqs {config.max_num_seqs}, prefix caching "
                      f"{'on' if config.enable_prefix_caching else 'off'}"
                      f"{', KV blocks outside the sliding window freed' if i.frees_window else ''}; "
                      f"{opts.api_server_count} API server(s)[/]",
                      highlight=False)
        console.print(f"serving {checkpoint.path.name} on http://{opts.host}:{opts.port}/v1", highlight=False)
        spec = ApiServerSpec(model_path=str(checkpoint.path), opts=opts, served_names=names,
                             max_model_len=i.max_model_len, sampling_defaults=defaults, info=info,
                             core_address=address, core_pid=i.pid)
        try:
            if opts.api_server_count == 1:
                status = run_api_server(spec, sock, 0)
            else:
                status = _supervise(spec, sock, core)
        finally:
            core.terminate()
            sock.close()
    if status:
        raise VtoolError("the server stopped because a process it runs on exited (see the log above)")


def _serve_in_process(artifact: Path, checkpoint: Checkpoint, config: EngineConfig, opts: ServeOptions,
                      console: Console, sock: socket.socket, names: list[str], defaults: dict[str, Any]) -> None:
    session = open_session(artifact, checkpoint, opts.tokenizer_config, opts.max_model_len)
    engine = Engine(session, config)
    engine.prepare_grammar()
    metrics = None if opts.disable_metrics else ServerMetrics(names[0], max_model_len=engine.max_model_len)
    if metrics is not None:
        metrics.set_cache_config(block_size=engine.kv.block_size, num_blocks=engine.kv.blocks.num_blocks,
                                 enable_prefix_caching=config.enable_prefix_caching)
    client = AsyncEngine(engine, metrics)
    manifest = session.model.manifest
    info = ServerInfo(model_path=str(checkpoint.path), artifact=str(artifact), target=manifest["target"]["name"],
                      dtype=manifest["dtype"], engine={**dataclasses.asdict(config),
                                                       "num_blocks": engine.kv.blocks.num_blocks,
                                                       "max_model_len": engine.max_model_len},
                      served_model_names=names)
    spec = ApiServerSpec(model_path=str(checkpoint.path), opts=opts, served_names=names,
                         max_model_len=engine.max_model_len, sampling_defaults=defaults, info=info,
                         core_address="", core_pid=os.getpid())
    console.print(f"[dim]engine (in process) on {session.model.device_type}:{session.model.device_index}: "
                  f"{engine.kv.blocks.num_blocks} KV blocks of {engine.kv.block_size} tokens, max_model_len "
                  f"{engine.max_model_len}[/]", highlight=False)
    console.print(f"serving {checkpoint.path.name} on http://{opts.host}:{opts.port}/v1", highlight=False)
    try:
        _run_uvicorn(_uvicorn(create_app(_state(spec, client, session.tokenizer), info, opts.api_key),
                              opts.uvicorn_log_level), sock)
    finally:
        sock.close()
