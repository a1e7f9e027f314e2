"""--api-key: Bearer auth on every /v1 route of the server and the router; /health stays open."""

from __future__ import annotations

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from deepinfer.frontend.router.app import Router, build_router_app
from deepinfer.frontend.router.policy import Policy
from scripts.server_process import ServerProcess


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    proc = ServerProcess(tiny_model_dir, "--api-key", "s3cret", "--served-model-name", "tiny")
    try:
        yield proc
    finally:
        proc.stop()


def test_v1_routes_want_the_key_and_health_does_not(server):
    url = server.base_url
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
    wrong = httpx.post(f"{url}/v1/completions", timeout=10, json={"prompt": "hi"},
                       headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    # /metrics names the LoRA adapters and the traffic: the key too (a Prometheus scrape sends
    # it as a Bearer token).
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
    scrape = httpx.get(f"{url}/metrics", timeout=10, headers={"Authorization": "Bearer s3cret"})
    assert scrape.status_code == 200 and "deepinfer_" in scrape.text
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret")
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert out.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong").models.list()


def test_the_router_checks_the_key_before_it_routes():
    app = build_router_app(Router([], Policy(), api_key="s3cret"))
    with TestClient(app) as client:
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        assert client.get("/v1/models").status_code == 401
        authed = client.post("/v1/completions", json={"prompt": "x"},
                             headers={"Authorization": "Bearer s3cret"})
        assert authed.status_code == 503  # past the check: no replica to take it
        assert client.get("/health").status_code == 503  # open, and honest: no replica
