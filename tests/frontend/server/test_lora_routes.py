"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter against an in-process fake engine:
vLLM's bodies and answers, the set of served models following them, bad input as 400s naming
the field, and the endpoints off without --allow-runtime-lora-updating. (tests/e2e/test_lora.py
runs them against the real processes.)"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from deepinfer.frontend.server.app import build_app
from deepinfer.frontend.server.state import ServerState
from tests.frontend.server.fake_engine import MODEL, FakeEngineClient


@pytest.fixture
def served():
    engine = FakeEngineClient()
    state = ServerState(8, lora_adapters={"a": "/adapters/a"}, allow_lora_updates=True)
    with TestClient(build_app(state, lambda: engine)) as http:
        yield http, engine


def models(http) -> list[tuple[str, str | None]]:
    return [(m["id"], m["parent"]) for m in http.get("/v1/models").json()["data"]]


def test_a_loaded_adapter_is_served_and_an_unloaded_one_is_not(served):
    http, engine = served
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/adapters/c"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' added successfully."
    assert models(http) == [(MODEL, None), ("a", MODEL), ("c", MODEL)]
    r = http.post("/v1/completions", json={"model": "c", "prompt": "x y", "max_tokens": 2})
    assert r.status_code == 200 and engine.requests[-1].params.lora == "c"
    assert "deepinfer_lora_load_seconds_count 1.0" in http.get("/metrics").text
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' removed successfully."
    assert models(http) == [(MODEL, None), ("c", MODEL)]
    r = http.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert [(u.name, u.path, u.unload) for u in engine.lora_updates] == [
        ("c", "/adapters/c", False), ("a", "", True)]


@pytest.mark.parametrize(("path", "body", "status", "param", "message"), [
    ("load", {"lora_name": "c", "lora_path": "/adapters/bad"}, 400, "lora_path",
     "not a PEFT LoRA adapter"),
    ("load", {"lora_name": "a", "lora_path": "/adapters/a2"}, 400, "lora_name",
     "already loaded"),
    ("load", {"lora_name": MODEL, "lora_path": "/adapters/x"}, 400, "lora_name",
     "base model"),
    ("load", {"lora_name": "c"}, 400, "lora_path", "lora_path"),
    ("load", {"lora_name": "", "lora_path": "/x"}, 400, "lora_name", "length"),
    ("load", {"lora_name": 5, "lora_path": "/x"}, 400, "lora_name", "Expected `str`"),
    ("unload", {"lora_name": "zzz"}, 404, "lora_name", "no LoRA adapter 'zzz'"),
    ("unload", {}, 400, "lora_name", "lora_name"),
])
def test_bad_updates_are_refused_naming_the_problem(served, path, body, status, param, message):
    http, engine = served
    r = http.post(f"/v1/{path}_lora_adapter", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert models(http) == [(MODEL, None), ("a", MODEL)]  # nothing changed


def test_without_the_flag_the_endpoints_are_off():
    state = ServerState(8, lora_adapters={"a": "/adapters/a"})
    with TestClient(build_app(state, FakeEngineClient)) as http:
        for path in ("load", "unload"):
            r = http.post(f"/v1/{path}_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
            assert r.status_code == 404
            assert "--allow-runtime-lora-updating" in r.json()["error"]["message"]
        assert models(http) == [(MODEL, None), ("a", MODEL)]
