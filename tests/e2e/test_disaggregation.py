"""Prefill/decode disaggregation with real processes: `deepinfer serve --prefill-servers 1
--decode-servers 1` (a router, a prefill server and a decode server, each with its engine
processes; KV moves between their workers over ZeroMQ tcp) against one plain `deepinfer serve`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time

import httpx
import msgspec
import numpy as np
import pytest

from deepinfer.engine.protocol import KVTransferParams
from deepinfer.engine.trust import ROUTER_HEADER, router_proof, sign_params
from scripts.server_process import (
    ServerProcess,
    disaggregation_roles,
    free_port,
    process_named,
)
from scripts.tiny_models import save_tiny_model

COMMON = ["--num-kv-blocks", "256", "--served-model-name", "tiny", "--kv-transfer-timeout",
          "10"]
# The PD topology's servers and router share it; tests that talk to a prefill or decode server
# directly play the router with it (`as_router`), as a member of the cluster.
SECRET = "pd-test-cluster-secret"
W = 8  # the sliding model's window: prompts here span several windows


def make_model(kind: str, root) -> object:
    if kind == "llama":
        return save_tiny_model(root)
    return save_tiny_model(root, "qwen3", num_hidden_layers=4, sliding_window=W,
                           use_sliding_window=True,
                           layer_types=["sliding_attention", "full_attention",
                                        "sliding_attention", "full_attention"])


class Topology:
    def __init__(self, model) -> None:
        self.plain = ServerProcess(model, *COMMON)
        self.pd = ServerProcess(model, *COMMON, "--prefill-servers", "1", "--decode-servers", "1",
                                env={"DEEPINFER_CLUSTER_SECRET": SECRET})
        self.roles = disaggregation_roles(self.pd.proc.pid)  # role -> (pid, url)
        assert set(self.roles) == {"prefill", "decode"}

    def url(self, role: str) -> str:
        return self.roles[role][1]

    def stop(self) -> None:
        self.pd.stop()
        self.plain.stop()


@pytest.fixture(scope="module", params=["llama", "sliding"])
def topology(request, tmp_path_factory):
    t = Topology(make_model(request.param, tmp_path_factory.mktemp(request.param)))
    try:
        yield t
    finally:
        t.stop()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    t = Topology(make_model("llama", tmp_path_factory.mktemp("llama-pd")))
    try:
        yield t
    finally:
        t.stop()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)[1])


def wait_idle(*urls: str, timeout: float = 30.0) -> None:
    """Every server's KV blocks free again and no transfer pending: nothing leaked."""
    deadline = time.monotonic() + timeout
    while True:
        state = [(metric(u, "deepinfer_kv_blocks_free"), metric(u, "deepinfer_kv_blocks_total"),
                  metric(u, "deepinfer_kv_transfers_pending")) for u in urls]
        if all(free == total and pending == 0 for free, total, pending in state):
            return
        assert time.monotonic() < deadline, f"blocks or transfers left: {state}"
        time.sleep(0.2)


def prompt_text(seed: int, words: int) -> str:
    rng = np.random.default_rng(seed)
    vocab = ["river", "stone", "light", "seven", "north", "paper", "glass", "quiet", "orbit",
             "amber", "field", "cloud", "metal", "tiger", "lemon", "piano"]
    return " ".join(rng.choice(vocab, words))


def complete(url: str, prompt: str, **extra) -> dict:
    r = as_router(url, {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                        **extra})
    assert r.status_code == 200, r.text
    return r.json()


def as_router(url: str, body: dict, path: str = "/v1/completions",
              secret: str = SECRET) -> httpx.Response:
    """POST `body` with the PD router's proof (under `secret`) that it wrote it."""
    content = json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, timeout=120, headers={
        "content-type": "application/json",
        ROUTER_HEADER: router_proof(secret.encode(), path, content)})


def resigned(params: dict, **changes) -> dict:
    """Transfer parameters changed and signed again, as a prefill server of the cluster would."""
    struct = msgspec.convert(params | changes, KVTransferParams)
    return msgspec.to_builtins(sign_params(SECRET.encode(), struct))


def stream_text(url: str, body: dict) -> str:
    import json

    text = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += [c["text"] for c in event["choices"]]
    return "".join(text)


