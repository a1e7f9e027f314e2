"""The data-parallel router: one OpenAI-compatible endpoint in front of N `deepinfer serve`
replicas.

Each completion, chat, messages or responses request goes to the replica the policy picks
(frontend/router/policy.py) and its response passes through unchanged, streamed or not. A stored
response lives on the replica that made it: its GET / DELETE, and a request continuing it
(`previous_response_id`), go to the replica that has it (each is asked in turn). A replica that
cannot be reached, or that answers 5xx before the client has received a byte, is skipped and the
request retried on another one; a stream that breaks after its first bytes ends with an error
event. A background task polls every replica's /health; failing ones leave the rotation until
they answer again.
A client that goes away, streaming or not, drops the request's connection to its replica, which
then aborts the request (the server's own behaviour when its client leaves).
/metrics shows placement and load per replica. The prefill/decode router (pd.py) is this one with
two pools: it shares the health loop, `place` (choose, forward, retry) and the streaming relay.

Every endpoint a server answers answers here too, with the same API key check (Bearer, or
x-api-key on /v1/messages*) and the same request-body limit (413): GET /v1/models, /version and
/openapi.json from any healthy replica; a LoRA adapter load or unload on every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from deepinfer.frontend.auth import UNAUTHORIZED, authorized
from deepinfer.frontend.router.kv_events import KVEventRouting
from deepinfer.frontend.router.policy import Policy, Replica
from deepinfer.frontend.server.app import error_in_api_shape
from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.http_io import read_body, run_until_disconnect
from deepinfer.frontend.server.origin_checks import BrowserGuard, OriginPolicy

log = logging.getLogger("deepinfer.router")
# Hop-by-hop and length headers are the router's own business, not the replica's.
_DROP = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


def _growing(value: object) -> str:
    """A conversation as text that a longer one extends (the list's closing bracket cut)."""
    if isinstance(value, str) or value is None:
        return value or ""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)[:-1]


def routing_text(path: str, payload: object) -> str:
    """What a request's cached prefix is judged on: the model it names (a LoRA adapter's cache
    is its own), then the prompt, or the conversation (after the system prompt or instructions
    that come before it)."""
    if not isinstance(payload, dict):
        return ""
    return f"{request_model(payload)}\n{_prompt_text(path, payload)}"


def request_model(payload: object) -> str | None:
    model = payload.get("model") if isinstance(payload, dict) else None
    return model if isinstance(model, str) else None


def _prompt_text(path: str, payload: dict) -> str:
    if path.endswith("chat/completions"):
        return _growing(payload.get("messages"))
    if path.startswith("/v1/messages"):
        return json.dumps(payload.get("system"), ensure_ascii=False) + \
            _growing(payload.get("messages"))
    if path == "/v1/responses":
        return json.dumps(payload.get("instructions"), ensure_ascii=False) + \
            _growing(payload.get("input"))
    prompt = payload.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def json_or_none(body: bytes) -> object:
    """The request body parsed, or None when it is no JSON (a replica answers it with its own
    400)."""
    try:
        return json.loads(body)
    except ValueError:
        return None


def forward_headers(request: Request) -> dict[str, str]:
    """The client's headers a replica gets: the body's type, the API key, what it accepts."""
    return {k: v for k, v in request.headers.items()
            if k.lower() in ("content-type", "authorization", "accept", "x-api-key",
                             "anthropic-version", "anthropic-beta")}


def _authorized(api_key: str | None, request: Request) -> bool:
    return authorized(api_key, request.url.path, request.headers.get("authorization"),
                      request.headers.get("x-api-key"))


class Relay(StreamingResponse):
    """A replica's stream on its way to the client. `finish` runs however the stream ends (its
    last byte sent, the replica failing, the client gone, even before its first byte)."""

    def __init__(self, chunks: AsyncIterator[bytes], status: int, headers: dict[str, str],
                 finish: Callable[[], None]) -> None:
        super().__init__(chunks, status, headers)
        self.finish = finish

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # Under ASGI 2.3 (uvicorn's) this listens for the client's disconnect and stops.
            await super().__call__(scope, receive, send)
        finally:
            self.finish()


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "router_error", "code": status}},
                        status_code=status)


