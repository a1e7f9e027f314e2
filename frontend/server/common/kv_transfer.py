"""Prefill/decode disaggregation at the API: the `kv_transfer_params` request field (vLLM's
name) and the one a prefill server's response carries.

- `{"do_remote_decode": true}` to a `--disaggregation-mode prefill` server: compute the prompt and
  its first token only (max_tokens becomes 1) and keep the KV; the response's
  `kv_transfer_params` says where it is (absent when the request ended for good on that token),
  signed with the cluster secret and bound to the prompt's tokens (engine/trust.py).
- That object, verbatim (it says `"do_remote_prefill": true`), to a `--disaggregation-mode
  decode` server with the original request: pull the KV and continue; the response is the
  whole ordinary one, first token included.

Only the PD router may send the field: a request carrying it must carry the router's proof
(an HMAC of its body under the cluster secret), and a decode server takes only parameters a
prefill server of its cluster signed. Anything else is a 400 naming the field.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from starlette.requests import Request

from deepinfer.engine import envs
from deepinfer.engine.protocol import KVTransferParams, SamplingParams
from deepinfer.engine.trust import (
    ROUTER_HEADER,
    TrustError,
    check_params,
    check_router_proof,
    sign_params,
)
from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.state import ServerState

_PARAM = "kv_transfer_params"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise APIError(f"{_PARAM}: {message}", param=_PARAM)


def apply_kv_transfer(request: Request, raw: dict[str, Any] | None, params: SamplingParams,
                      state: ServerState, n: int, stream: bool) -> SamplingParams:
    """`params` with the request's disaggregation role; a 400 naming the field when the sender
    is not the PD router or this server cannot play the role. `request`: its body read
    (http_io.read_body), for the router's proof."""
    if not raw:
        return params
    secret = envs.cluster_secret()
    _check(check_router_proof(secret, request.url.path, request.state.body,
                              request.headers.get(ROUTER_HEADER)),
           "only the PD router (deepinfer router --prefill ... --decode ...) may set this field")
    mode = getattr(state.client, "disaggregation_mode", "none")
    if raw.get("do_remote_decode"):
        _check(mode == "prefill", "do_remote_decode needs a server started with "
                                  "--disaggregation-mode prefill")
        _check(n == 1, "do_remote_decode takes one choice (n = 1)")
        _check(not stream, "do_remote_decode answers once: stream must be false")
        return msgspec.structs.replace(params, remote_decode=True, max_tokens=1)
    if raw.get("do_remote_prefill"):
        _check(mode == "decode", "do_remote_prefill needs a server started with "
                                 "--disaggregation-mode decode")
        _check(n == 1, "do_remote_prefill takes one choice (n = 1)")
        if params.prompt_logprobs is not None:  # (the PD router never sends such a request)
            raise APIError("prompt logprobs (prompt_logprobs, or echo with logprobs) need the "
                           "prompt computed here, not pulled from a prefill server",
                           param="prompt_logprobs")
        try:
            remote = msgspec.convert(_with_infinities(raw), KVTransferParams)
            check_params(secret, remote)
        except (msgspec.ValidationError, TrustError) as exc:
            raise APIError(f"{_PARAM}: {exc}", param=_PARAM) from None
        ranks = state.client.worker_ranks
        _check(len(remote.addresses) == ranks,
               f"the prefill server has {len(remote.addresses)} worker ranks, this one {ranks} "
               "(their --tensor-parallel-size must match)")
        return msgspec.structs.replace(params, remote_prefill=remote)
    return params


def _with_infinities(raw: dict[str, Any]) -> dict[str, Any]:
    """The parameters as the prefill server signed them: JSON has no -inf, so the logprob of a
    token that structured output or a stop masked reached us as null (the signature, over the
    original, still checks that nothing else changed)."""
    first = raw.get("first_logprobs")
    if not isinstance(first, list) or len(first) < 2:  # SampledLogprobs travels as an array
        return raw

    def restored(x: object) -> object:
        return -math.inf if x is None else x

    first = [*first]
    first[1] = restored(first[1])
    if len(first) > 3 and isinstance(first[3], list):
        first[3] = [restored(x) for x in first[3]]
    return raw | {"first_logprobs": first}


def response_params(held: KVTransferParams | None, state: ServerState
                    ) -> dict[str, Any] | msgspec.UnsetType:
    """A prefill server's answer: where its workers hold the prompt's KV, signed."""
    if held is None:
        return msgspec.UNSET
    located = msgspec.structs.replace(held, addresses=list(state.client.kv_transfer_addresses))
    return msgspec.to_builtins(sign_params(envs.cluster_secret(), located))
