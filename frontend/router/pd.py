"""Prefill/decode disaggregation behind one endpoint: the router splits each request over a pool
of prefill servers and a pool of decode servers (`deepinfer serve --disaggregation-mode ...`).

A completion or chat request first goes to a prefill server, the one the router's policy picks
(cache-aware by default: where the prompt's prefix is cached), as it came but not streamed and
marked `"kv_transfer_params": {"do_remote_decode": true}`: that server checks every field as a
decode server would (its own request validation, max_tokens and stream_options included: a bad
request is its 400 before any KV is kept), computes the prompt and one token, keeps the KV, and
answers with the transfer details in a top-level "kv_transfer_params". The original
request then goes to the least-loaded decode server (its cost is the batch it decodes; the prompt
arrives as KV, so a cached prefix there saves little) with that object added verbatim; the decode
server pulls the KV and writes the whole response, which reaches the client as the
data-parallel router relays it (frontend/router/app.py: the same health checks, retries and
streaming). A decode server that fails before answering is skipped like a data-parallel replica
and the next one gets the same kv_transfer_params: the prefill server holds the KV until one
pulls it. When none takes it (each refused it or failed, none could be reached, or the client
left first), the router releases it at once, as a decode server that gives up does (a `Release`
to each of the prefill server's transfer sockets, engine/kv_transfer_wire.py), instead of
leaving it held until the prefill server's --kv-hold-timeout.

Other requests (/v1/messages, count_tokens, /v1/responses: no kv_transfer_params there) go
whole to a decode server, which computes the prompt itself.

`kv_transfer_params` is the router's field: a client that sends it gets a 400. Every body the
router writes with it carries the router's proof (an HMAC under the cluster secret the servers
share, engine/trust.py), and the prefill server signs the parameters it answers with, so a
decode server pulls only from the prefill server the router chose, for this request's prompt.

Fallbacks, sent unchanged to a decode server, which then computes the prompt itself (right, just
not disaggregated): a body that is no JSON object; n > 1 or a batch of prompts (one KV handle
serves one sequence); prompt logprobs (only the server computing the prompt has its logits); at
most one token to generate (nothing left to decode); a prefill answer without kv_transfer_params
(the request ended on its first token, at EOS say); no prefill server able to take the request.
A prefill server's 4xx (a bad request) goes to the client as it is.
"""

from __future__ import annotations

import json
import logging

import zmq
from prometheus_client import Counter, Gauge
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer.engine import envs
from deepinfer.engine.kv_transfer_wire import sealed_release
from deepinfer.engine.trust import ROUTER_HEADER, router_proof
from deepinfer.frontend.router.app import Router, forward_headers, json_or_none, routing_text
from deepinfer.frontend.router.policy import Policy

log = logging.getLogger("deepinfer.router")
DISAGGREGATED, FALLBACK = "disaggregated", "fallback"
_PARAM = "kv_transfer_params"
SPLIT = ("/v1/completions", "/v1/chat/completions")  # the paths that take kv_transfer_params
_RELEASE_LINGER_MS = 2000  # how long a release may wait for its socket to connect
CLIENT_PARAMS = {"error": {"message": f"{_PARAM} is set by the router, not by clients",
                           "type": "invalid_request_error", "param": _PARAM, "code": None}}


def decode_only(path: str, payload: object) -> bool:
    """Whether a request goes straight to a decode server (the fallbacks above)."""
    if not isinstance(payload, dict) or payload.get("n") not in (None, 1):
        return True
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
        return True  # a batch of prompts (a list of token ids is one prompt)
    if payload.get("prompt_logprobs") is not None or (
            payload.get("echo") and payload.get("logprobs") is not None):
        return True  # prompt logprobs: the server computing the prompt must answer them
    limit = payload.get("max_tokens")
    if path.endswith("chat/completions") and payload.get("max_completion_tokens") is not None:
        limit = payload["max_completion_tokens"]  # the server reads it before max_tokens
    if limit is None:
        return False
    # Not a number: invalid, and the decode server says so in its own 400.
    return not isinstance(limit, int) or isinstance(limit, bool) or limit <= 1


def prefill_body(payload: dict) -> bytes:
    """The prefill server's request: the client's, every field kept so that the prefill server
    checks them all (it generates one token whatever max_tokens says), not streamed, its KV
    kept for a decode server."""
    return json.dumps(payload | {"stream": False, _PARAM: {"do_remote_decode": True}}).encode()


def signed(headers: dict[str, str], secret: bytes, path: str, body: bytes) -> dict[str, str]:
    """`headers` with the router's proof that it wrote `body` for `path`."""
    return headers | {ROUTER_HEADER: router_proof(secret, path, body)}


