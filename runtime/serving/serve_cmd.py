"""`vtool serve`: load a session, start the engine thread, serve HTTP with uvicorn."""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from rich.console import Console

from vtool import VtoolError
from vtool.runtime.serving.app import ServerInfo, create_app
from vtool.runtime.engine.async_engine import AsyncEngine
from vtool.runtime.weights.checkpoint import Checkpoint
from vtool.runtime.engine.engine import Engine, EngineConfig
from vtool.runtime.serving.metrics import ServerMetrics
from vtool.runtime.serving.completions import ServingState
from vtool.runtime.session import open_session

MAX_NEW_TOKENS_ENV = "VTOOL_SERVER_MAX_NEW_TOKENS"


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
    uvicorn_log_level: str = "info"


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


def build_server(artifact: Path, checkpoint: Checkpoint, engine_config: EngineConfig, opts: ServeOptions,
                 console: Console | None = None):
    """(FastAPI app, AsyncEngine) ready to serve; the caller runs uvicorn and shuts the engine down."""
    session = open_session(artifact, checkpoint, opts.tokenizer_config, opts.max_model_len)
    engine = Engine(session, dataclasses.replace(engine_config, max_new_tokens_ceiling=server_ceiling()))
    names = list(opts.served_model_name) or [str(checkpoint.path)]
    state = ServingState(
        engine=AsyncEngine(engine), tokenizer=session.tokenizer, served_names=names,
        max_model_len=engine.max_model_len, metrics=None if opts.disable_metrics else ServerMetrics(names[0]),
        sampling_defaults=sampling_defaults(checkpoint.generation_config()),
        enable_log_requests=opts.enable_log_requests, enable_log_outputs=opts.enable_log_outputs,
        max_log_len=opts.max_log_len, force_include_usage=opts.enable_force_include_usage)
    manifest = session.model.manifest
    info = ServerInfo(model_path=str(checkpoint.path), artifact=str(artifact), target=manifest["target"]["name"],
                      dtype=manifest["dtype"], engine={**dataclasses.asdict(engine.config),
                                                       "num_blocks": engine.kv.blocks.num_blocks,
                                                       "max_model_len": engine.max_model_len},
                      served_model_names=names)
    if console is not None:
        device = f"{session.model.device_type}:{session.model.device_index}"
        console.print(f"[dim]engine on {device}: {engine.kv.blocks.num_blocks} KV blocks of {engine.kv.block_size} tokens, "
                      f"max_model_len {engine.max_model_len}, max_num_seqs {engine_config.max_num_seqs}, "
                      f"prefix caching {'on' if engine_config.enable_prefix_caching else 'off'}[/]", highlight=False)
    return create_app(state, info, opts.api_key), state.engine


def serve(artifact: Path, checkpoint: Checkpoint, engine_config: EngineConfig, opts: ServeOptions,
          console: Console) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app, engine = build_server(artifact, checkpoint, engine_config, opts, console)
    console.print(f"serving {checkpoint.path.name} on http://{opts.host}:{opts.port}/v1", highlight=False)
    try:
        uvicorn.run(app, host=opts.host, port=opts.port, log_level=opts.uvicorn_log_level)
    finally:
        engine.shutdown()
