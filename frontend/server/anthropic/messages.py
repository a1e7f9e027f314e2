"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API around the shared
chat path (common/chat_turns.py). The request is translated into an OpenAI chat request
(request.py), run, and its turn translated back (response.py); errors take
Anthropic's shape (`error_response`, which the route wrapper is given for these routes).

Anthropic clients send `anthropic-version` (and often `anthropic-beta`) headers: they are
accepted and read no further; the key may come as `x-api-key` (frontend/auth.py).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from deepinfer.frontend.server.anthropic.request import chat_body, renamed
from deepinfer.frontend.server.anthropic.response import Event, MessageEvents, message_body
from deepinfer.frontend.server.anthropic.schema import (
    ErrorDetail,
    ErrorOut,
    TokenCount,
    decode_count_tokens,
    decode_messages,
)
from deepinfer.frontend.server.common.chat_turns import ChatRun, decode_chat_dict, start_chat
from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.http_io import SSEResponse, read_json
from deepinfer.frontend.server.state import ServerState

_encode = msgspec.json.Encoder().encode

# The tokenizer's words for a prompt past the context (engine/tokenizer/tokenizer_process.py).
_TOO_LONG = re.compile(r"the prompt has (?:at least )?(\d+) tokens; .*? is (\d+) tokens")

# HTTP status -> Anthropic's error type (its API answers overload with 529; we keep 503).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


def error_body(exc: APIError) -> ErrorOut:
    """Anthropic's error body; it has no `param`, so the message names the field. A prompt
    past the context is said in Anthropic's words: Claude Code recognizes an overflow (and
    compacts the conversation) only by them."""
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else
                            "invalid_request_error")
    message = exc.message
    too_long = _TOO_LONG.search(message) if exc.code == "context_length_exceeded" else None
    if too_long:
        message = f"prompt is too long: {too_long[1]} tokens > {too_long[2]} maximum"
    elif exc.status == 401:
        message = "invalid or missing API key (x-api-key or Authorization: Bearer)"
    elif exc.param and exc.param not in message:
        message = f"{exc.param}: {message}"
    return ErrorOut(error=ErrorDetail(kind, message))


def error_response(exc: APIError) -> Response:
    return Response(_encode(error_body(exc)), status_code=exc.status, headers=exc.headers,
                    media_type="application/json")


async def _start(state: ServerState, request: Request, body: dict[str, Any],
                 rid: str, count_only: bool = False) -> ChatRun:
    """The chat path on the translated request; its errors renamed into Anthropic's fields."""
    try:
        return await start_chat(state, request, decode_chat_dict(body), rid, count_only)
    except APIError as exc:
        raise renamed(exc) from None


async def create_message(state: ServerState, request: Request) -> Response | SSEResponse:
    req = await read_json(request, decode_messages)
    rid = f"msg_{uuid.uuid4().hex}"
    run = await _start(state, request, chat_body(req, state.context_len), rid)
    if req.stream:
        return SSEResponse(_events(run, rid))
    turns = await run.results(request)
    if turns is None:
        return Response(status_code=499)
    body = message_body(rid, run.model, turns[0], run.usage())
    return Response(_encode(body), media_type="application/json")


def _sse(events: list[Event]) -> bytes:
    return b"".join(b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n"
                    for name, data in events)


async def _events(run: ChatRun, rid: str) -> AsyncGenerator[bytes, None]:
    """message_start waits for the first output: only then does the engine know how much of
    the prompt its cache held, so its usage splits the input as message_delta's does."""
    events = MessageEvents()
    started = False
    try:
        async for d in run.deltas():
            if not started:
                started = True
                yield _sse(events.start(rid, run.model, run.usage()))
            if chunk := events.feed(d):
                yield _sse(chunk)
        if not started:
            yield _sse(events.start(rid, run.model, run.usage()))
        yield _sse(events.finish(run.usage()))
    except APIError as exc:  # the engine failed mid-stream: Anthropic's error event
        yield _sse([("error", msgspec.to_builtins(error_body(renamed(exc))))])
    finally:
        await run.close()


async def count_message_tokens(state: ServerState, request: Request) -> Response:
    """The rendered prompt's length, tools and system included, as the engine's tokenizer
    renders the same conversation (it only tokenizes: nothing is computed or cached)."""
    req = await read_json(request, decode_count_tokens)
    run = await _start(state, request, chat_body(req, state.context_len),
                       f"count-{uuid.uuid4().hex}", count_only=True)
    try:
        tokens = run.usage().prompt_tokens
    finally:
        await run.close()
    return Response(_encode(TokenCount(tokens)), media_type="application/json")
