"""GET /v1/audit through the router: every healthy replica's exactness audit added up, each
latest divergence naming its replica, the client's key passed on (a refusal answers for all)."""

from __future__ import annotations

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deepinfer.frontend.router.app import Router, build_router_app
from deepinfer.frontend.router.policy import Policy
from tests.frontend.router.served import Served


def replica(answer: dict, key: str | None = None) -> Served:
    async def audit(request: Request) -> Response:
        if key is not None and request.headers.get("authorization") != f"Bearer {key}":
            return JSONResponse({"error": {"message": "unauthorized"}}, 401)
        return JSONResponse(answer)

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    return Served(Starlette(routes=[Route("/v1/audit", audit), Route("/health", health)]))


def divergence(rid: str, shortcut: str) -> dict:
    return {"request_id": rid, "shortcuts": [shortcut], "position": 2,
            "max_logprob_diff": 0.5, "num_tokens": 8}


def test_the_replicas_audits_are_added_up():
    a = replica({"requests": 5, "pending": 1, "divergences": {"prefix_disk": 2},
                 "max_logprob_diff": 0.5, "latest": [divergence("x", "prefix_disk")]})
    b = replica({"requests": 3, "pending": 0, "divergences": {"prefix_disk": 1, "batch": 1},
                 "max_logprob_diff": 0.25, "latest": [divergence("y", "batch")]})
    router = Served(build_router_app(Router([a.url, b.url], Policy())))
    try:
        body = httpx.get(f"{router.url}/v1/audit", timeout=10).json()
        assert body["requests"] == 8 and body["pending"] == 1
        assert body["divergences"] == {"prefix_disk": 3, "batch": 1}
        assert body["max_logprob_diff"] == 0.5
        assert [(d["request_id"], d["replica"]) for d in body["latest"]] == [
            ("x", a.url), ("y", b.url)]
    finally:
        for s in (router, a, b):
            s.stop()


def test_the_clients_key_goes_to_the_replicas():
    a = replica({"requests": 1, "pending": 0, "divergences": {}, "max_logprob_diff": 0.0,
                 "latest": []}, key="k")
    router = Served(build_router_app(Router([a.url], Policy())))
    try:
        assert httpx.get(f"{router.url}/v1/audit", timeout=10).status_code == 401
        ok = httpx.get(f"{router.url}/v1/audit", headers={"Authorization": "Bearer k"},
                       timeout=10)
        assert ok.status_code == 200 and ok.json()["requests"] == 1
    finally:
        router.stop()
        a.stop()
