"""The OpenAI-compatible HTTP app of one engine: /v1/models, /v1/completions,
/v1/chat/completions (whole or streamed), /health and /metrics.

Every error is OpenAI's ``{"error": {"message", "type", "param", "code"}}``; an unexpected one
is a 500 with no traceback (logged on the server). A request that fails while it runs gets its
own error (400 when its input caused it, else 500); the others in its batch go on. A client that
disconnects aborts its request. Request bodies must be ``application/json``: a form or text
body, which a browser may send cross-site without asking, never reaches the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from tqexport.errors import TQExportError
from tqexport.runtime.engine import Engine
from tqexport.serve import openapi
from tqexport.serve.loop import EngineFailed, EngineLoop
from tqexport.serve.metrics import Metrics
from tqexport.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    parse,
)
from tqexport.serve.responses import Response as Reply
from tqexport.serve.responses import sse

log = logging.getLogger("tqexport.serve")

#: the largest request body read (413 past it)
MAX_BODY_BYTES = 8 * 2**20
#: the response header naming the replica that served a request (when there are several)
REPLICA_HEADER = "x-tqexport-replica"
_GONE = object()  # the client disconnected


def _chars(prompt) -> int:
    """How much text preparing ``prompt`` reads: its characters (a chat's: every message's)."""
    if isinstance(prompt, str):
        return len(prompt)
    if prompt and isinstance(prompt[0], dict):
        return sum(len(m["content"]) + len(str(m["role"])) for m in prompt)
    return len(prompt)  # token ids


def create_app(
    engine: Engine,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    replica: str | None = None,
    metrics_public: bool = False,
) -> FastAPI:
    """The app serving ``engine`` as model ``served_model_name``; with ``api_key`` every route
    but /health (and /metrics when ``metrics_public``) needs ``Authorization: Bearer
    <api_key>``. The engine loop runs while the app does. ``replica`` (one of several behind a
    proxy) is sent on every response as REPLICA_HEADER."""
    loop = EngineLoop(engine)
    metrics = Metrics(engine)
    started = int(time.time())
    public = frozenset({"/health", *(["/metrics"] if metrics_public else [])})

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="tqexport serve", lifespan=lifespan)
    app.state.engine_loop = loop
    app.state.metrics = metrics

    def describe() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi.describe(
                app, served_model_name, public, bearer=api_key is not None
            )
        return app.openapi_schema

    app.openapi = describe
    if api_key is not None:
        app.add_middleware(_RequireKey, key=api_key, public=public)
    if replica is not None:  # added last: outermost, so a 401 is named too
        app.add_middleware(_NameReplica, replica=replica)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        body = error_body(str(e.detail), kind)
        return JSONResponse(body, status_code=e.status_code, headers=e.headers)  # 405: Allow

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unexpected error serving %s", request.url.path)
        return JSONResponse(error_body("internal server error", "server_error"), 500)

    async def read_json(request: Request):
        ctype = request.headers.get("content-type")
        if ctype is None or ctype.partition(";")[0].strip().lower() != "application/json":
            raise APIError(
                415,
                "the request body must be JSON sent with 'Content-Type: application/json', got "
                + (repr(ctype) if ctype is not None else "no Content-Type"),
                code="unsupported_media_type",
            )
        too_big = APIError(
            413, f"the request body is over {max_body_bytes} bytes", code="request_too_large"
        )
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_body_bytes:
            raise too_big
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise too_big
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None

    async def admit(req, prompt, chat: bool):
        """Validate, tokenize on a worker thread (a prompt too long to fit is refused before),
        then admit on the engine thread; returns (request id, prompt ids, queue)."""
        if req.model != served_model_name:
            raise APIError(
                404,
                f"the model {req.model!r} does not exist; this server serves {served_model_name!r}",
                param="model",
                code="model_not_found",
            )
        stop = req.stop_strings()
        requested = req.max_new_tokens()
        params = req.sampling(requested or 1)
        try:
            ids = await loop.prepare(
                lambda: engine.prompt_ids(prompt, chat_template=None if chat else False),
                _chars(prompt),
            )
        except TQExportError as e:
            raise APIError(400, str(e)) from None

        def build(engine: Engine):
            n = requested if requested is not None else engine.max_new_tokens(len(ids))
            if n is None:
                raise TQExportError("max_tokens is required: this model has no context limit")
            if n < 1:
                raise TQExportError(
                    f"a prompt of {len(ids)} tokens leaves no room to generate (the limit is "
                    f"{engine.max_seq_len} tokens)"
                )
            rid = engine.add_request(
                ids, replace(params, max_tokens=n), stop=stop, ignore_eos=req.ignore_eos
            )
            return rid, ids

        try:
            return await loop.submit(build)
        except TQExportError as e:
            raise APIError(400, str(e)) from None

    async def generate(request: Request, req, prompt, chat: bool, arrival: float):
        rid, prompt_ids, outputs = await admit(req, prompt, chat)
        reply = Reply(chat, served_model_name, prompt_ids, req.return_token_ids)
        timing = _Timing(metrics, arrival)
        if req.stream:
            return StreamingResponse(
                _stream(loop, rid, outputs, reply, timing, req.include_usage),
                media_type="text/event-stream",
            )
        return await _whole(request, loop, rid, outputs, reply, timing)

    @app.get("/health", response_class=Response, responses={200: {"description": "Up."}})
    async def health():
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_text():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", responses={200: {"model": openapi.ModelList}})
    async def models():
        card = {
            "id": served_model_name,
            "object": "model",
            "created": started,
            "owned_by": "tqexport",
            "root": str(engine.artifact.path),
            "max_model_len": engine.max_seq_len,
        }
        return {"object": "list", "data": [card]}

    async def endpoint(request: Request, chat: bool):
        arrival = time.monotonic()
        req = parse(ChatCompletionRequest if chat else CompletionRequest, await read_json(request))
        prompt = req.message_list() if chat else req.prompt_value()
        return await generate(request, req, prompt, chat, arrival)

    posted = openapi.errors(400, 404, 413, 415, 500, 503)

    @app.post(
        "/v1/completions",
        responses={**openapi.generated(openapi.Completion, openapi.CompletionChunk), **posted},
        openapi_extra=openapi.body(CompletionRequest),
    )
    async def completions(request: Request):
        return await endpoint(request, chat=False)

    @app.post(
        "/v1/chat/completions",
        responses={
            **openapi.generated(openapi.ChatCompletion, openapi.ChatCompletionChunk),
            **posted,
        },
        openapi_extra=openapi.body(ChatCompletionRequest),
    )
    async def chat_completions(request: Request):
        return await endpoint(request, chat=True)

    return app


class _RequireKey:
    """ASGI middleware: an HTTP request to any path but the ``public`` ones needs
    ``Authorization: Bearer <key>``, else a 401 with OpenAI's error body (pure ASGI: the
    body of a refused request is never read)."""

    def __init__(self, app, key: str, public: frozenset[str]):
        self.app, self.key, self.public = app, key.encode(), public

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.public or self._authorized(scope):
            return await self.app(scope, receive, send)
        e = APIError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
        refused = JSONResponse(e.body(), e.status, headers={"WWW-Authenticate": "Bearer"})
        await refused(scope, receive, send)

    def _authorized(self, scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key)


class _NameReplica:
    """ASGI middleware adding REPLICA_HEADER to every response (pure ASGI: streaming and
    disconnects pass through untouched)."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


