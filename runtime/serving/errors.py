"""OpenAI-shaped errors for the HTTP server.

Every error leaves the server as {"error": {"message", "type", "param", "code"}} with `code` the
HTTP status, as vLLM answers. Bad input is always a 400 (never FastAPI's 422, never a 500): pydantic
validation errors, a body that is not JSON, an OpenAIError, a VtoolError or a ValueError raised by
a route. Anything else is a 500 whose message names the exception; it is logged with its traceback.
"""
from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, Iterable, Optional

from vtool import VtoolError

logger = logging.getLogger("vtool.server")

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_type(status: int) -> str:
    """The OpenAI/vLLM error type for an HTTP status ("BadRequestError" for 400)."""
    if status in _TYPES:
        return _TYPES[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        return "Error"


class OpenAIError(Exception):
    """An error the server answers with an OpenAI error body; subclasses fix the status."""

    status: int = 400

    def __init__(self, message: str, *, status: Optional[int] = None, type: Optional[str] = None,
                 param: Optional[str] = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.type = type or error_type(self.status)
        self.param = param

    def to_json(self) -> dict[str, Any]:
        return error_json(self.status, self.message, self.type, self.param)


class BadRequestError(OpenAIError):
    status = 400


class AuthenticationError(OpenAIError):
    status = 401


class NotFoundError(OpenAIError):
    status = 404


class InternalServerError(OpenAIError):
    status = 500


class ServiceUnavailableError(OpenAIError):
    status = 503


def error_json(status: int, message: str, type: Optional[str] = None, param: Optional[str] = None) -> dict:
    """{"error": {"message", "type", "param", "code"}}: the body of every error response."""
    return {"error": {"message": message, "type": type or error_type(status), "param": param,
                      "code": int(status)}}


def error_response(status: int, message: str, type: Optional[str] = None, param: Optional[str] = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(error_json(status, message, type, param), status_code=status)


# ------------------------------------------------------------------ validation error messages


def _loc_path(loc: Iterable[Any]) -> str:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(error: dict) -> tuple[str, Optional[str]]:
    """One pydantic/FastAPI error -> ("field: what is wrong", field)."""
    kind = error.get("type", "")
    loc = tuple(error.get("loc", ()))
    msg = str(error.get("msg", ""))
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    if kind == "json_invalid":
        detail = (error.get("ctx") or {}).get("error")
        where = next((p for p in loc[1:] if isinstance(p, int)), None)
        text = "Request body is not valid JSON"
        if detail:
            text += f": {detail}"
        if where is not None:
            text += f" (at character {where})"
        return text, None
    path = _loc_path(loc)
    if not path:
        if kind == "missing":
            return "Request body is required: send a JSON object", None
        if kind in ("model_attributes_type", "dict_type", "model_type"):
            return f"Request body must be a JSON object, got {_short(error.get('input'))}", None
        # model-level checks write "field: what is wrong" themselves
        head = msg.split(":", 1)[0]
        return msg, (head if head and " " not in head else None)
    if kind == "extra_forbidden":
        return f"{path}: unknown field (not a parameter this server accepts)", path
    if kind == "missing":
        return f"{path}: field required", path
    text = f"{path}: {msg}"
    if kind != "value_error" and "input" in error and not isinstance(error["input"], (dict, list)):
        text += f" (got {_short(error['input'])})"
    if kind in _RANGE_ERRORS and isinstance(loc[-1], str):
        from vtool.runtime.serving.protocol import FIELD_RANGES

        if loc[-1] in FIELD_RANGES:
            text += f"; allowed range is {FIELD_RANGES[loc[-1]]}"
    return text, path


_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def validation_message(errors: Iterable[dict]) -> tuple[str, Optional[str]]:
    """All validation errors as one message ("; "-joined) and the first offending field."""
    described = [_describe(e) for e in errors]
    if not described:
        return "Invalid request", None
    seen, lines = set(), []
    for text, _ in described:
        if text not in seen:
            seen.add(text)
            lines.append(text)
    return "; ".join(lines), next((p for _, p in described if p), None)


# -------------------------------------------------------------------------------- handlers


def install_error_handlers(app) -> None:
    """Register handlers so every error `app` answers is an OpenAI error body (400 for bad input)."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    async def on_request_validation(request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return error_response(400, message, param=param)

    async def on_pydantic_validation(request, exc: ValidationError):
        message, param = validation_message(exc.errors(include_url=False))
        return error_response(400, message, param=param)

    async def on_openai_error(request, exc: OpenAIError):
        if exc.status >= 500:
            logger.error("%s %s: %s", request.method, request.url.path, exc.message)
        return error_response(exc.status, exc.message, exc.type, exc.param)

    async def on_bad_input(request, exc: Exception):
        param = getattr(exc, "field", None)
        return error_response(400, str(exc) or type(exc).__name__, param=param if isinstance(param, str) else None)

    async def on_http_exception(request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        response = error_response(exc.status_code, detail)
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    async def on_unexpected(request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, f"Internal server error: {type(exc).__name__}: {exc}")

    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(ValidationError, on_pydantic_validation)
    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(VtoolError, on_bad_input)
    app.add_exception_handler(ValueError, on_bad_input)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(Exception, on_unexpected)


__all__ = [
    "OpenAIError", "BadRequestError", "AuthenticationError", "NotFoundError", "InternalServerError",
    "ServiceUnavailableError", "error_json", "error_response", "error_type", "validation_message",
    "install_error_handlers",
]
