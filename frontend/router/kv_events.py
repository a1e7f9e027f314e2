"""The router's side of KV events: follow every replica's event stream into the BlockIndex, and
tokenize requests the way the servers do, so the policy can look their blocks up.

Per replica, a SUB socket on its events endpoint and a DEALER on its replay endpoint (vLLM's
protocol: engine/kvcache/event_publisher.py). At start, and whenever a sequence number is
skipped, the missed batches are asked for again. A PUB stream never repeats a number, so one at
or below the last seen is a restarted replica whose stream started over (its first batch,
AllBlocksCleared, went out before anyone could subscribe): its part of the index is emptied
and its new stream replayed from 0. A malformed message or batch is logged and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from urllib.parse import urlparse

import msgspec
import zmq
import zmq.asyncio

from deepinfer.engine.config import KVEventsConfig, offset_endpoint
from deepinfer.frontend.router.block_index import BlockIndex

log = logging.getLogger("deepinfer.router")

_END_SEQ = -1
_REPLAY_TIMEOUT_MS = 2000


@dataclass(frozen=True)
class EventSource:
    replica: str  # the replica's base URL, as the router knows it
    endpoint: str  # where it publishes
    replay_endpoint: str | None
    topic: str = ""


def event_sources(urls: list[str], config: KVEventsConfig) -> list[EventSource]:
    """Replica i of `urls` publishes on the configured ports plus i (the rule `serve
    --data-parallel-size` follows), at the host of its URL when the config binds a wildcard."""
    out = []
    for i, url in enumerate(urls):
        host = urlparse(url).hostname or "127.0.0.1"
        ends = [_connectable(offset_endpoint(e, i), host)
                for e in (config.endpoint, config.replay_endpoint)]
        out.append(EventSource(url.rstrip("/"), ends[0], ends[1], config.topic))
    return out


def port_clash(config: KVEventsConfig, size: int) -> str | None:
    """Why `size` replicas cannot publish with `config` (None: they can): replica i takes
    both ports plus i, so the two ranges must not meet."""
    ports = [int(e.rpartition(":")[2]) for e in (config.endpoint, config.replay_endpoint)
             if e is not None and e.startswith("tcp://")]
    if len(ports) == 2 and abs(ports[0] - ports[1]) < size:
        return (f"--kv-events-config: with --data-parallel-size {size}, replica i publishes on "
                f"the endpoint's port + i and replays on the replay_endpoint's port + i: put "
                f"the two ports at least {size} apart (got {ports[0]} and {ports[1]})")
    return None


def _connectable(endpoint: str | None, host: str) -> str | None:
    if endpoint is None or not endpoint.startswith("tcp://"):
        return endpoint
    bound, _, port = endpoint[len("tcp://"):].rpartition(":")
    if bound in ("*", "0.0.0.0", "::", "[::]", ""):
        bound = host
    return f"tcp://{bound}:{port}"


class EventFollower:
    """Feeds `index` from every source until cancelled."""

    def __init__(self, sources: list[EventSource], index: BlockIndex) -> None:
        self.sources = sources
        self.index = index
        self.ctx = zmq.asyncio.Context.instance()
        self.batches = 0  # applied, all replicas together
        self.replays = 0

    async def run(self) -> None:
        await asyncio.gather(*(self._follow(s) for s in self.sources))

    async def _follow(self, source: EventSource) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        sub.connect(source.endpoint)
        try:
            last = await self._replay(source, 0, -1)  # what it published before we joined
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("ignoring a malformed KV events message from %s (%d frames)",
                                source.replica, len(frames))
                    continue
                _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big")
                if seq <= last:  # the replica restarted: forget it, read its new stream
                    log.info("KV events of %s started over: it restarted", source.replica)
                    self.index.apply(source.replica, [["AllBlocksCleared"]])
                    last = await self._replay(source, 0, -1)
                    if seq <= last:
                        continue
                if seq > last + 1:
                    last = await self._replay(source, last + 1, last)
                    if seq <= last:
                        continue
                self._apply(source, payload)
                last = seq
        finally:
            sub.close(0)

    async def _replay(self, source: EventSource, first: int, last: int) -> int:
        """Apply the replica's buffered batches from seq `first`; returns the last seq applied
        (`last` when there is no replay socket or it does not answer)."""
        if source.replay_endpoint is None:
            return last
        self.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(source.replay_endpoint)
        try:
            await dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while await dealer.poll(_REPLAY_TIMEOUT_MS):
                frames = await dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == _END_SEQ:
                    break
                if seq > last:
                    self._apply(source, frames[2])
                    last = seq
            else:
                log.warning("KV events replay from %s did not answer", source.replay_endpoint)
        finally:
            dealer.close(0)
        return last

    def _apply(self, source: EventSource, payload: bytes) -> None:
        try:
            events = msgspec.msgpack.decode(payload)[1]
            if not isinstance(events, list):
                raise TypeError("no event list")
            self.index.apply(source.replica, events)
        except Exception as e:  # never the follower: the next batches still count
            log.warning("undecodable KV event batch from %s (%s)", source.replica, e)
            return
        self.batches += 1


class RequestTokens:
    """A request's prompt tokens as the servers compute them: the completion prompt encoded,
    or the chat messages through the model's chat template. None where that is not clear (the
    policy then guesses from the text)."""

    def __init__(self, model_dir: str) -> None:
        from deepinfer.engine.tokenizer.tokenizer import Tokenizer

        self.tokenizer = Tokenizer(model_dir)

    def __call__(self, path: str, payload: object) -> list[int] | None:
        if not isinstance(payload, dict):
            return None
        with contextlib.suppress(Exception):  # a bad request is the replica's to refuse
            messages = payload.get("messages")
            if path.endswith("chat/completions") and isinstance(messages, list):
                # Plain text messages only: the server renders tools and content parts its own
                # way (frontend/server/common/chat_turns.py), which a guess here could get wrong.
                if payload.get("tools") or not all(
                        isinstance(m, dict) and isinstance(m.get("content"), (str, type(None)))
                        for m in messages):
                    return None
                return self.tokenizer.encode_chat(
                    messages, payload.get("add_generation_prompt") is not False, None,
                    payload.get("chat_template_kwargs"))[1]
            if path == "/v1/completions":
                prompt = payload.get("prompt")
                if isinstance(prompt, str):
                    return self.tokenizer.encode(prompt)
                if isinstance(prompt, list) and prompt and all(isinstance(t, int)
                                                               for t in prompt):
                    return prompt
        return None


class KVEventRouting:
    """What the router needs to place requests by KV events: the index the policy reads, the
    follower that fills it, and the tokenizer that turns requests into its keys."""

    def __init__(self, urls: list[str], config: KVEventsConfig, model_dir: str) -> None:
        self.index = BlockIndex()
        self.follower = EventFollower(event_sources(urls, config), self.index)
        self.tokens = RequestTokens(model_dir)
