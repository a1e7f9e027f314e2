"""A real server whose engine dies: in-flight requests get a 5xx and the server exits non-zero;
one whose engine cannot start prints one error line and exits 1 before uvicorn starts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file
from starlette.testclient import TestClient

from deepinfer.engine.runtime.launcher import EngineStartupError
from scripts.server_process import ServerProcess, descendants, free_port, process_named
from tests.frontend.server.fake_engine import FakeEngineClient


def test_engine_death_fails_requests_and_exits(tiny_model_dir):
    srv = ServerProcess(tiny_model_dir, "--num-kv-blocks", "128")
    try:
        engine_pids = descendants(srv.proc.pid)
        worker = process_named(srv.proc.pid, "worker0")
        # A stopped worker cannot finish the request however fast the machine is: it is
        # certainly in flight when the worker dies.
        os.kill(worker, signal.SIGSTOP)
        result: dict[str, httpx.Response] = {}

        def long_request() -> None:
            result["r"] = httpx.post(
                f"{srv.base_url}/v1/completions",
                json={"prompt": "Go on", "max_tokens": 1000, "ignore_eos": True}, timeout=60)

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(0.5)  # the request reaches the engine; it cannot finish there
        assert thread.is_alive()
        os.kill(worker, signal.SIGKILL)
        thread.join(30)
        assert result["r"].status_code == 503, result["r"].text
        assert "engine" in result["r"].json()["error"]["message"]
        try:
            assert httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass  # already gone, as intended
        srv.proc.wait(30)
        assert srv.proc.returncode != 0
        assert "engine failed" in srv.output()
        time.sleep(0.5)
        assert not [p for p in engine_pids if os.path.exists(f"/proc/{p}")]
    finally:
        srv.stop()


# --- Start-up failures: one line, exit code 1, before uvicorn starts --------------------------

def _serve_failing(model: Path, timeout: float = 60.0) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "deepinfer", "serve", "--model", str(model),
           "--port", str(free_port())]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)
    return proc, time.monotonic() - t0


def _assert_one_error_line(proc: subprocess.CompletedProcess, *causes: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "Traceback" not in output, output
    assert "Uvicorn running" not in output and "Waiting for application startup" not in output
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, output
    assert errors[0].startswith("deepinfer: error: "), output
    for cause in causes:
        assert cause in errors[0], output


def test_missing_model_dir_is_one_line():
    proc, took = _serve_failing(Path("/nonexistent"))
    _assert_one_error_line(proc, "/nonexistent does not exist", "deepinfer prepare-model")
    assert took < 20, took  # no engine was started


def test_unsupported_architecture_is_one_line(default_model, tmp_path):
    model = tmp_path / "foo"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        if (default_model / name).exists():
            shutil.copy(default_model / name, model / name)
    config = json.loads((default_model / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    save_file({"x": np.zeros(1, np.float32)}, str(model / "model.safetensors"))
    proc, took = _serve_failing(model)
    _assert_one_error_line(proc, "worker0", "FooForCausalLM", "not supported")
    assert took < 60, took


class _FailingClient(FakeEngineClient):
    async def start(self, on_failure=None) -> None:
        raise EngineStartupError("worker0 failed to start: ModelConfigError: nope")


def test_the_engine_starts_before_serving_and_once():
    import asyncio

    from deepinfer.frontend.server.app import build_app, start_engine
    from deepinfer.frontend.server.state import ServerState

    made: list[FakeEngineClient] = []

    def factory() -> FakeEngineClient:
        made.append(FakeEngineClient())
        return made[-1]

    state = ServerState(8)
    app = build_app(state, factory)
    asyncio.run(start_engine(app))
    assert len(made) == 1 and made[0].started and state.client is made[0]
    with TestClient(app) as http:  # the lifespan does not start a second engine
        assert http.get("/health").status_code == 200
    assert len(made) == 1 and made[0].stopped

    failing = _FailingClient()
    app = build_app(ServerState(8), lambda: failing)
    with pytest.raises(EngineStartupError, match="ModelConfigError: nope"):
        asyncio.run(start_engine(app))
    assert failing.stopped  # whatever it had started is stopped