class Router:
    def __init__(self, urls: list[str], policy: Policy, health_interval: float = 1.0,
                 api_key: str | None = None, events: KVEventRouting | None = None) -> None:
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self.api_key = api_key  # checked here and passed on to the replicas
        self.policy = policy
        self.events = events  # KV events: exact placement (frontend/router/kv_events.py)
        if events is not None:
            policy.block_index = events.index
        self.health_interval = health_interval
        self.session: aiohttp.ClientSession | None = None
        self.registry = CollectorRegistry()
        self.placed = Counter("deepinfer_router_requests", "requests placed on each replica",
                              ["replica"], registry=self.registry)
        self.prefix_placed = Gauge(
            "deepinfer_router_prefix_hits_total",
            "requests placed on a replica for its cached prefix (cache_aware)", ["replica"],
            registry=self.registry)
        self.retries = Counter("deepinfer_router_retries", "requests retried on another replica",
                               registry=self.registry)
        self.failed = Counter("deepinfer_router_failed", "requests that no replica completed",
                              registry=self.registry)
        self.in_flight = Gauge("deepinfer_router_in_flight", "requests in flight per replica",
                               ["replica"], registry=self.registry)
        self.healthy = Gauge("deepinfer_router_replica_healthy", "1 while a replica is in rotation",
                             ["replica"], registry=self.registry)
        self.event_blocks = Gauge("deepinfer_router_kv_event_blocks",
                                  "blocks a replica's KV events say it caches (all tiers)",
                                  ["replica"], registry=self.registry)

    # ------------------------------------------------------------------ health

    async def check_health(self) -> None:
        async def one(r: Replica) -> None:
            try:
                async with self.session.get(f"{r.url}/health",
                                            timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    ok = resp.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ok = False
            if ok != r.healthy:
                log.warning("replica %s %s", r.url, "is back" if ok else "left the rotation")
            r.healthy = ok

        await asyncio.gather(*(one(r) for r in self.replicas))

    async def health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval)

    # ------------------------------------------------------------------ proxy

    async def endpoint(self, request: Request) -> Response:
        """The completion and chat routes: `proxy`, dropped as soon as the client goes away.
        The connection to the replica closes with it, so the replica aborts the request, as it
        does when its own client leaves (a stream ends the same way: see Relay)."""
        if not _authorized(self.api_key, request):
            return JSONResponse(UNAUTHORIZED, status_code=401)  # before reading any body
        try:
            # Read first (from then on, receive() only reports a disconnect), and bounded as a
            # server bounds it: a 413 past the same limit.
            body = await read_body(request)
        except APIError as exc:
            return exc.response()
        response = await run_until_disconnect(request, self.proxy(request, body))
        return Response(status_code=499) if response is None else response  # nobody reads it

    async def proxy(self, request: Request, body: bytes) -> Response:
        """Place an authorized request (`endpoint` checked its key) and return the answer."""
        return await self.whole(request, body, self.replicas)

    async def whole(self, request: Request, body: bytes, pool: list[Replica]) -> Response:
        """The request, unchanged, to the replica of `pool` the policy picks (a stored
        response's continuation: to the replica that has it)."""
        payload = json_or_none(body)
        path = request.url.path
        stream = isinstance(payload, dict) and bool(payload.get("stream"))
        headers = forward_headers(request)
        previous = payload.get("previous_response_id") if isinstance(payload, dict) else None
        if path == "/v1/responses" and isinstance(previous, str):
            owner = await self.owner(previous, headers)
            pool = [owner] if owner is not None else pool  # none: a replica answers the 404
        tokens = self.events.tokens(path, payload) if self.events is not None else None
        response = await self.place(pool, self.policy, routing_text(path, payload), path, body,
                                    headers, stream, tokens, request_model(payload))
        return self.unavailable(pool) if response is None else response

    async def owner(self, response_id: str, headers: dict) -> Replica | None:
        """The healthy replica that stores response `response_id`, if any."""
        for r in [r for r in self.replicas if r.healthy]:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with self.session.get(f"{r.url}/v1/responses/{response_id}",
                                            headers=headers) as resp:
                    if resp.status == 200:
                        return r
        return None

    async def stored_response(self, request: Request) -> Response:
        """GET or DELETE /v1/responses/{id}: the answer of the replica that has it."""
        if not _authorized(self.api_key, request):
            return JSONResponse(UNAUTHORIZED, status_code=401)
        headers = forward_headers(request)
        owner = await self.owner(request.path_params["response_id"], headers)
        if owner is None:
            return error(404, "no response with this id")
        async with self.session.request(request.method, f"{owner.url}{request.url.path}",
                                        headers=headers) as resp:
            return Response(await resp.read(), resp.status, media_type="application/json")

    async def place(self, pool: list[Replica], policy: Policy, text: str, path: str,
                    body: bytes, headers: dict, stream: bool,
                    tokens: list[int] | None = None, model: str | None = None
                    ) -> Response | None:
        """POST `body` to the replica of `pool` that `policy` picks for `text`, and return its
        response; one that fails before answering is skipped and the next one tried. None when
        no replica of `pool` could take the request."""
        tried: set[str] = set()
        while True:
            candidates = [r for r in pool if r.healthy and r.url not in tried]
            replica = policy.choose(text, candidates, tokens, model)
            if replica is None:
                return None
            tried.add(replica.url)
            self.placed.labels(replica.url).inc()
            response = await self._forward(replica, path, body, headers, stream)
            if response is not None:
                return response
            self.retries.inc()

    def unavailable(self, pool: list[Replica]) -> JSONResponse:
        self.failed.inc()
        if any(r.healthy for r in pool):  # healthy, yet each answered 5xx
            return error(503, "no replica could take the request")
        return error(503, "no healthy replica")

    async def _forward(self, replica: Replica, path: str, body: bytes, headers: dict,
                       stream: bool) -> Response | None:
        """The replica's response, or None when it failed before the client got anything.
        Cancelled (its client went away: see `endpoint`), it closes the connection to the
        replica, which is how the replica learns to abort the request."""
        replica.in_flight += 1
        self.in_flight.labels(replica.url).set(replica.in_flight)
        resp = None
        try:
            resp = await self.session.post(f"{replica.url}{path}", data=body, headers=headers)
            if resp.status >= 500:
                log.warning("replica %s answered %d: retrying elsewhere", replica.url,
                            resp.status)
                resp.release()
                return self._done(replica)
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP}
            if not stream:
                content = await resp.read()
                self._done(replica)
                return Response(content, resp.status, out_headers)
            first = await resp.content.readany()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("replica %s failed (%s): retrying elsewhere", replica.url, exc)
            replica.healthy = False
            if resp is not None:
                resp.release()
            return self._done(replica)
        except asyncio.CancelledError:
            if resp is not None:
                resp.close()
            self._done(replica)
            raise
        return Relay(self._relay(replica, resp, first), resp.status, out_headers,
                     finish=lambda: self._end_relay(replica, resp))

    async def _relay(self, replica: Replica, resp: aiohttp.ClientResponse, first: bytes
                     ) -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            replica.healthy = False
            self.failed.inc()
            event = {"error": {"message": f"the replica serving this stream failed: {exc}",
                               "type": "router_error", "code": 502}}
            yield f"data: {json.dumps(event)}\n\n".encode()

    def _end_relay(self, replica: Replica, resp: aiohttp.ClientResponse) -> None:
        if resp.content.at_eof():
            resp.release()  # read to its end: the connection can serve another request
        else:
            resp.close()  # the client left mid-stream: the replica aborts on the close
        self._done(replica)

    def _done(self, replica: Replica) -> None:
        replica.in_flight -= 1
        self.in_flight.labels(replica.url).set(replica.in_flight)
        return None

    # ------------------------------------------------------------------ other routes

    async def any_replica(self, request: Request) -> Response:
        """GET /v1/models, /version, /openapi.json: every replica answers the same; the first
        healthy one that can be reached does, with the client's own key (replicas may have
        keys when the router has none)."""
        if not _authorized(self.api_key, request):
            return JSONResponse(UNAUTHORIZED, status_code=401)
        headers = forward_headers(request)
        for r in [r for r in self.replicas if r.healthy]:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with self.session.get(f"{r.url}{request.url.path}",
                                            headers=headers) as resp:
                    return Response(await resp.read(), resp.status,
                                    media_type=resp.headers.get("content-type"))
        return error(503, "no healthy replica")

    async def audit(self, request: Request) -> Response:
        """GET /v1/audit: the exactness audit of every healthy replica, added up (each replica
        audits its own requests); each of the latest divergences names its replica. A replica
        that refuses (its key) answers for all; one that cannot be reached is left out."""
        if not _authorized(self.api_key, request):
            return JSONResponse(UNAUTHORIZED, status_code=401)
        headers = forward_headers(request)

        async def one(r: Replica) -> tuple[int, bytes] | None:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with self.session.get(f"{r.url}/v1/audit", headers=headers) as resp:
                    return resp.status, await resp.read()
            return None

        healthy = [r for r in self.replicas if r.healthy]
        merged = {"requests": 0, "pending": 0, "divergences": {}, "max_logprob_diff": 0.0,
                  "latest": []}
        for r, answer in zip(healthy, await asyncio.gather(*(one(r) for r in healthy))):
            if answer is None:
                continue
            status, body = answer
            if status != 200:
                return Response(body, status, media_type="application/json")
            part = json.loads(body)
            merged["requests"] += part["requests"]
            merged["pending"] += part["pending"]
            for shortcut, count in part["divergences"].items():
                merged["divergences"][shortcut] = merged["divergences"].get(shortcut, 0) + count
            merged["max_logprob_diff"] = max(merged["max_logprob_diff"],
                                             part["max_logprob_diff"])
            merged["latest"] += [{**d, "replica": r.url} for d in part["latest"]]
        return JSONResponse(merged)

    async def every_replica(self, request: Request) -> Response:
        """POST /v1/load_lora_adapter and /v1/unload_lora_adapter: the same change on every
        replica, so that any of them can serve the adapter. Every replica's answer 2xx: the
        first one's; else the first failure's (the replicas that did change stay changed: the
        same request again, or its undoing, reaches every one)."""
        if not _authorized(self.api_key, request):
            return JSONResponse(UNAUTHORIZED, status_code=401)
        try:
            body = await read_body(request)
        except APIError as exc:
            return exc.response()
        headers = forward_headers(request)

        async def one(r: Replica) -> Response:
            try:
                async with self.session.post(f"{r.url}{request.url.path}", data=body,
                                             headers=headers) as resp:
                    return Response(await resp.read(), resp.status,
                                    media_type=resp.headers.get("content-type"))
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return error(503, f"replica {r.url} could not be reached: {exc}")

        answers = await asyncio.gather(*(one(r) for r in self.replicas))
        failed = [a for a in answers if not 200 <= a.status_code < 300]
        for r, a in zip(self.replicas, answers):
            if not 200 <= a.status_code < 300:
                log.warning("%s on %s answered %d", request.url.path, r.url, a.status_code)
        return failed[0] if failed else answers[0]

    async def health(self, request: Request) -> Response:
        up = sum(r.healthy for r in self.replicas)
        return JSONResponse({"healthy_replicas": up, "replicas": len(self.replicas)},
                            status_code=200 if up else 503)

    async def metrics(self, request: Request) -> Response:
        for r in self.replicas:
            self.healthy.labels(r.url).set(int(r.healthy))
            self.in_flight.labels(r.url).set(r.in_flight)
            self.prefix_placed.labels(r.url).set(r.prefix_routed)
            if self.events is not None:
                self.event_blocks.labels(r.url).set(self.events.index.num_blocks(r.url))
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")


