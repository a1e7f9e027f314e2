"""Trust between DeepInfer's own servers and nodes: one shared secret, the cluster secret
(DEEPINFER_CLUSTER_SECRET, or a file named by --cluster-secret-file), never a client's.

What it authenticates (README "Security"):
- Router-only request fields: the PD router proves a request body is its own with an HMAC
  header (`router_proof`); a server takes `kv_transfer_params` only with a valid one.
- Prefill/decode transfer parameters: a prefill server signs where it holds a prompt's KV
  (`sign_params`), bound to the prompt's tokens (`prompt_digest`), so a decode server only
  pulls from a prefill server of its cluster, and only files blocks under the tokens that
  server computed them for.
- Transfer sockets: every message between two servers' worker ranks carries an HMAC
  (`message_mac`), so only cluster members read or release held KV.
- Multi-node plan sockets: ZeroMQ CURVE with keys derived from the secret (`curve_keys`), so
  only cluster nodes connect (a PUSH socket deals plans to whoever connects).

Pure functions of their arguments (hashlib, hmac): no sockets, no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import time

import msgspec
import numpy as np

# The header the PD router puts on a request body it wrote: "<unix seconds>.<hex HMAC>".
ROUTER_HEADER = "x-deepinfer-router-auth"
# How old (or how far ahead, clocks differ) a router proof may be: a captured request cannot be
# replayed after this.
ROUTER_PROOF_SKEW = 300.0


class TrustError(ValueError):
    """A peer's claim failed its check (one line, safe to show to the peer)."""


def mac(secret: bytes, purpose: str, *parts: bytes) -> bytes:
    """HMAC-SHA256 over length-prefixed parts, under a purpose label (a MAC made for one use is
    never valid for another)."""
    h = hmac.new(secret, purpose.encode(), hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def router_proof(secret: bytes, path: str, body: bytes, now: float | None = None) -> str:
    stamp = str(int(time.time() if now is None else now))
    return f"{stamp}.{mac(secret, 'router', stamp.encode(), path.encode(), body).hex()}"


def check_router_proof(secret: bytes | None, path: str, body: bytes, proof: str | None,
                       now: float | None = None) -> bool:
    """Whether `proof` is the router's for this path and body, made within the allowed skew."""
    if not secret or not proof:
        return False
    stamp, _, digest = proof.partition(".")
    try:
        age = abs((time.time() if now is None else now) - int(stamp))
        expected = mac(secret, "router", stamp.encode(), path.encode(), body)
        return age <= ROUTER_PROOF_SKEW and hmac.compare_digest(bytes.fromhex(digest), expected)
    except ValueError:
        return False


def prompt_digest(prompt_ids: np.ndarray) -> str:
    """What a prompt's KV is keyed on across servers: its int32 token ids, hashed."""
    return hashlib.sha256(np.ascontiguousarray(prompt_ids, dtype=np.int32).tobytes()).hexdigest()


def _unsigned(params: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(msgspec.structs.replace(params, signature=""))


def sign_params(secret: bytes, params: msgspec.Struct) -> msgspec.Struct:
    """`params` (KVTransferParams) with its signature over every other field."""
    return msgspec.structs.replace(params, signature=mac(secret, "kv-params",
                                                         _unsigned(params)).hex())


def check_params(secret: bytes | None, params: msgspec.Struct) -> None:
    """Raise TrustError unless a prefill server of this cluster signed `params` as they are."""
    if not secret:
        raise TrustError("this server has no cluster secret to check them with")
    try:
        given = bytes.fromhex(params.signature)
    except ValueError:
        given = b""
    if not hmac.compare_digest(given, mac(secret, "kv-params", _unsigned(params))):
        raise TrustError("their signature is not a prefill server's of this cluster")


def message_mac(secret: bytes, purpose: str, nonce: str, *frames: bytes) -> bytes:
    """The MAC of one transfer-socket message, bound to the sender's nonce (its process)."""
    return mac(secret, purpose, nonce.encode(), *frames)


def curve_keys(secret: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    """(server public, server secret, client public, client secret) Z85 CURVE keys, the same on
    every node with the same secret: a node proves it holds the secret by completing the CURVE
    handshake with the client key, which the server's authenticator alone admits."""
    import zmq  # only processes that bind or connect plan sockets over tcp need it
    from zmq.utils import z85

    keys = []
    for role in ("server", "client"):
        private = z85.encode(mac(secret, f"curve-{role}"))
        keys += [zmq.curve_public(private), private]
    return keys[0], keys[1], keys[2], keys[3]
