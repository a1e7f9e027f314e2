"""Bounded body reads: an over-limit body is drained (up to a cap) before the 413."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.http_io import read_body

LIMIT = 100
CAP = 16 * LIMIT


class Body:
    """An ASGI receive callable that serves `chunks` and counts what the app has read."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.served = 0

    async def __call__(self) -> dict:
        if self.served == len(self.chunks):  # read_body must stop at the end of the body
            raise AssertionError("read past the end of the body")
        self.served += 1
        more = self.served < len(self.chunks)
        return {"type": "http.request", "body": self.chunks[self.served - 1], "more_body": more}


def _request(body: Body, headers: dict[str, str]) -> Request:
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "headers": raw}, body)


def _read(body: Body, headers: dict[str, str] | None = None) -> bytes:
    return asyncio.run(read_body(_request(body, headers or {}), limit=LIMIT))


def _refused(body: Body, headers: dict[str, str] | None = None) -> APIError:
    with pytest.raises(APIError) as exc:
        _read(body, headers)
    assert exc.value.status == 413
    return exc.value


def test_body_within_the_limit():
    body = Body([b"a" * 60, b"b" * 40])
    assert _read(body, {"content-length": "100"}) == b"a" * 60 + b"b" * 40
    assert body.served == 2


@pytest.mark.parametrize("declared", [True, False])
def test_over_limit_body_is_read_to_its_end_before_the_413(declared):
    # Answering before the body is read ends in a connection reset, not the 413, at the client.
    body = Body([b"x" * 64] * 10)
    headers = {"content-length": "640"} if declared else {}
    err = _refused(body, headers)
    assert body.served == 10
    assert err.headers is None  # all read: the connection can stay open


def test_draining_stops_at_the_cap():
    body = Body([b"x" * 64] * 1000)  # 64000 bytes, far past 16x the limit
    err = _refused(body)
    assert body.served == CAP // 64 + 1
    assert err.headers == {"Connection": "close"}


@pytest.mark.parametrize("headers", [
    {"content-length": str(CAP + 1)},
    {"content-length": "1000", "expect": "100-continue"},  # the client has not sent it yet
])
def test_refused_at_once_without_reading(headers):
    body = Body([b"x" * 64] * 1000)
    err = _refused(body, headers)
    assert body.served == 0
    assert err.headers == {"Connection": "close"}
