"""Checks that keep web pages from driving a server through the visitor's browser, with or
without an API key: Host (DNS rebinding) and Origin (cross-site requests), and CORS for the
origins the operator approved.

- Host: a page on `evil.example` that rebinds its name to 127.0.0.1 reaches a loopback server
  as "its own" origin; only the Host header still names evil.example. A server bound to a
  loopback address answers only Host names that are loopback (localhost, *.localhost,
  127.0.0.0/8, [::1]), the bound name, or listed in --allowed-hosts. Bound to any other address
  (0.0.0.0, ::, a LAN address) it is reached under names it cannot know (container and service
  names, reverse proxies), so it checks Host only when --allowed-hosts is given (Ollama's
  choice); such a server should have an API key anyway.
- Origin: browsers name the page that made a request in `Origin` (every cross-origin request,
  every POST); programs (SDKs, curl, Claude Code, Codex) send none and are not concerned. A
  request from another origin is refused (403) unless --allowed-origins lists it ('*': any);
  the server's own page (the same origin) always passes. Listed origins get CORS headers and
  their preflight (OPTIONS) answered; others' preflights are refused.

The JSON routes also want a JSON body type (http_io.require_json_body): an HTML form can post
only form and text types without a preflight.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer.frontend.server.errors import APIError

log = logging.getLogger("deepinfer.api")

ANY = "*"
_DEFAULT_PORTS = {"http": 80, "https": 443}
_CORS_METHODS = "GET, POST, DELETE, OPTIONS"


def _split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header (`name`, `name:port`, `[v6]:port`) -> (lowercase name, port); None when
    malformed or empty (`:8000` names no host)."""
    try:
        parts = urlsplit("//" + value.strip())
        name, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not name or parts.username is not None or parts.path or parts.query:
        return None
    return name.rstrip("."), port


def _is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def binds_loopback(host: str) -> bool:
    """Whether a server bound to `host` (an address or a name) listens on loopback only."""
    if _is_loopback_name(host.lower().strip("[]")):
        return True
    if not host or _is_ip(host.strip("[]")):
        return False
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return all(_is_loopback_name(str(info[4][0])) for info in infos)


def _origin_key(origin: str) -> tuple[str, str, int] | None:
    """`scheme://host[:port]` -> (scheme, host, port); None for anything else ("null")."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or port is None:
        return None
    return parts.scheme, parts.hostname.rstrip("."), port


@dataclass(frozen=True)
class OriginPolicy:
    """Which Host names and which other origins a server answers (see the module's doc)."""

    bound_host: str
    loopback: bool  # bound to loopback only
    allowed_hosts: tuple[str, ...] = ()  # names, '.example.com' (it and its subdomains), '*'
    allowed_origins: tuple[str, ...] = ()  # 'https://app.example.com', 'null', '*'

    @classmethod
    def create(cls, bound_host: str, allowed_hosts: list[str] | None = None,
               allowed_origins: list[str] | None = None) -> OriginPolicy:
        """The policy of a server bound to `bound_host` (--host), with the operator's lists."""
        return cls(bound_host.lower().strip("[]").rstrip("."), binds_loopback(bound_host),
                   tuple(h.lower().rstrip(".") for h in allowed_hosts or ()),
                   tuple(o.strip().rstrip("/").lower() for o in allowed_origins or ()))

    def _listed_host(self, name: str) -> bool:
        return any(entry == ANY or name == entry or (entry.startswith(".") and (
            name == entry[1:] or name.endswith(entry))) for entry in self.allowed_hosts)

    def host_allowed(self, host: str | None) -> bool:
        """Whether a request with this Host header is served (None: no header, not a browser)."""
        if host is None:
            return True
        split = _split_host(host)
        if split is None:
            return False
        name = split[0]
        if _is_loopback_name(name) or name == self.bound_host or self._listed_host(name):
            return True
        if self.loopback:
            return False
        # Reached over the network: any name, unless the operator listed the names.
        return not self.allowed_hosts or _is_ip(name)

    def listed_origin(self, origin: str) -> bool:
        return ANY in self.allowed_origins or origin.rstrip("/").lower() in self.allowed_origins

    def same_origin(self, origin: str, host: str | None) -> bool:
        """Whether `origin` is this server's own (its page), as the Host header names it."""
        key, split = _origin_key(origin), _split_host(host or "")
        if key is None or split is None:
            return False
        scheme, name, port = key
        return name == split[0] and port == (split[1] or _DEFAULT_PORTS[scheme])


def _forbidden(message: str) -> APIError:
    return APIError(message, status=403, code="forbidden")


class BrowserGuard:
    """ASGI middleware applying an OriginPolicy to every HTTP request. `error` shapes a refusal
    for the request's path (each API answers in its own error shape)."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy,
                 error: Callable[[str, APIError], Response] | None = None) -> None:
        self.app, self.policy = app, policy
        self.error = error or (lambda path, exc: exc.response())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host, origin = headers.get("host"), headers.get("origin")
        refusal = self._refusal(host, origin)
        if refusal is not None:
            log.warning("refused %s %s: %s", scope["method"], scope["path"], refusal.message)
            await self.error(scope["path"], refusal)(scope, receive, send)
            return
        cross = origin is not None and not self.policy.same_origin(origin, host)
        if not cross:
            await self.app(scope, receive, send)
            return
        assert origin is not None  # a listed cross origin: CORS
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await self._preflight(origin, headers)(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"access-control-allow-origin", origin.encode("latin-1")),
                                      (b"vary", b"Origin")]
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _refusal(self, host: str | None, origin: str | None) -> APIError | None:
        if not self.policy.host_allowed(host):
            return _forbidden(f"Host {host!r} is not served here (a guard against DNS "
                              f"rebinding); start the server with --allowed-hosts NAME to "
                              f"accept it")
        if (origin is not None and not self.policy.same_origin(origin, host)
                and not self.policy.listed_origin(origin)):
            return _forbidden(f"cross-origin request from {origin!r} refused; start the server "
                              f"with --allowed-origins {origin} to accept it")
        return None

    def _preflight(self, origin: str, headers: Headers) -> Response:
        asked = headers.get("access-control-request-headers")
        cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin",
                "Access-Control-Allow-Methods": _CORS_METHODS, "Access-Control-Max-Age": "600"}
        if asked:
            cors["Access-Control-Allow-Headers"] = asked
        return Response(status_code=204, headers=cors)
