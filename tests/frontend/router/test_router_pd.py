"""The prefill/decode router (frontend/router/pd.py) in front of stub prefill and decode servers
that record what they are sent and answer as `deepinfer serve --disaggregation-mode ...` does;
no model, no engine."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from deepinfer.engine.trust import ROUTER_HEADER, check_router_proof
from deepinfer.frontend.router.app import build_router_app
from deepinfer.frontend.router.pd import PDRouter
from deepinfer.frontend.router.policy import Policy
from scripts.server_process import free_port
from tests.frontend.router.served import Served

KEY = "sk-pd-test"
SECRET = "pd-router-test-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
BAD_REQUEST = {"error": {"message": "prompt is bad", "type": "invalid_request_error",
                         "param": "prompt", "code": None}}
DECODED = {"id": "cmpl-d", "object": "text_completion", "served_by": "decode",
           "choices": [{"index": 0, "text": "ABC", "finish_reason": "length"}],
           "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}
EVENTS = [f'data: {{"choices": [{{"index": 0, "text": "{t}"}}]}}' for t in "ABC"]


class Upstream:
    """A stand-in for one prefill or decode server: records each body (as bytes) and the
    Authorization header it is sent. A prefill server answers a prompt containing "bad" with a
    400 and one containing "eos" without kv_transfer_params (it ended on its first token); a
    decode server holds one containing "hold" until its client (the router) leaves, and records
    whether it did (`left`); `fail_with` makes every completion answer that status."""

    def __init__(self, role: str) -> None:
        self.role, self.bodies, self.auth, self.proofs = role, [], [], []
        self.left: list[bool] = []
        self.fail_with: int | None = None

    def sent(self) -> list[dict]:
        return [json.loads(b) for b in self.bodies]

    async def complete(self, request: Request) -> Response:
        raw = await request.body()
        self.bodies.append(raw)
        self.auth.append(request.headers.get("authorization"))
        # Whether the router proved it wrote this body (as a real server checks it).
        self.proofs.append(check_router_proof(SECRET.encode(), request.url.path, raw,
                                              request.headers.get(ROUTER_HEADER)))
        if self.fail_with:
            return JSONResponse({"error": {"message": "overloaded"}}, self.fail_with)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return JSONResponse(BAD_REQUEST, 400)
        if self.role == "decode" and "hold" in json.dumps(body.get("prompt")):
            self.left.append(await client_left(request, within=10))
        return self.prefill(body) if self.role == "prefill" else self.decode(body)

    def prefill(self, body: dict) -> Response:
        prompt = json.dumps(body.get("prompt") or body.get("messages"))
        if "bad" in prompt:
            return JSONResponse(BAD_REQUEST, 400)
        answer = {"id": "cmpl-p", "choices": [{"index": 0, "text": "A", "finish_reason": "length"}]}
        if "eos" not in prompt:
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 7001,
                "transfer_id": f"t-{len(self.bodies)}", "blocks": [[3, 4], [5]]}
        return JSONResponse(answer)

    def decode(self, body: dict) -> Response:
        if not body.get("stream"):
            return JSONResponse(DECODED)

        async def events():
            for event in [*EVENTS, "data: [DONE]"]:
                yield f"{event}\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def info(self, request: Request) -> Response:
        """GET /v1/models, /version, /openapi.json: who asked, with which key."""
        self.auth.append(request.headers.get("authorization"))
        return JSONResponse({"path": request.url.path, "role": self.role})

    async def lora(self, request: Request) -> Response:
        self.bodies.append(await request.body())
        if self.fail_with:
            return JSONResponse({"error": {"message": "no such adapter"}}, self.fail_with)
        return Response(f"Success: {self.role}", media_type="text/plain")

    def app(self) -> Starlette:
        async def health(request: Request) -> Response:
            return JSONResponse({"status": "ok"})

        posts = ["/v1/completions", "/v1/chat/completions", "/v1/messages",
                 "/v1/messages/count_tokens", "/v1/responses"]
        return Starlette(routes=[
            *(Route(path, self.complete, methods=["POST"]) for path in posts),
            *(Route(path, self.info) for path in ("/v1/models", "/version", "/openapi.json")),
            *(Route(f"/v1/{verb}_lora_adapter", self.lora, methods=["POST"])
              for verb in ("load", "unload")),
            Route("/health", health)])


async def client_left(request: Request, within: float) -> bool:
    """Whether the client of `request` (its body read) disconnects within `within` seconds."""
    async def disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    try:
        await asyncio.wait_for(disconnect(), within)
    except asyncio.TimeoutError:
        return False
    return True


@pytest.fixture(scope="module", autouse=True)
def cluster_secret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CLUSTER_SECRET", SECRET)
        yield


@pytest.fixture(scope="module")
def upstreams():
    stubs = {"prefill": Upstream("prefill"), "decode": Upstream("decode")}
    served = {name: Served(stub.app()) for name, stub in stubs.items()}
    yield stubs, {name: s.url for name, s in served.items()}
    for s in served.values():
        s.stop()


@pytest.fixture()
def stubs(upstreams):
    stubs, _ = upstreams
    for stub in stubs.values():
        stub.bodies.clear()
        stub.auth.clear()
        stub.proofs.clear()
        stub.left.clear()
    return stubs


def start_router(prefill: list[str], decode: list[str], **kwargs) -> tuple[Served, PDRouter]:
    router = PDRouter(prefill, decode, Policy(), **kwargs)
    return Served(build_router_app(router)), router


@pytest.fixture(scope="module")
def router(upstreams):
    _, urls = upstreams
    served, _ = start_router([urls["prefill"]], [urls["decode"]], api_key=KEY)
    yield served.url
    served.stop()


def post(router: str, path: str, body: dict | bytes, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{router}{path}", content=content, timeout=30,
                      headers={**AUTH, "content-type": "application/json"}, **kwargs)


def metric(router: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{router}/metrics", timeout=10).text
    found = re.search(rf"^{name}{re.escape(labels)} ([0-9.e+]+)$", text, re.M)
    return float(found[1]) if found else 0.0


def pd_count(router: str, path: str) -> float:
    return metric(router, "deepinfer_router_pd_requests_total", f'{{path="{path}"}}')


def test_a_request_is_prefilled_then_decoded_with_the_prefill_servers_kv_params(stubs, router):
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    before = pd_count(router, "disaggregated")
    r = post(router, "/v1/completions", body)
    assert r.status_code == 200 and r.json() == DECODED
    [prefill] = stubs["prefill"].sent()
    # Every field as the client sent it (the prefill server checks them all), not streamed.
    assert prefill == {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    [decode] = stubs["decode"].sent()
    handed_over = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 7001,
                   "transfer_id": "t-1", "blocks": [[3, 4], [5]]}
    assert decode == {**body, "kv_transfer_params": handed_over}
    assert stubs["prefill"].auth == stubs["decode"].auth == [AUTH["Authorization"]]
    # Both bodies the router wrote carry its proof (the servers take the field only then).
    assert stubs["prefill"].proofs == stubs["decode"].proofs == [True]
    assert pd_count(router, "disaggregated") == before + 1


def test_a_chat_stream_is_relayed_and_the_prefill_request_is_not_streamed(stubs, router):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 20}
    with httpx.stream("POST", f"{router}/v1/chat/completions", json=body, headers=AUTH,
                      timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert lines == [*EVENTS, "data: [DONE]"]
    [prefill] = stubs["prefill"].sent()
    assert prefill == {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    [decode] = stubs["decode"].sent()
    assert decode.pop("kv_transfer_params")["do_remote_prefill"] is True
    assert decode == body  # stream and stream_options as the client sent them


def test_a_prefill_answer_without_kv_params_falls_back_to_the_original_request(stubs, router):
    body = {"model": "m", "prompt": "this one stops at eos", "max_tokens": 8, "stream": True}
    before = pd_count(router, "fallback")
    with httpx.stream("POST", f"{router}/v1/completions", json=body, headers=AUTH,
                      timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert len(stubs["prefill"].bodies) == 1
    assert stubs["decode"].sent() == [body]  # unchanged: no kv_transfer_params
    assert stubs["decode"].proofs == [False]  # nor the router's proof
    assert pd_count(router, "fallback") == before + 1


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "m", "prompt": "p", "n": 2, "max_tokens": 8}),
    ("/v1/completions", {"model": "m", "prompt": "p", "max_tokens": 1}),
    ("/v1/completions", {"model": "m", "prompt": ["one", "two"], "max_tokens": 8}),
    # Prompt logprobs: only the server that computes the prompt has its logits.
    ("/v1/completions", {"model": "m", "prompt": "p", "max_tokens": 8, "prompt_logprobs": 1}),
    ("/v1/completions", {"model": "m", "prompt": "p", "max_tokens": 8, "echo": True,
                         "logprobs": 0}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "p"}],
                              "max_tokens": 9, "max_completion_tokens": 1}),
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[1, 2]"),
])
def test_requests_the_split_cannot_serve_go_unchanged_to_a_decode_server(stubs, router, path,
                                                                          body):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = post(router, path, content)
    assert r.status_code in (200, 400)
    assert stubs["prefill"].bodies == []
    assert stubs["decode"].bodies == [content]  # byte for byte


@pytest.mark.parametrize("max_tokens", [1, 16])
def test_a_clients_kv_transfer_params_are_refused_before_anything_is_sent(stubs, router,
                                                                          max_tokens):
    """The field is the router's: a client that sets it (the prefix-cache poisoning repro went
    through the one-token fallback, straight to a decode server) gets a 400 naming it."""
    r = post(router, "/v1/completions", {
        "model": "m", "prompt": "p", "max_tokens": max_tokens,
        "kv_transfer_params": {"do_remote_prefill": True, "addresses": ["tcp://evil:1#n"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    assert stubs["prefill"].bodies == [] and stubs["decode"].bodies == []


def test_a_prefill_servers_400_reaches_the_client_unchanged(stubs, router):
    r = post(router, "/v1/completions", {"model": "m", "prompt": "a bad prompt"})
    assert r.status_code == 400 and r.json() == BAD_REQUEST
    assert len(stubs["prefill"].bodies) == 1 and stubs["decode"].bodies == []


def test_the_api_key_is_checked_before_anything_is_sent(stubs, router):
    r = httpx.post(f"{router}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
    assert r.status_code == 401
    assert stubs["prefill"].bodies == [] and stubs["decode"].bodies == []


def test_health_and_metrics_show_both_pools(stubs, router, upstreams):
    _, urls = upstreams
    health = httpx.get(f"{router}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {
        "healthy_replicas": 2, "replicas": 2, "prefill": {"healthy": 1, "replicas": 1},
        "decode": {"healthy": 1, "replicas": 1}}
    for role in ("prefill", "decode"):
        labels = f'{{replica="{urls[role]}",role="{role}"}}'
        assert metric(router, "deepinfer_router_replica_role", labels) == 1.0


@pytest.mark.parametrize("failure", ["stopped", "503"])
def test_a_failing_prefill_server_is_skipped_for_the_next_one(stubs, upstreams, failure):
    _, urls = upstreams
    broken = Upstream("prefill")
    served = Served(broken.app())
    # Health checks far apart: the router learns of the failure from the request itself.
    router, pd = start_router([served.url, urls["prefill"]], [urls["decode"]],
                              health_interval=3600)
    try:
        if failure == "stopped":
            served.stop()
            time.sleep(0.3)  # the health loop's first round is over: no check until the request
            pd.prefill[0].healthy = True  # as between two checks
        else:
            broken.fail_with = 503
        r = post(router.url, "/v1/completions", {"model": "m", "prompt": "retry me"})
        assert r.status_code == 200 and r.json() == DECODED
        assert len(stubs["prefill"].bodies) == 1  # the healthy prefill server took it over
        assert stubs["decode"].sent()[0]["kv_transfer_params"]["transfer_id"] == "t-1"
        assert metric(router.url, "deepinfer_router_retries_total") == 1.0
        assert len(broken.bodies) == (failure == "503")
        healthy = httpx.get(f"{router.url}/health", timeout=10).json()["prefill"]["healthy"]
        assert healthy == (1 if failure == "stopped" else 2)  # unreachable: out of rotation
    finally:
        router.stop()
        served.stop()


def test_without_a_decode_server_nothing_is_prefilled(stubs, upstreams):
    _, urls = upstreams
    router, _ = start_router([urls["prefill"]], [f"http://127.0.0.1:{free_port()}"])
    try:
        health = httpx.get(f"{router.url}/health", timeout=10)
        assert health.status_code == 503
        assert health.json()["decode"] == {"healthy": 0, "replicas": 1}
        r = post(router.url, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["message"] == "no healthy replica"
        assert stubs["prefill"].bodies == []  # no KV held for a decode server that is not there
    finally:
        router.stop()


def test_without_a_prefill_server_decode_servers_compute_the_prompt(stubs, upstreams):
    _, urls = upstreams
    router, _ = start_router([f"http://127.0.0.1:{free_port()}"], [urls["decode"]])
    try:
        health = httpx.get(f"{router.url}/health", timeout=10)
        assert health.status_code == 503
        assert health.json()["prefill"] == {"healthy": 0, "replicas": 1}
        body = {"model": "m", "prompt": "x", "max_tokens": 4}
        r = post(router.url, "/v1/completions", body)
        assert r.status_code == 200 and stubs["decode"].sent() == [body]
        assert pd_count(router.url, "fallback") == 1
    finally:
        router.stop()


def test_a_client_that_goes_away_drops_its_request_on_the_decode_server(stubs, router,
                                                                        upstreams):
    """As with one pool (tests/e2e/test_router_disconnect.py): the router closes its request to
    the decode server, which then aborts it; nothing is left in flight."""
    _, urls = upstreams
    body = json.dumps({"model": "m", "prompt": "hold until the client leaves",
                       "max_tokens": 16}).encode()
    head = ["POST /v1/completions HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {KEY}",
            "Content-Type: application/json", f"Content-Length: {len(body)}"]
    port = int(router.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        deadline = time.monotonic() + 30
        while not stubs["decode"].bodies:  # prefilled, now held by the decode server
            assert time.monotonic() < deadline, "the request never reached the decode server"
            time.sleep(0.01)
        sock.shutdown(socket.SHUT_RDWR)
    deadline = time.monotonic() + 30
    while not stubs["decode"].left:
        assert time.monotonic() < deadline, "the decode server is still holding the request"
        time.sleep(0.01)
    assert stubs["decode"].left == [True]
    labels = f'{{replica="{urls["decode"]}"}}'
    assert metric(router, "deepinfer_router_in_flight", labels) == 0.0


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body,headers", [
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": MESSAGES}, AUTH),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": MESSAGES}, {"x-api-key": KEY}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": MESSAGES}, {"x-api-key": KEY}),
    ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 8}, AUTH),
])
def test_requests_without_kv_transfer_params_go_whole_to_a_decode_server(stubs, router, path,
                                                                         body, headers):
    """The messages, count_tokens and responses request types take no kv_transfer_params (nor
    max_tokens, for some): they reach one decode server unchanged, which computes the prompt.
    An Anthropic client's x-api-key opens /v1/messages* as on a server."""
    content = json.dumps(body).encode()
    r = httpx.post(f"{router}{path}", content=content, timeout=30,
                   headers={**headers, "content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert stubs["prefill"].bodies == [] and stubs["decode"].bodies == [content]


def test_a_body_over_the_servers_limit_is_refused_before_anything_is_sent(stubs, router):
    from deepinfer.frontend.server.http_io import DEFAULT_MAX_BODY_BYTES

    prompt = "x" * DEFAULT_MAX_BODY_BYTES
    r = post(router, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    assert stubs["prefill"].bodies == [] and stubs["decode"].bodies == []


@pytest.mark.parametrize("path", ["/v1/models", "/version", "/openapi.json"])
def test_a_router_without_a_key_passes_the_clients_key_on(stubs, upstreams, path):
    """Replicas with keys behind a router without one: the client's key reaches them (the
    router's own empty one did, and every /v1/models was a 401)."""
    _, urls = upstreams
    router, _ = start_router([urls["prefill"]], [urls["decode"]])
    try:
        r = httpx.get(f"{router.url}{path}", headers={"Authorization": "Bearer client"},
                      timeout=10)
        assert r.status_code == 200 and r.json()["path"] == path
        assert [*stubs["prefill"].auth, *stubs["decode"].auth] == ["Bearer client"]
    finally:
        router.stop()


@pytest.mark.parametrize("verb", ["load", "unload"])
def test_a_lora_adapter_update_reaches_every_server(stubs, router, verb):
    body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
    r = post(router, f"/v1/{verb}_lora_adapter", body)
    assert r.status_code == 200 and r.text.startswith("Success")
    assert stubs["prefill"].sent() == stubs["decode"].sent() == [body]
    stubs["decode"].fail_with = 400
    try:
        r = post(router, f"/v1/{verb}_lora_adapter", body)
    finally:
        stubs["decode"].fail_with = None
    assert r.status_code == 400 and r.json()["error"]["message"] == "no such adapter"
    assert len(stubs["prefill"].bodies) == len(stubs["decode"].bodies) == 2
    assert httpx.post(f"{router}/v1/{verb}_lora_adapter", json=body, timeout=10
                      ).status_code == 401


@pytest.mark.parametrize("kind", ["pd", "dp"])
def test_routers_make_the_servers_host_and_origin_checks(stubs, upstreams, monkeypatch, kind):
    """A router answers browsers as a server does (frontend/server/origin_checks.py): a rebound
    Host name and another site's page are refused before anything reaches a replica, in the
    API's own error shape; programs (no Origin) and --allowed-origins pass. Before, the routers
    had no such checks: a page could drive every server behind one."""
    from deepinfer.frontend.router import server as router_server

    apps: list[Starlette] = []
    monkeypatch.setattr(router_server.uvicorn, "run", lambda app, **kw: apps.append(app))
    _, urls = upstreams
    allowed = router_server.OriginPolicy.create("127.0.0.1", None, ["https://app.example"])
    if kind == "pd":
        router_server.run_pd_router([urls["prefill"]], [urls["decode"]], "127.0.0.1", 0,
                                    Policy(), api_key=KEY, origins=allowed)
    else:
        router_server.run_router([urls["decode"]], "127.0.0.1", 0, Policy(), api_key=KEY,
                                 origins=allowed)
    served = Served(apps[0])
    body = {"model": "m", "prompt": "hi", "max_tokens": 4}
    try:
        r = post(served.url, "/v1/completions", body)
        assert r.status_code == 200, r.text  # a program: no Origin, a loopback Host
        r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=10,
                       headers={**AUTH, "Host": "evil.example:8000"})
        assert r.status_code == 403 and "Host" in r.json()["error"]["message"]
        sent = len(stubs["decode"].bodies)
        r = httpx.post(f"{served.url}/v1/messages", timeout=10, json={"model": "m"},
                       headers={**AUTH, "Origin": "https://evil.example"})
        assert r.status_code == 403 and r.json()["type"] == "error"  # Anthropic's shape
        assert len(stubs["decode"].bodies) == sent
        r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=10,
                       headers={**AUTH, "Origin": "https://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == \
            "https://app.example"
    finally:
        served.stop()
