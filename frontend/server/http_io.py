"""HTTP plumbing: bounded body reads, SSE responses and abort-on-disconnect.

Starlette's StreamingResponse cancels through anyio cancel scopes, which re-cancel every await
in the generator's cleanup; the engine abort in that cleanup must be able to run, so the SSE
response here is plain asyncio: one task streams, one waits for `http.disconnect`, whichever
ends first cancels the other, then the chunk generator is closed (its `finally` aborts).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from deepinfer.frontend.server.errors import APIError, decode_error

log = logging.getLogger("deepinfer.api")
T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 8 << 20
MAX_DRAIN_FACTOR = 16
MAX_DRAIN_BYTES = 256 << 20


def _too_big(limit: int, close: bool = False) -> APIError:
    # Close when the body was not read to its end: the connection cannot carry another request.
    headers = {"Connection": "close"} if close else None
    return APIError(f"request body exceeds {limit} bytes", status=413, headers=headers)


def _declared_length(request: Request) -> int:
    """The Content-Length header's value; 0 without one (a chunked body is counted as read)."""
    length = request.headers.get("content-length", "")
    return int(length) if length.isdigit() else 0


async def read_body(request: Request, limit: int = DEFAULT_MAX_BODY_BYTES) -> bytes:
    """The request body, or 413 when it exceeds `limit` bytes.

    An over-limit body is still read to its end (and dropped) before the 413 goes out: closing
    a socket with unread input makes the kernel reset the connection, and the client would see
    the reset instead of the error. Draining stops at a cap (16x the limit, at most 256 MiB);
    past it, or when the client waits for `100 Continue`, the 413 goes out at once.
    """
    cap = min(MAX_DRAIN_FACTOR * limit, MAX_DRAIN_BYTES)
    declared = _declared_length(request)
    over = declared > limit
    waits = request.headers.get("expect", "").lower() == "100-continue"
    if over and (declared > cap or waits):
        raise _too_big(limit, close=True)
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise _too_big(limit, close=True)
        over = over or size > limit
        if not over:
            parts.append(chunk)
    if over:
        raise _too_big(limit)
    # Kept for checks of the bytes themselves (the PD router's proof, server/common/kv_transfer.py):
    # the stream cannot be read twice.
    request.state.body = b"".join(parts)
    return request.state.body


def require_json_body(request: Request) -> None:
    """415 unless the body is declared JSON (`application/json`, `application/*+json`) or not
    declared at all (programs that send none, as FastAPI accepts): an HTML form on any web page
    can post a form or text body to a local server without the browser asking it first."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/")
                                       and media.endswith("+json")):
        return
    raise APIError(f"Content-Type must be application/json, not {declared!r} (with curl: "
                   f"-H 'Content-Type: application/json')", status=415, param="Content-Type",
                   code="unsupported_media_type")


async def read_json(request: Request, decode: Callable[[bytes], T]) -> T:
    """The body decoded into its typed request struct; a 400 naming the field otherwise."""
    body = await read_body(request)  # read first: unread input would reset the connection
    require_json_body(request)
    try:
        return decode(body)
    except msgspec.MsgspecError as exc:
        raise decode_error(exc) from None
    except RecursionError:  # msgspec's own depth guard, in fields that take any JSON
        raise APIError("invalid JSON body: nested too deeply") from None


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it if the client disconnects first (then returns None)."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done():
            log.info("client disconnected; cancelling its request")
        await _cancel(watch, work_task)
    if work_task.cancelled():
        return None
    return work_task.result()


class SSEResponse:
    """A `text/event-stream` response over an async generator of already-framed events."""

    def __init__(self, events: AsyncGenerator[bytes, Any], status_code: int = 200) -> None:
        self.events = events
        self.status_code = status_code
        self.disconnected = False

    async def _stream(self, send: Send) -> None:
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({
            "type": "http.response.start",
            "status": self.status_code,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),
            ],
        })
        stream = asyncio.create_task(self._stream(send))
        watch = asyncio.create_task(_wait_disconnect(receive))
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.disconnected = not stream.done()
            await _cancel(stream, watch)
            await self.events.aclose()
        if not stream.cancelled() and stream.exception() is not None:
            exc = stream.exception()
            if isinstance(exc, OSError):  # the client went away mid-send
                self.disconnected = True
            else:
                raise exc
        if self.disconnected:
            log.info("client disconnected mid-stream; request aborted")


def sse_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
