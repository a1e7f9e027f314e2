"""Bad input against a real server (a tiny model, a short context): schemathesis over the
server's own /openapi.json, a hypothesis fuzzer over request bodies, and the classic hostile
inputs. Nothing may answer 5xx or hang, and the server must serve normally afterwards with
every KV block back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scripts.server_process import ServerProcess

CONTEXT = 96
FIELDS = ["model", "prompt", "messages", "max_tokens", "n", "temperature", "top_p", "top_k",
          "min_p", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "seed",
          "stop_token_ids", "ignore_eos", "response_format", "guided_json", "guided_regex",
          "guided_choice", "tools", "tool_choice", "repetition_penalty", "frequency_penalty",
          "presence_penalty", "echo", "best_of", "logit_bias", "max_completion_tokens",
          "kv_transfer_params", "add_generation_prompt", "skip_special_tokens",
          # Anthropic's messages and OpenAI's responses
          "system", "stop_sequences", "thinking", "metadata", "input", "instructions",
          "max_output_tokens", "text", "reasoning", "previous_response_id", "store",
          "prompt_logprobs", "chat_template_kwargs", "reasoning_effort"]
APPROVED_ORIGIN = "https://app.example"  # --allowed-origins
ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
             "/v1/messages/count_tokens"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from scripts.tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path_factory.mktemp("fuzz"))
    s = ServerProcess(model, "--served-model-name", "tiny", "--max-model-len", str(CONTEXT),
                      "--num-kv-blocks", "64", "--worker-threads", "1",
                      "--allowed-origins", APPROVED_ORIGIN, "--allowed-hosts", "gpu.lan")
    try:
        yield s
    finally:
        s.stop()


def still_serving(url: str) -> None:
    """Health is 200, a normal request works, and every KV block is free again."""
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith(("deepinfer_kv_blocks_free ", "deepinfer_kv_blocks_total "))}
        if values["deepinfer_kv_blocks_free"] == values["deepinfer_kv_blocks_total"]:
            return
        assert time.monotonic() < deadline, values
        time.sleep(0.2)


@pytest.mark.slow  # (make test's 8-minute budget; the hypothesis fuzzing below stays)
def test_schemathesis_finds_no_server_error_or_schema_violation(server, tmp_path):
    """`st run` over every operation of /openapi.json with every check but
    positive_data_acceptance (a schema-valid body may still break a limit the schema cannot
    state: the context length, the tokenized prompt being empty, unsupported fields)."""
    st_bin = Path(sys.executable).with_name("st")
    result = subprocess.run(
        [str(st_bin), "run", f"{server.base_url}/openapi.json", "--checks", "all",
         "--exclude-checks", "positive_data_acceptance", "--workers", "1",
         "--max-examples", "25", "--seed", "1", "--request-timeout", "60"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,  # its .schemathesis/ there
        env=dict(os.environ, NO_COLOR="1", SCHEMATHESIS_TELEMETRY="false"))
    summary = result.stdout[-3000:]
    assert result.returncode == 0, summary
    paths = httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()["paths"]
    operations = sum(len(methods) for methods in paths.values())
    assert operations >= 11, paths.keys()  # chat, completions, messages, responses...
    # (one operation may go untested when every case it drew was rejected before sending)
    assert f"Tested: {operations}" in summary or f"Tested: {operations - 1}" in summary, summary
    still_serving(server.base_url)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=40)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), json_values,
                         max_size=8)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies, path=st.sampled_from(ENDPOINTS))
def test_fuzzed_bodies_never_get_a_server_error(server, body, path):
    for field in ("max_tokens", "max_output_tokens"):  # keep generation short
        if isinstance(body.get(field), int):
            body[field] = min(body[field], 8)
    body.pop("n", None)
    r = httpx.post(f"{server.base_url}{path}", timeout=60, json=body)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


@pytest.mark.parametrize("raw, status", [
    (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400),  # not JSON
    (b'{"model": "tiny", "prompt": "hi", "temperature": 1e400}', 400),  # infinity
    (b'{"model": "tiny", "prompt": "hi", "top_p": -1e400}', 400),
    (b'{"model": "tiny", "prompt": "hi", "frequency_penalty": 1e400}', 400),
    (b'{"model": "tiny", "prompt": "\xff\xfe bad utf-8"}', 400),
    (b'{"model": "tiny", "prompt": "hi", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     400),  # deeply nested
    (b'{"model": "tiny", "prompt": "' + b"word " * 2000 + b'"}', 400),  # past the context
    (b'{"model": "tiny", "prompt": [' + b"1," * 50 + b'99999999999]}', 400),  # bad token id
    (b'{"model": "tiny", "prompt": "' + b"x" * (9 << 20) + b'"}', 413),  # over the body limit
])
def test_hostile_inputs_get_a_clear_4xx(server, raw, status):
    r = httpx.post(f"{server.base_url}/v1/completions", content=raw, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text[:300]
    assert json.loads(r.text)["error"]["message"]


DEEP = b'{"a": ' * 1000 + b"1" + b"}" * 1000


@pytest.mark.parametrize("path, field", [
    ("/v1/chat/completions", "metadata"), ("/v1/completions", "response_format"),
    ("/v1/messages", "metadata"), ("/v1/messages/count_tokens", "cache_control"),
    ("/v1/responses", "prompt")])
def test_json_nested_a_thousand_deep_is_a_400(server, path, field):
    """A field that takes any JSON, nested past msgspec's depth guard (its RecursionError was
    a 500 with a traceback on every JSON route)."""
    raw = b'{"model": "tiny", "' + field.encode() + b'": ' + DEEP + b"}"
    r = httpx.post(f"{server.base_url}{path}", content=raw, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert "nested too deeply" in r.json()["error"]["message"]


def test_json_routes_want_a_json_body_type(server):
    """A web page's form can post text/plain or form bodies to any server without the browser
    asking first: the JSON routes refuse them (415, naming the header). JSON with a charset, and
    a body sent with no type at all (programs only), are served."""
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1})
    for declared in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        r = httpx.post(f"{server.base_url}/v1/completions", content=body, timeout=60,
                       headers={"content-type": declared})
        assert r.status_code == 415, r.text
        assert "application/json" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base_url}/v1/messages", content=body, timeout=60,
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["type"] == "error", r.text  # Anthropic's shape
    for declared in ("application/json; charset=utf-8", None):
        headers = {"content-type": declared} if declared else {}
        r = httpx.post(f"{server.base_url}/v1/completions", content=body, timeout=60,
                       headers=headers)
        assert r.status_code == 200, (declared, r.text)


def test_a_rebound_host_name_is_refused(server):
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 reaches the
    loopback-bound server as its own origin, but its requests name evil.example as Host."""
    port = server.port
    for path in ("/v1/models", "/health", "/metrics", "/"):
        r = httpx.get(f"{server.base_url}{path}", headers={"host": f"evil.example:{port}"},
                      timeout=10)
        assert r.status_code == 403, (path, r.text)
        assert "--allowed-hosts" in r.json()["error"]["message"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "gpu.lan"):
        r = httpx.get(f"{server.base_url}/v1/models", headers={"host": host}, timeout=10)
        assert r.status_code == 200, (host, r.text)