def test_disaggregated_greedy_text_equals_one_plain_server(topology):
    blocks_before = metric(topology.url("decode"), "deepinfer_kv_transfer_blocks_total")
    for seed, words in [(0, 3), (1, 20), (2, 45), (3, 90)]:  # from part of a block to many
        prompt = prompt_text(seed, words)
        ref = complete(topology.plain.base_url, prompt, ignore_eos=True)
        out = complete(topology.pd.base_url, prompt, ignore_eos=True)
        assert out["choices"][0]["text"] == ref["choices"][0]["text"]
        assert out["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
        assert out["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"] == 12
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "stream": True}
        assert stream_text(topology.pd.base_url, body) == ref["choices"][0]["text"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": prompt_text(9, 30)}],
            "max_tokens": 10, "temperature": 0}
    ref = httpx.post(f"{topology.plain.base_url}/v1/chat/completions", json=chat, timeout=120)
    out = httpx.post(f"{topology.pd.base_url}/v1/chat/completions", json=chat, timeout=120)
    assert out.json()["choices"][0]["message"] == ref.json()["choices"][0]["message"]
    # The KV really moved (the decode server computed no prompt of its own).
    assert metric(topology.url("decode"), "deepinfer_kv_transfer_blocks_total") > blocks_before
    assert metric(topology.url("prefill"), "deepinfer_kv_transfer_bytes_total") > 0
    wait_idle(topology.url("prefill"), topology.url("decode"))


