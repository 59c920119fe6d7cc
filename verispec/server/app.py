"""The OpenAI-compatible HTTP API: parse, hand to the engine, stream back. Nothing else.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming or not),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). The security model: JSON
endpoints take only ``Content-Type: application/json`` bodies (415 otherwise: no cross-origin
form or ``text/plain`` POST from a web page); the ``Host`` header is checked against DNS
rebinding (:mod:`verispec.server.hosts`); with an API key, ``/v1/*`` and ``/metrics`` need it
(``public_metrics`` opens ``/metrics``), ``/health`` stays open and ``/docs``, ``/redoc`` and
``/openapi.json`` are off. Request fields are described in
:mod:`verispec.server.schemas`, answers in :mod:`verispec.server.responses`, errors in
:mod:`verispec.server.errors`, metrics in :mod:`verispec.server.metrics`; the engine runs in the
background thread of :mod:`verispec.server.runner`.

:func:`create_app` takes an already-built :class:`~verispec.engine.Engine` (or the
:class:`~verispec.pipeline.Pipeline` that holds one), so that tests and embedders choose the
models; ``verispec serve`` builds the pipeline from the command line and runs the app in uvicorn.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from verispec.config import SamplingParams
from verispec.engine.engine import Engine
from verispec.engine.request import RequestOutput
from verispec.errors import VerispecError
from verispec.pipeline import Pipeline
from verispec.server import responses
from verispec.server.config import DEFAULT_BYTES_PER_TOKEN, ServerConfig
from verispec.server.errors import APIError, error_body, install_error_handlers, validation_error
from verispec.server.hosts import HostCheck
from verispec.server.metrics import CONTENT_TYPE, MetricsRecorder, ServerMetrics
from verispec.server.runner import EngineRunner, QueueFullError, RequestHandle, ShuttingDownError
from verispec.server.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

Model = TypeVar("Model", bound=BaseModel)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SEED_WARNING = (
    "seed: this server chooses the draft length per step (--k auto), so a seed fixes the output's "
    "distribution but not its exact text; serve with a fixed --k for reproducible seeded samples"
)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json"


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refusing a body not declared ``application/json`` (415: a web page can
    send a cross-origin ``text/plain`` POST without asking, but not a JSON one), bodies over
    ``limit`` bytes (413) and malformed JSON (400)."""
    if not _is_json(request.headers.get("content-type", "")):
        raise APIError(
            415, "send the request body as JSON with the header 'Content-Type: application/json'",
            code="unsupported_media_type",
        )  # fmt: skip
    too_large = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the request body") from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"the request body is not valid JSON ({str(exc)[:200]}); send a JSON object") from None


def parse(model: type[Model], data: Any) -> Model:
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(list(exc.errors(include_url=False))) from None


