"""What crosses between two servers' worker ranks during a KV transfer (ZeroMQ multipart).

A decode rank's DEALER asks the matching prefill rank's ROUTER to `Read` blocks; the answer is a
`ReadReply` frame followed by one raw frame per cache tensor of each KV group (the blocks back to
back, in the order asked). `Release` says the decode side is done (or gave up): the prefill
server may free the blocks. The PD router sends one too when no decode server took a transfer
(frontend/router/pd.py). A sender's address carries a nonce after '#', so a pull aimed at a
server that has restarted since is refused instead of reading someone else's blocks.

Both directions are authenticated with the cluster secret (engine/trust.py): a request is
[header, MAC], a reply [header, MAC, block frames...], each MAC over the header and the
sender's nonce (a reply's also over the request's MAC, so it answers that request). A message
without a valid MAC is answered with an error and nothing else; a reply without one fails the
pull. The block frames themselves are not MACed (hashing them would cost as much as moving them):
the reply's MAC says who answered, the transport carries what it sent.

With the NIXL backend (workers/kv_connectors/transfer/nixl_transport.py) the blocks do not
travel here: the decode rank asks once per prefill rank for its `Meta` (NIXL agent and cache
addresses), sends `Read`s without payload only to have the transfer checked (before its NIXL
READ, and after it: a transfer released meanwhile may have been overwritten), and reads the
blocks itself.

Torch-free (the router sends `Release`); the worker side's tensor helpers are in
workers/kv_connectors/transfer/wire.py.
"""

from __future__ import annotations

import hmac

import msgspec

from deepinfer.engine.trust import message_mac

# The largest request a prefill rank takes (ZMQ_MAXMSGSIZE on its socket) beyond 4 bytes per
# block id it could be asked for: a transfer id, a nonce and msgpack framing.
REQUEST_OVERHEAD = 4096


class Read(msgspec.Struct, tag=True, array_like=True):
    seq: int  # echoed in the reply: a late reply to an abandoned read is recognised
    nonce: str
    transfer_id: str
    blocks: list[bytes]  # per KV group: int32 block ids on the sender
    payload: bool = True  # False: check the transfer only, answer with no block frames


class Meta(msgspec.Struct, tag=True, array_like=True):
    """What a NIXL reader needs to read this rank's cache (answered in ReadReply.meta)."""

    seq: int
    nonce: str


class Release(msgspec.Struct, tag=True, array_like=True):
    transfer_id: str
    cancelled: bool = False


class ReadReply(msgspec.Struct, array_like=True):
    seq: int
    error: str | None = None
    meta: bytes = b""
    retry: bool = False  # the transfer is not held yet (its plan is on the way): ask again


ToSender = Read | Release | Meta


def seal_request(secret: bytes, nonce: str, header: bytes) -> list[bytes]:
    """[header, MAC] for the sender whose nonce is `nonce`."""
    return [header, message_mac(secret, "kv-request", nonce, header)]


def request_mac_ok(secret: bytes, nonce: str, frames: list[bytes]) -> bool:
    """Whether a request's frames ([header, MAC]) were sealed with this sender's nonce."""
    return len(frames) == 2 and hmac.compare_digest(
        frames[1], message_mac(secret, "kv-request", nonce, frames[0]))


def reply_mac(secret: bytes, nonce: str, request_mac: bytes, header: bytes) -> bytes:
    return message_mac(secret, "kv-reply", nonce, request_mac, header)


def split_address(address: str) -> tuple[str, str]:
    """'tcp://host:port#nonce' -> (ZeroMQ endpoint, nonce)."""
    endpoint, _, nonce = address.partition("#")
    return endpoint, nonce


def sealed_release(secret: bytes, address: str, transfer_id: str, cancelled: bool = True
                   ) -> tuple[str, list[bytes]]:
    """(endpoint, frames) of a `Release` for the prefill rank at `address`."""
    endpoint, nonce = split_address(address)
    header = msgspec.msgpack.encode(Release(transfer_id, cancelled))
    return endpoint, seal_request(secret, nonce, header)