def build_router_app(router: Router, origins: OriginPolicy | None = None) -> Starlette:
    """The router's ASGI app; `origins`: the Host and Origin checks of a server's edge
    (frontend/server/origin_checks.py), none when None (a router inside a test)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        router.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        await router.check_health()
        tasks = [asyncio.create_task(router.health_loop())]
        if router.events is not None:
            tasks.append(asyncio.create_task(router.events.follower.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await router.session.close()

    routes = [
        Route("/v1/completions", router.endpoint, methods=["POST"]),
        Route("/v1/chat/completions", router.endpoint, methods=["POST"]),
        Route("/v1/messages", router.endpoint, methods=["POST"]),
        Route("/v1/messages/count_tokens", router.endpoint, methods=["POST"]),
        Route("/v1/responses", router.endpoint, methods=["POST"]),
        Route("/v1/responses/{response_id}", router.stored_response,
              methods=["GET", "DELETE"]),
        Route("/v1/models", router.any_replica, methods=["GET"]),
        Route("/version", router.any_replica, methods=["GET"]),
        Route("/openapi.json", router.any_replica, methods=["GET"]),
        Route("/v1/audit", router.audit, methods=["GET"]),
        Route("/v1/load_lora_adapter", router.every_replica, methods=["POST"]),
        Route("/v1/unload_lora_adapter", router.every_replica, methods=["POST"]),
        Route("/health", router.health, methods=["GET"]),
        Route("/metrics", router.metrics, methods=["GET"]),
    ]
    guard = [Middleware(BrowserGuard, policy=origins, error=error_in_api_shape)] if origins else []
    return Starlette(routes=routes, lifespan=lifespan, middleware=guard)
