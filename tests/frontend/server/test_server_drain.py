"""SIGTERM drains a real server: new requests get 503 and /health says draining, requests in
flight finish, then the server exits 0 with no engine process left."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from scripts.server_process import ServerProcess, descendants, process_named


def test_sigterm_lets_requests_in_flight_finish_and_turns_new_ones_away(tiny_model_dir):
    srv = ServerProcess(tiny_model_dir, "--num-kv-blocks", "128", "--shutdown-timeout", "60")
    try:
        engine_pids = descendants(srv.proc.pid)
        worker = process_named(srv.proc.pid, "worker0")
        os.kill(worker, signal.SIGSTOP)  # holds the request in flight, however fast the machine
        result: dict[str, httpx.Response] = {}

        def in_flight() -> None:
            result["r"] = httpx.post(f"{srv.base_url}/v1/completions", timeout=120, json={
                "prompt": "Go on", "max_tokens": 40, "ignore_eos": True})

        thread = threading.Thread(target=in_flight)
        thread.start()
        time.sleep(0.5)
        assert thread.is_alive()
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            health = httpx.get(f"{srv.base_url}/health", timeout=5)
            if health.status_code == 503:
                break
            time.sleep(0.1)
        assert health.json() == {"status": "draining"}
        late = httpx.post(f"{srv.base_url}/v1/completions", timeout=10,
                          json={"prompt": "Hi", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert thread.is_alive() and srv.proc.poll() is None
        os.kill(worker, signal.SIGCONT)
        thread.join(60)
        body = result["r"].json()
        assert result["r"].status_code == 200 and body["usage"]["completion_tokens"] == 40
        assert srv.proc.wait(30) == 0
        time.sleep(0.5)
        assert not [p for p in engine_pids if os.path.exists(f"/proc/{p}")]
    finally:
        srv.stop()
