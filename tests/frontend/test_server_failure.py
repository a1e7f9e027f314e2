"""A real server whose engine dies: in-flight requests get a 5xx and the server exits non-zero."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from tests.frontend.server_process import ServerProcess, descendants


def test_engine_death_fails_requests_and_exits(tiny_model_dir):
    srv = ServerProcess(tiny_model_dir, "--num-kv-blocks", "128")
    try:
        engine_pids = descendants(srv.proc.pid)
        assert engine_pids
        result: dict[str, httpx.Response] = {}

        def long_request() -> None:
            result["r"] = httpx.post(
                f"{srv.base_url}/v1/completions",
                json={"prompt": "Go on", "max_tokens": 1000, "ignore_eos": True}, timeout=60)

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(0.5)  # the request is decoding
        os.kill(max(engine_pids), signal.SIGKILL)  # the last child started: a worker
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
