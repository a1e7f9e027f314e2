"""`deepinfer router` in front of a real `deepinfer serve`: a client that goes away, streaming
or not, must abort its request on the replica, as it does when it talks to the server directly.

A raw socket is the client (a client library's habits would blur the test: the connection must
really close); the replica's own /metrics say whether the request was aborted or ran to its end.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from scripts.server_process import ServerProcess
from tests.conftest import LONG_CONTEXT, NEVER_ENDING

# The client leaves once the replica has decoded LEAVE_AFTER tokens: a streaming client that
# never read them has by then filled every buffer on the way, so the router sits in a send to
# it. MAX_TOKENS is minutes of decoding more: the abort cannot race the request's natural end
# (CI once saw a 6000-token request nearly run out).
LEAVE_AFTER, MAX_TOKENS = 1000, NEVER_ENDING


@pytest.fixture(scope="module")
def replica(long_tiny_model_dir):
    # No limit on a slow reader within MAX_TOKENS: only the disconnect may end the request.
    server = ServerProcess(long_tiny_model_dir, "--num-kv-blocks", str(LONG_CONTEXT // 16 + 16),
                           "--max-model-len", str(LONG_CONTEXT),
                           "--max-buffered-outputs", str(MAX_TOKENS + 64),
                           "--served-model-name", "tiny")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def router(replica):
    proc = ServerProcess(None, "--worker", replica.base_url, command="router", timeout=60)
    try:
        yield proc
    finally:
        proc.stop()


def scrape(http: httpx.Client) -> dict[str, float]:
    """Every unlabelled metric of one /metrics scrape."""
    text = http.get("/metrics").text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#") and "{" not in line}


def raw_post(port: int, path: str, body: bytes) -> socket.socket:
    """A socket that has sent one complete HTTP/1.1 POST, and will not read the answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # so that it fills soon
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {len(body)}"]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    return sock


def wait_for(http: httpx.Client, ready, what: str) -> dict[str, float]:
    """Scrape (on one connection) until `ready(metrics)`; the deadline only guards a hang."""
    deadline = time.monotonic() + 300
    while not ready(m := scrape(http)):
        assert time.monotonic() < deadline, f"{what}: {m}"
        time.sleep(0.01)
    return m


def router_in_flight(router: ServerProcess) -> float:
    text = httpx.get(f"{router.base_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("deepinfer_router_in_flight{"))


@pytest.mark.parametrize("stream", [False, True], ids=["non_streaming", "streaming"])
def test_a_client_that_goes_away_aborts_its_request_on_the_replica(replica, router, stream):
    body = json.dumps({"model": "tiny", "prompt": "Count forever", "max_tokens": MAX_TOKENS,
                       "ignore_eos": True, "stream": stream}).encode()
    with httpx.Client(base_url=replica.base_url, timeout=10) as http:
        before = scrape(http)
        sock = raw_post(router.port, "/v1/completions", body)
        try:
            wait_for(http, lambda m: m["deepinfer_engine_steps_total"]
                     >= before["deepinfer_engine_steps_total"] + LEAVE_AFTER,
                     "the request never got going on the replica")
            sock.shutdown(socket.SHUT_RDWR)  # the client really goes away
        finally:
            sock.close()
        after = wait_for(http, lambda m: m["deepinfer_requests_in_flight"] == 0
                         and m["deepinfer_num_requests_running"] == 0,
                         "the replica never finished the request")
    generated, slow = "deepinfer_generation_tokens_total", "deepinfer_slow_reader_aborts_total"
    # Aborted soon after the client left, not run to its MAX_TOKENS; by the disconnect, not by
    # the replica's own limit on a slow reader.
    assert after[generated] - before[generated] < MAX_TOKENS / 2, router.output()
    assert after[slow] == before[slow]
    assert router_in_flight(router) == 0