class EngineStreamResponse(StreamingResponse):
    """A streamed answer that aborts its request however the stream ends (client gone, error)."""

    def __init__(self, content: AsyncIterator[bytes], handle: RequestHandle) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.abort()  # a no-op once the request has finished


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def final_or_disconnect(handle: RequestHandle, request: Request) -> RequestOutput | None:
    """The request's final output, or None (and the request aborted) if the client left first."""
    result = asyncio.ensure_future(handle.result())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait((result, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()
            handle.abort()
    return result.result() if result in done else None


def _failure(out: RequestOutput, retry_after: int) -> APIError | None:
    if out.finish_reason == "abort":
        retry = {"Retry-After": str(retry_after)}
        return APIError(503, out.error or "the request was aborted", code="shutting_down", headers=retry)
    if out.finish_reason == "error":
        return APIError(500, f"generation failed: {out.error}", code="engine_error")
    return None


class Server:
    """The endpoints of one app, around one engine runner."""

    def __init__(self, engine: Engine, config: ServerConfig, names: tuple[str, ...], metrics: ServerMetrics) -> None:
        self.engine = engine
        self.config = config
        self.names = names
        self.metrics = metrics
        self.runner = EngineRunner(engine, max_queue=config.max_queue, recorder=MetricsRecorder(metrics))
        max_len = engine.config.max_len
        self.max_prompt_tokens = min(config.max_prompt_tokens or max_len - 1, max_len - 1)
        self.max_tokens_limit = min(config.max_tokens_limit or max_len - 1, max_len - 1)
        self.max_prompt_bytes = config.max_prompt_bytes or DEFAULT_BYTES_PER_TOKEN * self.max_prompt_tokens
        # With K chosen per step, a seed fixes the law but not the text (a different K spends the
        # randomness differently): say so in every seeded answer.
        self.seed_warning = engine.drafter.proposes and engine.config.num_draft_tokens is None
        self.created = int(time.time())

    # ----------------------------------------------------------------------- endpoints
    async def completions(self, request: Request) -> Response:
        req = parse(CompletionRequest, await read_json(request, self.config.max_body_bytes))
        model = self._model(req.model)
        params = req.sampling_params(1)  # every parameter checked before any work on the prompt
        prompt = req.prompt
        if isinstance(prompt, str):
            tokenizer = self.engine.tokenizer
            if tokenizer is None:
                raise APIError(400, "this server has no tokenizer: send the prompt as token ids", param="prompt")
            self._check_prompt_bytes(len(prompt.encode()), "prompt")
            ids = await asyncio.to_thread(tokenizer.encode, prompt, True)  # releases the GIL
        else:
            ids = list(prompt)
        return await self._generate("completion", request, req, params, ids, model, "prompt")

    async def chat_completions(self, request: Request) -> Response:
        data = await read_json(request, self.config.max_body_bytes)
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            count = len(data["messages"])
            if count > self.config.max_messages:
                raise APIError(
                    400, f"the chat has {count} messages; this server accepts at most {self.config.max_messages}",
                    param="messages", code="context_length_exceeded",
                )  # fmt: skip
        req = parse(ChatCompletionRequest, data)
        model = self._model(req.model)
        params = req.sampling_params(1)
        messages = [m.as_template_input() for m in req.messages]
        self._check_prompt_bytes(sum(len(str(m["content"]).encode()) for m in messages), "messages")
        ids = await asyncio.to_thread(self._chat_ids, messages)
        return await self._generate("chat", request, req, params, ids, model, "messages")

    async def models(self) -> dict[str, Any]:
        max_len = self.engine.config.max_len
        data = [
            {"id": name, "object": "model", "created": self.created, "owned_by": "verispec", "root": self.names[0],
             "max_model_len": max_len}
            for name in self.names
        ]  # fmt: skip
        return {"object": "list", "data": data}

    async def health(self) -> JSONResponse:
        if self.runner.accepting:
            return JSONResponse({"status": "ok", "running": self.runner.num_live})
        return JSONResponse({"status": "unavailable"}, 503)

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------------- helpers
    def _model(self, asked: str | None) -> str:
        if asked is None:
            return self.names[0]
        if asked not in self.names:
            served = ", ".join(repr(n) for n in self.names)
            raise APIError(
                404, f"the model {asked[:200]!r} does not exist on this server; it serves {served} (see /v1/models)",
                param="model", code="model_not_found",
            )  # fmt: skip
        return asked

    def _check_prompt_bytes(self, size: int, param: str) -> None:
        """Refuse prompt text that cannot fit before tokenizing it (tokenizing megabytes costs
        seconds and memory that outlives the request)."""
        if size > self.max_prompt_bytes:
            raise APIError(
                400, f"the prompt text has {size} bytes; this server accepts at most {self.max_prompt_bytes} "
                f"(about {self.max_prompt_tokens} tokens); shorten it", param=param, code="context_length_exceeded",
            )  # fmt: skip

    def _chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise APIError(
                400, "the served model has no chat template; use /v1/completions with a prompt you format yourself",
                param="messages",
            )  # fmt: skip
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except VerispecError as exc:
            raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages") from None
        self._check_prompt_bytes(len(text.encode()), "messages")
        return tokenizer.encode(text, add_special_tokens=False)

    def _params_for(
        self, req: CompletionRequest | ChatCompletionRequest, params: SamplingParams, num_prompt: int, param: str
    ) -> SamplingParams:
        """``params`` with the request's max_tokens, after the prompt and max_tokens limits (400s
        naming the field)."""
        max_len = self.engine.config.max_len
        context = APIError(
            400, f"the prompt has {num_prompt} tokens; this server accepts at most {self.max_prompt_tokens} "
            f"(context {max_len} tokens); shorten it", param=param, code="context_length_exceeded",
        )  # fmt: skip
        if num_prompt == 0:
            raise APIError(400, "the prompt is empty; give at least one token of text", param=param)
        if num_prompt > self.max_prompt_tokens:
            raise context
        room = max_len - num_prompt
        asked = req.requested_max_tokens
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if asked is None:
            default = COMPLETION_DEFAULT_MAX_TOKENS if isinstance(req, CompletionRequest) else self.max_tokens_limit
            max_tokens = min(default, self.max_tokens_limit, room)
        elif asked > self.max_tokens_limit:
            raise APIError(400, f"{name} is {asked}; this server allows at most {self.max_tokens_limit}", param=name)
        elif asked > room:
            raise APIError(
                400, f"this model's context is {max_len} tokens; the prompt has {num_prompt} and {name} asks for "
                f"{asked} more; lower {name} to at most {room} or shorten the prompt",
                param=name, code="context_length_exceeded",
            )  # fmt: skip
        else:
            max_tokens = asked
        return replace(params, max_tokens=max_tokens)

    async def _generate(
        self,
        kind: responses.Kind,
        request: Request,
        req: CompletionRequest | ChatCompletionRequest,
        params: SamplingParams,
        ids: list[int],
        model: str,
        param: str,
    ) -> Response:
        params = self._params_for(req, params, len(ids), param)
        warnings = (SEED_WARNING,) if self.seed_warning and params.seed is not None and not params.greedy else ()
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        retry = {"Retry-After": str(self.config.retry_after_seconds)}
        try:
            handle = await self.runner.submit(request_id, ids, params)
        except QueueFullError as exc:
            self.metrics.reject("queue_full")
            raise APIError(429, str(exc), code="queue_full", headers=retry) from None
        except ShuttingDownError as exc:
            self.metrics.reject("shutting_down")
            raise APIError(503, str(exc), code="shutting_down", headers=retry) from None
        created = int(time.time())
        if req.stream:
            writer = responses.ChunkWriter(kind, request_id, created, model, req.include_usage, warnings)
            return EngineStreamResponse(self._events(writer, handle), handle)
        final = await final_or_disconnect(handle, request)
        if final is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        failure = _failure(final, self.config.retry_after_seconds)
        if failure is not None:
            raise failure
        return JSONResponse(responses.response(kind, request_id, created, model, final, warnings))

    async def _events(self, writer: responses.ChunkWriter, handle: RequestHandle) -> AsyncIterator[bytes]:
        try:
            first = writer.start()
            if first is not None:
                yield first
            async for out in handle.outputs():
                failure = _failure(out, self.config.retry_after_seconds)
                if failure is not None:
                    yield responses.event(error_body(failure.status, failure.message, code=failure.code))
                    break
                for chunk in writer.delta(out):
                    yield chunk
            yield responses.DONE
        finally:
            handle.abort()


def _auth(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    expected = api_key.encode() if api_key is not None else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(
                401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    return check


def create_app(
    source: Engine | Pipeline,
    config: ServerConfig | None = None,
    *,
    metrics: ServerMetrics | None = None,
) -> FastAPI:
    """The ASGI app serving ``source`` (an :class:`Engine`, or a :class:`Pipeline` with model
    names). Its lifespan starts the engine thread and, at shutdown, drains and joins it; run it
    in any ASGI server that runs lifespans (uvicorn does). ``metrics``: where to record (default:
    a new :class:`ServerMetrics` in its own registry). ``app.state.server.runner`` is the engine
    runner (e.g. to call ``begin_shutdown`` when a signal arrives)."""
    config = config or ServerConfig()
    engine = source.engine if isinstance(source, Pipeline) else source
    target = source.target.name if isinstance(source, Pipeline) else engine.target.config.name or "verispec"
    draft = source.draft.name if isinstance(source, Pipeline) and source.draft is not None else ""
    names = config.served_model_names or (target,)
    if metrics is None:
        drafter = engine.drafter.name
        k = engine.config.num_draft_tokens
        positions = 0 if not engine.drafter.proposes else (engine.config.max_draft_tokens if k is None else k)
        metrics = ServerMetrics(
            names[0], target=target, draft=draft, drafter=drafter, lossless=engine.lossless, num_positions=positions
        )
    server = Server(engine, config, names, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.runner.start()
        try:
            yield
        finally:
            await server.runner.shutdown(config.shutdown_grace_seconds)

    closed = config.api_key is not None  # with a key, the API's description is not public either
    app = FastAPI(
        title="verispec", summary="OpenAI-compatible speculative decoding server", lifespan=lifespan,
        docs_url=None if closed else "/docs", redoc_url=None if closed else "/redoc",
        openapi_url=None if closed else "/openapi.json",
    )  # fmt: skip
    app.state.server = server
    app.add_middleware(HostCheck, allowed_hosts=config.allowed_hosts)
    install_error_handlers(app)
    auth = [Depends(_auth(config.api_key))]
    app.add_api_route("/v1/completions", server.completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/models", server.models, methods=["GET"], dependencies=auth)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route(
        "/metrics", server.prometheus, methods=["GET"], dependencies=[] if config.public_metrics else auth
    )
    return app
