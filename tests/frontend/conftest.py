"""Fixtures for API tests against the in-process fake engine."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from deepinfer.frontend.server.app import build_app
from deepinfer.frontend.server.state import ServerState
from tests.frontend.server.fake_engine import MODEL, FakeEngineClient


@pytest.fixture()
def engine() -> FakeEngineClient:
    return FakeEngineClient(MODEL, context_len=64)


@pytest.fixture()
def state() -> ServerState:
    return ServerState(max_pending=8, model_aliases=("alias",))


@pytest.fixture()
def http(engine, state):
    with TestClient(build_app(state, lambda: engine)) as client:
        yield client
