"""The OpenAI-compatible HTTP server (FastAPI): routes, authentication, small endpoints.

The model work happens in the engine core (its own process, serving/engine_core.py, or an
in-process thread, AsyncEngine); handlers here only parse, validate, tokenize and format.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hmac
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import vtool
from vtool import VtoolError
from vtool.runtime.sampling.params import check_token_ids
from vtool.runtime.serving.errors import BadRequestError, error_json, install_error_handlers
from vtool.runtime.serving.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
    TokenizeRequest, TokenizeResponse)
from vtool.runtime.serving.completions import ServingState, create_chat_completion, create_completion
from vtool.runtime.serving.embeddings import EmbeddingRequest, create_embedding, not_supported


@dataclasses.dataclass
class ServerInfo:
    """What GET /server_info reports: how this server was configured."""

    model_path: str
    artifact: str
    target: str
    dtype: str
    engine: dict[str, Any]
    served_model_names: list[str]


def create_app(state: ServingState, info: ServerInfo, api_key: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.engine.start()  # connect to the engine core inside the server's event loop
        try:
            yield
        finally:
            state.engine.shutdown()

    app = FastAPI(title="vtool", version=vtool.__version__, lifespan=lifespan)
    install_error_handlers(app)

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def require_key(request: Request, call_next: Any) -> Response:
            # As vLLM: the OpenAI routes need the key; health and metrics stay open.
            if request.url.path.startswith("/v1") and request.method != "OPTIONS":
                given = request.headers.get("Authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return JSONResponse(error_json(401, "Unauthorized: a valid Bearer API key is required"),
                                        status_code=401)
            return await call_next(request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        if state.task != "generate":
            raise not_supported("Completions", state)
        return await create_completion(body, raw, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        if state.task != "generate":
            raise not_supported("Chat Completions", state)
        return await create_chat_completion(body, raw, state)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict:
        if state.task != "embed":  # serving/embeddings.py
            raise not_supported("Embeddings", state)
        return await create_embedding(body, state)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [ModelCard(id=name, root=info.model_path, max_model_len=state.max_model_len)
                 for name in state.served_names]
        return ModelList(data=cards).model_dump()

    @app.get("/health")
    async def health() -> Response:
        await state.engine.health()  # answers only while the engine core does
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict:
        return {"version": vtool.__version__}

    @app.get("/server_info")
    async def server_info() -> dict:
        return dataclasses.asdict(info)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        await state.engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        if not state.metrics_enabled:
            return JSONResponse(error_json(404, "metrics are disabled (--disable-metrics)"), status_code=404)
        # Rendered by the engine core, the one place every API server's requests pass.
        return Response(await state.engine.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        state.check_model(body.model)
        tok = state.tokenizer
        if body.messages is not None:
            kwargs = {**state.default_chat_template_kwargs, **dict(body.chat_template_kwargs or {})}
            if body.tools:
                kwargs["tools"] = body.tools
            text = tok.apply_chat_template(body.template_messages(), add_generation_prompt=body.add_generation_prompt,
                                           **kwargs)
        else:
            text = body.prompt or ""
        ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
        strs = [tok.id_to_token(t) or "" for t in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids,
                                token_strs=strs).model_dump(exclude_none=True)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.check_model(body.model)
        try:
            check_token_ids(body.tokens, state.tokenizer.vocab_size)
        except VtoolError as err:
            raise BadRequestError(str(err), param="tokens") from None
        return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens)).model_dump()

    return app
