"""What crosses between two servers' worker ranks during a KV transfer (ZeroMQ multipart).

A decode rank's DEALER asks the matching prefill rank's ROUTER to `Read` blocks; the answer is a
`ReadReply` frame followed by one raw frame per cache tensor of each KV group (the blocks back to
back, in the order asked). `Release` says the decode side is done (or gave up): the prefill
server may free the blocks. A sender's address carries a nonce after '#', so a pull aimed at a
server that has restarted since is refused instead of reading someone else's blocks.

Both directions are authenticated with the cluster secret (engine/trust.py): a request is
[header, MAC], a reply [header, MAC, block frames...], each MAC over the header and the
sender's nonce (a reply's also over the request's MAC, so it answers that request). A message
without a valid MAC is answered with an error and nothing else; a reply without one fails the
pull. The block frames themselves are not MACed (hashing them would cost as much as moving them):
the reply's MAC says who answered, the transport carries what it sent.

With the NIXL backend (nixl_transport.py) the blocks do not travel here: the decode rank asks
once per prefill rank for its `Meta` (NIXL agent and cache addresses), sends `Read`s without
payload only to have the transfer checked (before its NIXL READ, and after it: a transfer
released meanwhile may have been overwritten), and reads the blocks itself.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import msgspec
import torch

from deepinfer.engine.kv_layout import KVCacheLayout
from deepinfer.engine.trust import message_mac


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


def group_tensors(layout: KVCacheLayout,
                  kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
                  ) -> list[list[torch.Tensor]]:
    """Per KV group, the cache tensors a block spans (empty ones left out), in a fixed order
    both sides derive from the same layout."""
    return [[t for i in g.layers for t in kv_caches[i] if t.numel()] for g in layout.groups()]


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU copy's raw bytes (any dtype, bfloat16 included; none for no blocks)."""
    return memoryview(t.contiguous().cpu().view(torch.uint8).numpy().reshape(-1))