def test_the_decode_server_pulls_only_what_its_prefix_cache_lacks(llama):
    decode = llama.url("decode")
    rng = np.random.default_rng(5)
    for tokens, again in [(64, 0), (70, 1)]:  # 4 whole blocks; 4 and part of a fifth
        prompt = rng.integers(3, 40000, tokens).tolist()
        before = metric(decode, "deepinfer_kv_transfer_blocks_total")
        first = complete(llama.pd.base_url, prompt)["choices"][0]["text"]
        pulled = metric(decode, "deepinfer_kv_transfer_blocks_total") - before
        assert pulled == -(-tokens // 16)
        assert complete(llama.pd.base_url, prompt)["choices"][0]["text"] == first
        # Only what the decode server's own prefix cache lacks moves again.
        assert metric(decode, "deepinfer_kv_transfer_blocks_total") - before - pulled == again
    wait_idle(llama.url("prefill"), decode)


def test_disaggregated_seeded_sampling_equals_one_plain_server(llama):
    """The prefill server samples a seeded request's first token, the decode server the rest:
    each token's draw is keyed on the seed and its output index, as on one plain server, so
    the text is the same (a decode side that restarted the seed's draws would repeat token
    0's draw for token 1)."""
    texts = set()
    moved = metric(llama.url("decode"), "deepinfer_kv_transfer_blocks_total")
    for seed in (3, -42):
        prompt = prompt_text(100 + seed, 25)
        extra = dict(temperature=1.0, seed=seed, ignore_eos=True)
        ref = complete(llama.plain.base_url, prompt, **extra)["choices"][0]["text"]
        assert complete(llama.pd.base_url, prompt, **extra)["choices"][0]["text"] == ref
        texts.add(ref)
    assert len(texts) == 2  # it really sampled
    assert metric(llama.url("decode"), "deepinfer_kv_transfer_blocks_total") > moved
    wait_idle(llama.url("prefill"), llama.url("decode"))


def test_an_abort_during_the_transfer_frees_blocks_on_both_sides(llama):
    prefill, decode = llama.url("prefill"), llama.url("decode")
    prompt = prompt_text(11, 60)
    held = as_router(prefill, {
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    assert metric(prefill, "deepinfer_kv_transfers_pending") == 1  # held for the decode side
    worker = process_named(llama.roles["prefill"][0], "worker0")
    os.kill(worker, signal.SIGSTOP)  # the prefill's rank cannot answer the pull
    try:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8,
                           "temperature": 0, "stream": True, "kv_transfer_params": held})
        headers = {"content-type": "application/json",
                   ROUTER_HEADER: router_proof(SECRET.encode(), "/v1/completions",
                                               body.encode())}
        with httpx.stream("POST", f"{decode}/v1/completions", timeout=60, content=body,
                          headers=headers) as r:
            assert r.status_code == 200
            deadline = time.monotonic() + 20
            while metric(decode, "deepinfer_kv_transfers_pending") != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert metric(decode, "deepinfer_kv_blocks_free") < 256  # allocated, being pulled
        # The client went away mid-transfer: the decode side stops and frees its blocks...
        wait_idle(decode)
    finally:
        os.kill(worker, signal.SIGCONT)
    # ...and the prefill side, told the decode side gave up, frees the held ones.
    wait_idle(prefill)


def test_a_dead_prefill_server_fails_the_request_with_a_clear_error(llama):
    decode = llama.url("decode")
    prompt = prompt_text(12, 30)
    held = as_router(llama.url("prefill"), {
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    host, _, _ = held["addresses"][0].rpartition(":")
    gone = resigned(held, addresses=[f"{host}:{free_port()}#gone"])  # nothing listens there
    r = as_router(decode, {"model": "tiny", "prompt": prompt, "max_tokens": 8,
                           "temperature": 0, "kv_transfer_params": gone})
    assert r.status_code == 503
    assert "KV transfer failed" in r.json()["error"]["message"]
    assert "no answer" in r.json()["error"]["message"]
    # A bad request is a 400 naming the field, before anything moves.
    r = as_router(decode, {"model": "tiny", "prompt": prompt,
                           "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    wait_idle(decode)  # the failed request leaked nothing
    # The prefill server still holds the KV (until --kv-hold-timeout): a retry gets it.
    retry = complete(decode, prompt, max_tokens=8, ignore_eos=True, kv_transfer_params=held)
    assert retry["usage"]["completion_tokens"] == 8
    wait_idle(llama.url("prefill"), decode)


def test_two_hundred_concurrent_requests_through_one_prefill_and_one_decode_server(llama):
    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(client.post(
                f"{llama.pd.base_url}/v1/completions", json={
                    "model": "tiny", "prompt": prompt_text(100 + i, 8 + i % 40),
                    "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                    "stream": i % 2 == 0}) for i in range(200)))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 200
    for i, r in enumerate(responses):
        if i % 2:
            assert r.json()["usage"]["completion_tokens"] == 6
        else:
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    wait_idle(llama.url("prefill"), llama.url("decode"), timeout=60)


FAKE = {"do_remote_prefill": True, "transfer_id": "x", "addresses": ["tcp://127.0.0.1:1#n"],
        "block_ids": [[0, 1, 2]], "num_tokens": 40, "block_size": 16, "first_token": 7}


def refused(r: httpx.Response, why: str = "") -> bool:
    error = r.json()["error"]
    return (r.status_code == 400 and error["param"] == "kv_transfer_params"
            and why in error["message"])


def test_only_the_router_sets_kv_transfer_params(llama):
    """A client's kv_transfer_params are refused wherever it sends them (the review's repros:
    through the router's one-token fallback to a decode server, which pulled "prompt KV" from
    the client's own address; to a prefill server, which then held KV and handed its transfer
    socket's address out). Only the cluster's router proof opens the field, and only
    parameters a prefill server of the cluster signed are pulled."""
    prefill, decode = llama.url("prefill"), llama.url("decode")
    body = {"model": "tiny", "prompt": list(range(100, 140)), "max_tokens": 1,
            "kv_transfer_params": FAKE}
    for url in (llama.pd.base_url, decode):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert refused(r), r.text
    r = httpx.post(f"{prefill}/v1/completions", timeout=60, json=body | {
        "kv_transfer_params": {"do_remote_decode": True}})
    assert refused(r, "only the PD router")
    assert refused(as_router(decode, body, secret="another cluster"), "only the PD router")
    assert refused(as_router(decode, body), "signature")  # the router's proof, unsigned params
    # Signed, but with ids past int32 (one such request had killed the decode server).
    for field, value in (("block_ids", [[2**40]]), ("first_token", 2**40)):
        huge = KVTransferParams(**(FAKE | {field: value}))
        signed = msgspec.to_builtins(sign_params(SECRET.encode(), huge))
        assert refused(as_router(decode, body | {"kv_transfer_params": signed}), field)
    assert complete(decode, "still up", max_tokens=2)["usage"]["completion_tokens"] == 2
    wait_idle(prefill, decode)


def test_kv_of_another_prompt_never_enters_the_decode_servers_cache(llama):
    """The prefix-cache poisoning a review found: a prompt's KV handed to a decode server with
    another prompt of the same length would be filed under that prompt's tokens, and the next
    user of that prompt answered from the wrong KV. The prefill server's signature binds its
    parameters to the prompt it computed."""
    prefill, decode = llama.url("prefill"), llama.url("decode")
    rng = np.random.default_rng(77)
    attacker, victim = (rng.integers(3, 40000, 40).tolist() for _ in range(2))
    held = as_router(prefill, {"model": "tiny", "prompt": attacker, "max_tokens": 1,
                               "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
                     ).json()["kv_transfer_params"]
    r = as_router(decode, {"model": "tiny", "prompt": victim, "max_tokens": 4, "temperature": 0,
                           "kv_transfer_params": held})
    assert r.status_code == 400 and "another prompt" in r.json()["error"]["message"]
    ref = complete(llama.plain.base_url, victim, ignore_eos=True)["choices"][0]["text"]
    assert complete(decode, victim, ignore_eos=True)["choices"][0]["text"] == ref
    assert complete(llama.pd.base_url, victim, ignore_eos=True)["choices"][0]["text"] == ref
    r = as_router(decode, {"model": "tiny", "prompt": attacker, "max_tokens": 4,
                           "temperature": 0, "kv_transfer_params": held})
    assert r.status_code == 200  # the parameters were good for their own prompt
    wait_idle(prefill, decode)


def test_a_request_aborted_before_admission_frees_the_prefill_servers_hold(llama):
    """A decode request that waits for room and whose client leaves tells the prefill server
    at once; before, the prefill server kept the blocks until --kv-hold-timeout (120 s)."""
    prefill, decode = llama.url("prefill"), llama.url("decode")
    prompt = prompt_text(41, 60)
    held = as_router(prefill, {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                               "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
                     ).json()["kv_transfer_params"]
    assert metric(prefill, "deepinfer_kv_transfers_pending") == 1
    worker = process_named(llama.roles["decode"][0], "worker0")
    os.kill(worker, signal.SIGSTOP)  # the decode server's step stalls: requests queue up
    try:
        long = {"model": "tiny", "prompt": prompt_text(42, 20), "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": True,
                           "kv_transfer_params": held})
        headers = {"content-type": "application/json", ROUTER_HEADER: router_proof(
            SECRET.encode(), "/v1/completions", body.encode())}
        with httpx.stream("POST", f"{decode}/v1/completions", json=long, timeout=60):
            with httpx.stream("POST", f"{decode}/v1/completions", content=body,
                              headers=headers, timeout=60):
                time.sleep(1.0)  # both are in the scheduler; the worker holds the first
            # The pulled request's client left while it waited.
    finally:
        os.kill(worker, signal.SIGCONT)
    wait_idle(prefill, timeout=20)  # long before the 120 s hold timeout
    wait_idle(decode)


def test_a_request_a_decode_server_would_refuse_is_refused_before_any_kv_is_held(llama):
    """The prefill server sees every field the client sent (it had seen max_tokens as 1 and no
    stream_options): what a decode server would refuse (a value of the wrong type: unknown
    fields are ignored), it refuses before keeping any KV,
    which a client could otherwise pin for the hold timeout with each bad request."""
    prefill, prompt = llama.url("prefill"), prompt_text(51, 40)
    chat = [{"role": "user", "content": prompt}]
    cases = [
        ("/v1/completions", {"prompt": prompt, "max_tokens": 10**6}, "max_tokens"),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 8, "stream": True,
                             "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ("/v1/chat/completions", {"messages": chat, "max_completion_tokens": 10**6},
         "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 8, "stream": True,
                                  "stream_options": {"include_usage": [True]}}, "stream_options"),
    ]
    for path, body, param in cases:
        r = httpx.post(f"{llama.pd.base_url}{path}", json={"model": "tiny", **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text
    wait_idle(prefill, llama.url("decode"), timeout=20)  # not the 120 s hold timeout


class RefusingDecode:
    """A stand-in decode server that never takes a transfer: it answers every request with
    `status`, or ("wait") holds it until its client leaves."""

    def __init__(self, status: int | str) -> None:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        self.status, self.received = status, 0

        async def complete(request):
            await request.body()
            self.received += 1
            if self.status == "wait":
                while (await request.receive())["type"] != "http.disconnect":
                    pass
            return JSONResponse({"error": {"message": "refused", "type": "x", "param": None,
                                           "code": None}}, 503 if self.status == "wait"
                                else self.status)

        async def health(request):
            return JSONResponse({"status": "ok"})

        self.app = Starlette(routes=[Route("/v1/completions", complete, methods=["POST"]),
                                     Route("/health", health)])


@pytest.mark.parametrize("decode", [400, 503, "wait"])
def test_a_hold_no_decode_server_takes_is_released_at_once(llama, decode, monkeypatch):
    """The decode side refuses the request (a 400 for its own reason, a 503 from a full or
    failing server), or the client leaves before it answers: the router releases the prefill
    server's hold at once (it had stayed until --kv-hold-timeout, 120 s: four such requests
    left 8 of 48 blocks free and the next good request waited 119.7 s)."""
    from deepinfer.frontend.router.app import build_router_app
    from deepinfer.frontend.router.pd import PDRouter
    from deepinfer.frontend.router.policy import Policy
    from tests.frontend.router.served import Served

    monkeypatch.setenv("DEEPINFER_CLUSTER_SECRET", SECRET)
    prefill, stub = llama.url("prefill"), RefusingDecode(decode)
    refusing = Served(stub.app)
    router = Served(build_router_app(PDRouter([prefill], [refusing.url], Policy())))
    try:
        body = json.dumps({"model": "tiny", "prompt": prompt_text(52, 60), "max_tokens": 8}
                          ).encode()
        if decode == "wait":
            port = int(router.url.rsplit(":", 1)[1])
            head = ["POST /v1/completions HTTP/1.1", "Host: 127.0.0.1",
                    "Content-Type: application/json", f"Content-Length: {len(body)}"]
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
                deadline = time.monotonic() + 30
                while not stub.received:  # prefilled and handed to the decode side
                    assert time.monotonic() < deadline, "never reached the decode server"
                    time.sleep(0.02)
                sock.shutdown(socket.SHUT_RDWR)
        else:
            r = httpx.post(f"{router.url}/v1/completions", content=body, timeout=60,
                           headers={"content-type": "application/json"})
            assert r.status_code == (400 if decode == 400 else 503)
            assert stub.received == 1
        wait_idle(prefill, timeout=20)  # long before the 120 s hold timeout
    finally:
        router.stop()
        refusing.stop()


def test_a_released_transfer_is_not_served_to_a_replayed_pull(llama):
    """A decode request replayed with its router proof (valid for 5 minutes) pulled the same
    transfer again: the prefill rank served it until its next plan."""
    prefill, decode = llama.url("prefill"), llama.url("decode")
    prompt = prompt_text(53, 50)
    held = as_router(prefill, {
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": held}
    assert as_router(decode, body).status_code == 200
    wait_idle(prefill)  # pulled and released
    r = as_router(decode, body)
    assert r.status_code == 503 and "was released" in r.json()["error"]["message"], r.text
    wait_idle(prefill, decode)


def test_masked_tokens_logprobs_cross_to_the_decode_server(llama):
    """Structured output masks most tokens: their logprob is -inf, which JSON carries as null;
    the decode server refused the first token's logprobs (`Expected float, got null`)."""
    body = {"model": "tiny", "prompt": prompt_text(54, 20), "max_tokens": 6, "temperature": 0,
            "logprobs": 5, "response_format": {"type": "json_object"}}
    ref = httpx.post(f"{llama.plain.base_url}/v1/completions", json=body, timeout=60)
    out = httpx.post(f"{llama.pd.base_url}/v1/completions", json=body, timeout=60)
    assert ref.status_code == 200 and out.status_code == 200, out.text
    assert out.json()["choices"] == ref.json()["choices"]
    wait_idle(llama.url("prefill"), llama.url("decode"))


def test_every_endpoint_of_a_server_answers_through_both_routers(llama):
    """Each path and method a server's OpenAPI document lists reaches a server through the PD
    router and through a data-parallel router (one in this process, before the plain server):
    never the router's own 404 or 405; and the requests that cannot be split (messages,
    count_tokens, responses) are served whole (the PD router had added max_tokens and
    kv_transfer_params, which they refuse)."""
    from deepinfer.frontend.router.app import Router, build_router_app
    from deepinfer.frontend.router.policy import Policy
    from tests.frontend.router.served import Served

    paths = httpx.get(f"{llama.plain.base_url}/openapi.json", timeout=10).json()["paths"]
    dp = Served(build_router_app(Router([llama.plain.base_url], Policy())))
    chat = [{"role": "user", "content": prompt_text(55, 12)}]
    whole = [("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": chat}),
             ("/v1/messages/count_tokens", {"model": "tiny", "messages": chat}),
             ("/v1/responses", {"model": "tiny", "input": chat, "max_output_tokens": 4})]
    try:
        for base in (llama.pd.base_url, dp.url):
            for path in [*paths, "/openapi.json"]:
                for method in paths.get(path, {"get": None}):
                    url = base + path.replace("{response_id}", "resp_none")
                    r = httpx.request(method.upper(), url, timeout=60,
                                      json={} if method == "post" else None)
                    routed = "application/json" in r.headers.get("content-type", "") or \
                        r.status_code not in (404, 405)
                    assert routed, (base, method, path, r.status_code, r.text)
            for path, body in whole:
                r = httpx.post(f"{base}{path}", json=body, timeout=60)
                ref = httpx.post(f"{llama.plain.base_url}{path}", json=body, timeout=60)
                assert r.status_code == ref.status_code == 200, (base, path, r.text)
    finally:
        dp.stop()
    wait_idle(llama.url("prefill"), llama.url("decode"))
