"""Bearer-token access control shared by the API server and the router: with a key set
(`--api-key`, or DEEPINFER_API_KEY), every /v1 route wants `Authorization: Bearer <key>` (the
Anthropic routes, /v1/messages*, take `x-api-key: <key>` as well) and answers 401 otherwise;
so does the API server's /metrics (it names the LoRA adapters and the traffic; Prometheus sends
the key with `authorization: {credentials: KEY}` in its scrape config); /health and /version
stay open (service managers need them)."""

from __future__ import annotations

import hmac
import os


def resolve_api_key(flag: str | None) -> str | None:
    return flag or os.environ.get("DEEPINFER_API_KEY") or None


def authorized(api_key: str | None, path: str, authorization: str | None,
               x_api_key: str | None = None, guarded: bool = False) -> bool:
    """`x_api_key`: the `x-api-key` header, which Anthropic's clients send instead of a Bearer
    token; taken on the /v1/messages routes only. `guarded`: a route outside /v1 that wants the
    key all the same."""
    if not api_key or not (guarded or path.startswith("/v1")):
        return True
    if (x_api_key is not None and path.startswith("/v1/messages")
            and hmac.compare_digest(x_api_key.encode(), api_key.encode())):
        return True
    expected = f"Bearer {api_key}".encode()
    return hmac.compare_digest((authorization or "").encode(), expected)


UNAUTHORIZED = {"error": {"message": "invalid or missing API key (Authorization: Bearer ...)",
                          "type": "invalid_request_error", "param": None,
                          "code": "invalid_api_key"}}
