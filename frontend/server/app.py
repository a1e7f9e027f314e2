"""The Starlette app: OpenAI routes, health, metrics, version, the browser page; the engine lives
in its lifespan.

The engine is started by `start_engine(app)`, which the server awaits before uvicorn serves (a
start-up failure is then reported once, as the exception, before any socket is bound); when no
one did (tests), the lifespan starts it. Either way the lifespan stops it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib import metadata

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deepinfer.engine.protocol import SchedulerStats
from deepinfer.frontend.auth import UNAUTHORIZED, authorized
from deepinfer.frontend.server.anthropic.messages import (
    count_message_tokens,
    create_message,
    error_response,
)
from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.http_io import SSEResponse
from deepinfer.frontend.server.lora_routes import load_lora_adapter, unload_lora_adapter
from deepinfer.frontend.server.openai.chat import create_chat_completion
from deepinfer.frontend.server.openai.completions import create_completion
from deepinfer.frontend.server.openai.objects import ModelCard, ModelList
from deepinfer.frontend.server.openapi import openapi_document
from deepinfer.frontend.server.origin_checks import BrowserGuard, OriginPolicy
from deepinfer.frontend.server.responses.handlers import create_response, stored_response
from deepinfer.frontend.server.state import EngineClient, ServerState
from deepinfer.frontend.ui.routes import ui_routes

log = logging.getLogger("deepinfer.api")

Handler = Callable[[ServerState, Request], Awaitable[Response | SSEResponse]]


def version() -> str:
    try:
        return metadata.version("deepinfer")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def _route(state: ServerState, name: str, handler: Handler,
           error: Callable[[APIError], Response] | None = None, guarded: bool = False):
    """Wrap a handler: APIError -> OpenAI error body (or `error`'s shape), crash -> 500, count
    every status. `guarded`: the key is wanted outside /v1 too (frontend/auth.py)."""
    respond = error or APIError.response

    async def endpoint(request: Request) -> Response | SSEResponse:
        if state.api_key and not authorized(state.api_key, request.url.path,
                                            request.headers.get("authorization"),
                                            request.headers.get("x-api-key"), guarded):
            state.metrics.requests.labels(name, "401").inc()
            if error is not None:
                return error(APIError("unauthorized", 401, code="invalid_api_key"))
            return JSONResponse(UNAUTHORIZED, status_code=401)
        try:
            response = await handler(state, request)
        except APIError as exc:
            response = respond(exc)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            response = Response(status_code=499)
        except Exception:
            log.exception("unhandled error in %s", name)
            response = respond(APIError("internal server error", 500, type="server_error"))
        state.metrics.requests.labels(name, str(response.status_code)).inc()
        return response

    return endpoint


async def _models(state: ServerState, request: Request) -> Response:
    cards = [ModelCard(state.model_name, state.created, max_model_len=state.context_len,
                       root=state.model_name)]
    # An adapter's root is its name, not its directory: no server paths to clients.
    cards += [ModelCard(name, state.created, max_model_len=state.context_len, root=name,
                        parent=state.model_name) for name in state.lora_adapters]
    return Response(msgspec.json.encode(ModelList(cards)), media_type="application/json")


async def _health(state: ServerState, request: Request) -> Response:
    if state.draining:  # routers and balancers: send nothing more here
        return JSONResponse({"status": "draining"}, status_code=503)
    if state.healthy:
        return Response(status_code=200)
    reason = state.failure or ("starting" if state.client is None else "engine unavailable")
    return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)


async def _metrics(state: ServerState, request: Request) -> Response:
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)


async def _audit(state: ServerState, request: Request) -> Response:
    """The exactness audit (--audit-rate, engine/scheduler/audit.py): re-runs compared,
    divergences per shortcut and the latest ones, newest last."""
    s = state.client.stats if state.client is not None else SchedulerStats()
    return Response(msgspec.json.encode({
        "requests": s.audit_requests, "pending": s.audit_pending,
        "divergences": s.audit_divergences, "max_logprob_diff": s.audit_largest_logprob_diff,
        "latest": [msgspec.structs.asdict(d) for d in s.audit_latest]}),
        media_type="application/json")


async def _version(state: ServerState, request: Request) -> Response:
    return JSONResponse({"version": version()})


async def _openapi(state: ServerState, request: Request) -> Response:
    doc = openapi_document(version(), bool(state.api_key))
    return Response(msgspec.json.encode(doc), media_type="application/json")


def error_in_api_shape(path: str, error: APIError) -> Response:
    """`error` as the API at `path` shapes its errors (the routers answer alike)."""
    if path.startswith("/v1/messages"):  # Anthropic's clients read its shape
        return error_response(error)
    return error.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    # A 405 keeps Starlette's Allow header (RFC 9110 requires it).
    error = APIError(str(exc.detail), exc.status_code, type=kind,
                     headers=dict(exc.headers or {}))
    return error_in_api_shape(request.url.path, error)


def build_app(
    state: ServerState,
    client_factory: Callable[[], EngineClient],
    on_failure: Callable[[str], None] | None = None,
    origins: OriginPolicy | None = None,
) -> Starlette:
    """The app; the engine client is made and started at startup, shut down at shutdown.
    `origins`: the Host/Origin checks (origin_checks.py; the server always has them, tests
    that build the app alone may leave them out)."""

    def failed(reason: str) -> None:
        state.failure = reason
        log.error("engine failed: %s", reason)
        if on_failure is not None:
            on_failure(reason)

    started: list[EngineClient] = []  # the client of this lifespan, once started

    async def start() -> None:
        if started:
            return
        client = client_factory()
        try:
            await client.start(on_failure=failed)
        except BaseException:
            await client.shutdown()
            raise
        state.client = client
        started.append(client)
        for seconds in client.lora_load_seconds.values():  # the --lora-modules adapters
            state.metrics.lora_load_seconds.observe(seconds)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            await start()
            yield
        finally:
            if started:
                log.info("stopping the engine")
                await started.pop().shutdown()

    routes = [
        Route("/v1/chat/completions", _route(state, "chat", create_chat_completion),
              methods=["POST"]),
        Route("/v1/completions", _route(state, "completions", create_completion),
              methods=["POST"]),
        Route("/v1/messages", _route(state, "messages", create_message, error_response),
              methods=["POST"]),
        Route("/v1/messages/count_tokens",
              _route(state, "count_tokens", count_message_tokens, error_response),
              methods=["POST"]),
        Route("/v1/responses", _route(state, "responses", create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", _route(state, "responses", stored_response),
              methods=["GET", "DELETE"]),
        Route("/v1/models", _route(state, "models", _models), methods=["GET"]),
        Route("/v1/audit", _route(state, "audit", _audit), methods=["GET"]),
        Route("/v1/load_lora_adapter", _route(state, "load_lora_adapter", load_lora_adapter),
              methods=["POST"]),
        Route("/v1/unload_lora_adapter",
              _route(state, "unload_lora_adapter", unload_lora_adapter), methods=["POST"]),
        Route("/health", _route(state, "health", _health), methods=["GET"]),
        # With --api-key, the key too: the adapters' names and the traffic are no one's else.
        Route("/metrics", _route(state, "metrics", _metrics, guarded=True), methods=["GET"]),
        Route("/version", _route(state, "version", _version), methods=["GET"]),
        Route("/openapi.json", _route(state, "openapi", _openapi), methods=["GET"]),
    ]
    if state.ui:  # the browser page at / (--no-ui: none)
        routes += ui_routes()
    guard = [Middleware(BrowserGuard, policy=origins, error=error_in_api_shape)] if origins else []
    app = Starlette(routes=routes, lifespan=lifespan, middleware=guard,
                    exception_handlers={HTTPException: _http_error})
    app.state.start_engine = start
    return app


async def start_engine(app: Starlette) -> None:
    """Make and start the app's engine client now (once); raises what its start raises."""
    await app.state.start_engine()