def transfer_params(response: Response) -> dict | None:
    """The kv_transfer_params of a prefill server's answer (None: it has none to hand over)."""
    answer = json_or_none(response.body) if 200 <= response.status_code < 300 else None
    params = answer.get(_PARAM) if isinstance(answer, dict) else None
    return params if isinstance(params, dict) else None


class PDRouter(Router):
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], policy: Policy,
                 health_interval: float = 1.0, api_key: str | None = None) -> None:
        # One pool to the base class (health loop, metrics per replica), two for placement.
        super().__init__([*prefill_urls, *decode_urls], policy, health_interval, api_key)
        self.secret = envs.cluster_secret()
        if self.secret is None:
            raise ValueError("the PD router needs the cluster secret its servers have "
                             "(DEEPINFER_CLUSTER_SECRET)")
        self.prefill = self.replicas[:len(prefill_urls)]
        self.decode = self.replicas[len(prefill_urls):]
        self.decode_policy = Policy("least_load")
        self.zctx = zmq.Context.instance()
        self.released = Counter(
            "deepinfer_router_pd_released", "prefill holds the router released because no "
            "decode server took them", registry=self.registry)
        self.pd_requests = Counter(
            "deepinfer_router_pd_requests", "requests served by a prefill then a decode server "
            "(disaggregated) or by a decode server alone (fallback)", ["path"],
            registry=self.registry)
        for path in (DISAGGREGATED, FALLBACK):
            self.pd_requests.labels(path)  # both series from the start, at 0
        role = Gauge("deepinfer_router_replica_role", "1 on each replica's pool",
                     ["replica", "role"], registry=self.registry)
        for name, pool in (("prefill", self.prefill), ("decode", self.decode)):
            for r in pool:
                role.labels(r.url, name).set(1)

    async def proxy(self, request: Request, body: bytes) -> Response:
        payload = json_or_none(body)
        if isinstance(payload, dict) and _PARAM in payload:
            return JSONResponse(CLIENT_PARAMS, status_code=400)
        if request.url.path not in SPLIT:
            return await self.whole(request, body, self.decode)
        if not any(r.healthy for r in self.decode):  # else a prefill server holds KV for none
            return self.unavailable(self.decode)
        path, headers = request.url.path, forward_headers(request)
        text = routing_text(path, payload)
        params = None
        if not decode_only(path, payload):
            headers["content-type"] = "application/json"  # the router writes the bodies now
            first = prefill_body(payload)
            prefill = await self.place(self.prefill, self.policy, text, path, first,
                                       signed(headers, self.secret, path, first), stream=False)
            if prefill is None:
                log.warning("no prefill server could take a request: its decode server "
                            "computes the prompt")
            elif not 200 <= prefill.status_code < 300:
                return prefill  # the request's own fault: the client's to see
            elif (params := transfer_params(prefill)) is not None:
                body = json.dumps(payload | {_PARAM: params}).encode()
                headers = signed(headers, self.secret, path, body)
        self.pd_requests.labels(FALLBACK if params is None else DISAGGREGATED).inc()
        stream = isinstance(payload, dict) and bool(payload.get("stream"))
        response = None
        try:
            response = await self.place(self.decode, self.decode_policy, text, path, body,
                                        headers, stream)
        finally:  # cancelled too (the client left): the held KV waits for nobody
            if params is not None and (response is None
                                       or not 200 <= response.status_code < 300):
                self.release(params)
        return self.unavailable(self.decode) if response is None else response

    def release(self, params: dict) -> None:
        """Tell each rank of the prefill server that holds `params`' KV that no decode server
        will pull it. Sent in the background (ZeroMQ queues it while it connects)."""
        transfer_id, addresses = params.get("transfer_id"), params.get("addresses")
        if not isinstance(transfer_id, str) or not isinstance(addresses, list):
            return
        self.released.inc()
        for address in addresses:
            if not isinstance(address, str):
                continue
            endpoint, frames = sealed_release(self.secret, address, transfer_id)
            sock = self.zctx.socket(zmq.DEALER)
            try:
                sock.setsockopt(zmq.LINGER, _RELEASE_LINGER_MS)
                sock.connect(endpoint)
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.warning("could not release transfer %s at %s: %s", transfer_id, endpoint,
                            exc)
            finally:
                sock.close()  # what it queued still goes, for up to the linger time

    async def health(self, request: Request) -> Response:
        """200 while each pool has a healthy server: a request needs one of each."""
        pools = {"prefill": self.prefill, "decode": self.decode}
        counts = {name: {"healthy": sum(r.healthy for r in pool), "replicas": len(pool)}
                  for name, pool in pools.items()}
        up = all(c["healthy"] for c in counts.values())
        return JSONResponse({"healthy_replicas": sum(r.healthy for r in self.replicas),
                             "replicas": len(self.replicas), **counts},
                            status_code=200 if up else 503)
