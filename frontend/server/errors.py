"""OpenAI-style errors: one exception type and the JSON body every client understands."""

from __future__ import annotations

import re

import msgspec
from starlette.responses import Response


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """Raised anywhere in request handling; becomes `{"error": {...}}` with `status`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers

    def body(self) -> ErrorBody:
        return ErrorBody(ErrorInfo(self.message, self.type, self.param, self.code))

    def response(self) -> Response:
        return Response(
            msgspec.json.encode(self.body()),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )


def server_error(message: str, status: int = 503) -> APIError:
    return APIError(message, status=status, type="server_error")


_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_FIELD = re.compile(r"field `(?P<field>[^`]+)`")


def _param(message: str) -> str | None:
    """`$.messages[0].content` -> `messages[0].content`; adds the unknown/missing field name."""
    match = _PATH.search(message)
    path = match.group("path").lstrip(".") if match else ""
    field = _FIELD.search(message)
    if field and ("unknown field" in message or "missing required field" in message):
        path = f"{path}.{field.group('field')}" if path else field.group("field")
    return path or None


def decode_error(exc: msgspec.MsgspecError) -> APIError:
    """Turn msgspec's decode/validation error into a 400 naming the offending field."""
    message = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        return APIError(message, param=_param(message))
    return APIError(f"invalid JSON body: {message}")
