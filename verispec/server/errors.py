"""OpenAI-style error answers: every failure is ``{"error": {"message", "type", "param", "code"}}``.

Bad input is always a 4xx whose message says what to change; only a fault of the server itself is
a 5xx, and its body never carries a traceback. Status codes:

- 400 ``invalid_request_error``: malformed JSON, a field of the wrong type or out of range, invalid
  sampling parameters (the :class:`~verispec.errors.ConfigError` / :class:`~verispec.errors.InputError`
  message), a prompt longer than the context (code ``context_length_exceeded``); FastAPI's own
  validation errors (422) are turned into this shape and status too;
- 401 ``authentication_error`` (code ``invalid_api_key``): missing or wrong ``Authorization: Bearer``;
- 404 (code ``model_not_found``, or ``not_found`` for an unknown path); 405 for a wrong method;
- 413 (code ``request_too_large``): a request body over the server's byte limit;
- 415 (code ``unsupported_media_type``): a JSON endpoint's body not sent as ``application/json``;
- 400 (code ``invalid_host``): a ``Host`` header the server does not answer to (DNS rebinding);
- 429 ``rate_limit_error`` (code ``queue_full``), with ``Retry-After``: the bounded queue is full;
- 503 ``service_unavailable`` (code ``shutting_down``), with ``Retry-After``: the server is draining;
- 500 ``server_error``: a bug or an engine failure; the message is the engine's, never a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.errors import VerispecError

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An answer with an OpenAI-style error body. Raise it anywhere in a request's handling."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object; streaming sends it as one ``data:`` event."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), err.status, headers=err.headers)


def location(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a JSON path: ``("messages", 0, "content")`` -> ``messages[0].content``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "body":  # FastAPI prefixes body fields with "body"
            path += f".{part}" if path else str(part)
    return path


def validation_error(errors: list[Any]) -> APIError:
    """A 400 naming the first invalid field in plain words (no pydantic internals, no input echo)."""
    first = errors[0]
    param = location(tuple(first.get("loc", ()))) or None
    kind = first.get("type", "")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "extra_forbidden":
        message = f"unrecognized request argument {param!r}; remove it (see the server's documentation for fields)"
    elif kind == "missing":
        message = f"missing required field {param!r}"
    elif param:
        message = f"invalid value for {param!r}: {msg}"
    else:
        message = msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app can produce an OpenAI-style body with the right status."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_verispec_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(400, str(exc), param=getattr(exc, "param", None)))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError | ValidationError)
        return error_response(validation_error(list(exc.errors())))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(exc.status_code, message, code=code, headers=exc.headers))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while serving %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal server error; the server log has the details"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(VerispecError, on_verispec_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(ValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