class _Timing:
    """One request's latency metrics: time to first token, end to end, finish reason."""

    def __init__(self, metrics: Metrics, arrival: float):
        self.metrics, self.arrival, self.first = metrics, arrival, False

    def tokens(self, n: int) -> None:
        if n and not self.first:
            self.first = True
            self.metrics.ttft.observe(time.monotonic() - self.arrival)

    def finished(self, reason: str) -> None:
        if reason in ("stop", "length"):
            self.metrics.latency.observe(time.monotonic() - self.arrival)
        self.metrics.finished.labels(reason).inc()


def _failed(error: BaseException | None) -> APIError:
    """The error of a request that failed while running: 400 when its input caused it
    (TQExportError), else 500 without the details (the engine loop logged them)."""
    if isinstance(error, TQExportError):
        return APIError(400, str(error))
    return APIError(500, "internal server error while generating this request", type="server_error")


async def _watch_disconnect(request: Request, outputs: asyncio.Queue) -> None:
    """Put _GONE on the queue when the client disconnects (the body is read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            outputs.put_nowait(_GONE)
            return


async def _whole(request, loop: EngineLoop, rid, outputs, reply: Reply, timing: _Timing):
    watcher = asyncio.create_task(_watch_disconnect(request, outputs))
    tokens, text, finished = [], [], False
    try:
        while True:
            item = await outputs.get()
            if item is _GONE:
                return Response(status_code=499)  # nobody reads it; nginx's "client closed"
            if isinstance(item, EngineFailed):
                raise APIError(503, str(item), type="server_error")
            if item.finish_reason == "error":
                finished = True
                timing.finished("error")
                raise _failed(item.error)
            timing.tokens(len(item.new_token_ids))
            tokens += item.new_token_ids
            text.append(item.text)
            if item.finished:
                finished = True
                timing.finished(item.finish_reason)
                return reply.whole("".join(text), tokens, item.finish_reason)
    finally:
        watcher.cancel()
        if not finished:
            loop.abort(rid)
            timing.finished("abort")


async def _stream(loop: EngineLoop, rid, outputs, reply: Reply, timing: _Timing, usage: bool):
    """SSE chunks of one request, ending with ``data: [DONE]``; a disconnect (the response
    task is cancelled) aborts the request."""
    finished, count = False, 0
    try:
        if reply.chat:
            yield sse(reply.chunk("", [], None, first=True))
        first = not reply.chat
        while True:
            item = await outputs.get()
            if isinstance(item, EngineFailed):
                yield sse(error_body(str(item), "server_error"))
                break
            if item.finish_reason == "error":
                finished = True
                timing.finished("error")
                yield sse(_failed(item.error).body())
                break
            timing.tokens(len(item.new_token_ids))
            count += len(item.new_token_ids)
            if item.text or item.finished or reply.return_token_ids:
                yield sse(reply.chunk(item.text, item.new_token_ids, item.finish_reason, first))
                first = False
            if item.finished:
                finished = True
                timing.finished(item.finish_reason)
                break
        if usage:
            yield sse(reply.usage_chunk(count))
        yield sse("[DONE]")
    finally:
        if not finished:
            loop.abort(rid)
            timing.finished("abort")