def test_cross_origin_browser_requests_are_refused(server):
    """A page on another origin may not drive the server (no --api-key needed for that): its
    requests, simple or preflighted, get a 403 in the API's shape; the server's own page (the
    same origin) and the --allowed-origins one are served, the latter with CORS headers."""
    url, body = server.base_url, {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    for origin in ("http://evil.example", "null", f"http://localhost:{server.port}"):
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"origin": origin}, timeout=60)
        assert r.status_code == 403, (origin, r.text)
        assert "--allowed-origins" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/messages", json=body, headers={"origin": "http://evil.example"},
                   timeout=60)
    assert r.status_code == 403 and r.json()["type"] == "error", r.text  # Anthropic's shape
    preflight = {"access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    r = httpx.options(f"{url}/v1/completions", timeout=10,
                      headers={"origin": "http://evil.example", **preflight})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"origin": url}, timeout=60)
    assert r.status_code == 200, r.text  # the page the server serves
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(f"{url}/v1/completions", timeout=10,
                      headers={"origin": APPROVED_ORIGIN, **preflight})
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == APPROVED_ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"origin": APPROVED_ORIGIN},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == APPROVED_ORIGIN


def engine_socket(pid: int, name: str) -> str:
    """The ipc:// address of the engine socket `name` that process `pid` bound (its private
    socket directory is found through the process's open sockets, /proc/net/unix)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[6] in inodes and fields[7].endswith(f"/{name}"):
            return f"ipc://{fields[7]}"
    raise LookupError(f"process {pid} has no socket named {name}")


def test_a_malformed_engine_frame_is_dropped_and_the_server_goes_on(server):
    """Frames on the API server's output socket that are no OutputBatch (a bug, or anyone who
    reaches the socket) are logged and dropped: the reader that answers every request goes on.
    It used to die silently, /health stayed 200 and no request was answered again."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(engine_socket(server.proc.pid, "client"))
    sock.send(b"\xc1 not msgpack")
    sock.send(msgspec.msgpack.encode(["OutputBatch", "not a list"]))
    sock.close()
    ctx.term()
    deadline = time.monotonic() + 20
    while server.output().count("dropped a malformed engine output frame") < 2:
        assert time.monotonic() < deadline, server.output()
        time.sleep(0.1)
    still_serving(server.base_url)


def test_the_server_still_serves_after_all_that(server):
    still_serving(server.base_url)
