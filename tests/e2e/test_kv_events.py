"""KV cache events from live servers, read as an external router would: a plain zmq SUB socket
and msgspec.msgpack.decode into plain lists (none of our classes); and the router placing
requests by them (`serve --data-parallel-size 2`)."""

from __future__ import annotations

import json
import re
import time

import httpx
import msgspec
import pytest
import zmq

from scripts.server_process import ServerProcess, descendants, free_ports
from tests.engine.kvcache.test_event_publisher import replay

BS = 16


def events_config(pub: int, replay: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://127.0.0.1:{pub}",
                       "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv-events"})


class Subscriber:
    """A raw subscriber: SUB for live batches, DEALER for replays; batches as plain lists."""

    def __init__(self, pub: int, replay: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        self.sub.connect(f"tcp://127.0.0.1:{pub}")
        self.replay_addr = f"tcp://127.0.0.1:{replay}"
        self.batches: dict[int, bytes] = {}  # seq -> payload, live or replayed

    def replay(self, first: int) -> list[tuple[int, bytes]]:
        return replay(self.ctx, self.replay_addr, first)

    def poll_live(self, timeout_ms: int = 100) -> None:
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b"kv-events" and len(seq) == 8
            self.batches[int.from_bytes(seq, "big")] = payload
            timeout_ms = 0

    def events(self) -> list[list]:
        """Every event so far, in seq order (gaps filled by a replay)."""
        self.poll_live(0)
        for seq, payload in self.replay(0):
            assert self.batches.setdefault(seq, payload) == payload  # replay = what was sent
        out = []
        for seq in sorted(self.batches):
            ts, events, dp_rank = msgspec.msgpack.decode(self.batches[seq])
            assert isinstance(ts, float) and dp_rank == 0
            out += events
        return out

    def wait_for(self, check, timeout: float = 30.0) -> list[list]:
        deadline = time.monotonic() + timeout
        while True:
            events = self.events()
            if check(events):
                return events
            assert time.monotonic() < deadline, f"events never matched: {events[-10:]}"
            self.poll_live(200)

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


def complete(base_url: str, prompt, max_tokens: int = 1) -> dict:
    r = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def stored_events(events: list[list], medium: str = "GPU") -> list[list]:
    return [e for e in events if e[0] == "BlockStored" and e[6] == medium]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from scripts.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("kv-events"))


def test_a_live_server_publishes_vllm_kv_events(tiny_model):
    pub = free_ports(2)
    replay = pub + 1
    # 12 blocks of 16 tokens: a few prompts fill the cache and evict.
    server = ServerProcess(tiny_model, "--served-model-name", "tiny", "--num-kv-blocks", "12",
                           "--block-size", str(BS), "--kv-events-config",
                           events_config(pub, replay))
    sub = Subscriber(pub, replay)
    try:
        # Published at start, before anyone listened: the replay has it.
        assert sub.wait_for(lambda ev: bool(ev))[0] == ["AllBlocksCleared"]
        first = list(range(1000, 1020))  # one full block and a tail
        complete(server.base_url, first)
        events = sub.wait_for(lambda ev: len(stored_events(ev)) >= 1)
        (hashes, parent, tokens, block_size, lora, medium, lora_name), = [
            e[1:] for e in stored_events(events)]
        assert len(hashes) == 1 and parent is None and tokens == first[:BS]
        assert block_size == BS and lora is None and medium == "GPU" and lora_name is None
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
        # The same first block, then a new one: it is stored with the first as its parent.
        second = first[:BS] + list(range(2000, 2020))
        complete(server.base_url, second)
        events = sub.wait_for(lambda ev: len(stored_events(ev)) >= 2)
        _, hashes2, parent2, tokens2, *_ = stored_events(events)[1]
        assert parent2 == hashes[0] and tokens2 == second[BS:2 * BS] and len(hashes2) == 1
        # Distinct prompts overflow the 12 blocks: the oldest cached blocks are evicted.
        for i in range(6):
            complete(server.base_url, [3000 + 100 * i + j for j in range(40)])
        def removed(events: list[list]) -> list[list]:
            return [e for e in events if e[0] == "BlockRemoved"]

        # The first prompt's block is the least recently used: it goes.
        events = sub.wait_for(lambda ev: hashes[0] in {h for e in removed(ev) for h in e[1]})
        stored_hashes = {h for e in stored_events(events) for h in e[1]}
        assert all(e[2] == "GPU" and set(e[1]) <= stored_hashes for e in removed(events))
        # The replay from a later seq returns the batches from there on, in order, as sent.
        seqs = sorted(sub.batches)
        assert seqs == list(range(len(seqs)))  # none missing, live and replayed together
        tail = sub.replay(seqs[-2])
        assert [s for s, _ in tail] == list(range(seqs[-2], seqs[-2] + len(tail)))
        assert [p for _, p in tail[:2]] == [sub.batches[s] for s in seqs[-2:]]
        # Nothing was dropped, and /metrics says so.
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        assert re.search(r"^deepinfer_kv_events_dropped_batches_total 0\.0$", metrics, re.M)
    finally:
        sub.close()
        server.stop()


def test_the_host_tier_publishes_its_own_medium(tiny_model):
    pub = free_ports(2)
    server = ServerProcess(tiny_model, "--served-model-name", "tiny", "--num-kv-blocks", "12",
                           "--block-size", str(BS), "--host-kv-cache-gb", "0.001",
                           "--kv-events-config", events_config(pub, pub + 1))
    sub = Subscriber(pub, pub + 1)
    try:
        for i in range(6):  # overflow the device cache: evicted blocks are copied to host
            complete(server.base_url, [3000 + 100 * i + j for j in range(40)])
        events = sub.wait_for(lambda ev: bool(stored_events(ev, "CPU")))
        on_device = {h for e in stored_events(events) for h in e[1]}
        for _, hashes, parent, tokens, *_ in stored_events(events, "CPU"):
            assert len(hashes) == 1 and len(tokens) == BS and hashes[0] in on_device
            assert parent is None or parent in on_device  # the same chain as on the device
    finally:
        sub.close()
        server.stop()


def test_a_bad_config_is_a_start_up_error_naming_the_flag(tiny_model):
    with pytest.raises(RuntimeError, match="--kv-events-config"):
        ServerProcess(tiny_model, "--kv-events-config", '{"enable_kv_cache_events": tru}',
                      timeout=60)


def placements(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(
        r'deepinfer_router_requests_total\{replica="([^"]+)"\} ([0-9.e+]+)', text)}


def indexed_blocks(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(
        r'deepinfer_router_kv_event_blocks\{replica="([^"]+)"\} ([0-9.e+]+)', text)}


def test_the_router_places_a_cached_prefix_on_the_replica_its_events_name(tiny_model):
    pub = free_ports(4)  # replica i publishes on pub + i and replays on pub + 2 + i
    replay = pub + 2
    router = ServerProcess(tiny_model, "--data-parallel-size", "2", "--served-model-name",
                           "tiny", "--num-kv-blocks", "64", "--kv-events-config",
                           events_config(pub, replay))
    try:
        replicas = []
        for pid in descendants(router.proc.pid):
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            if b"--data-parallel-rank" in argv:
                rank = int(argv[argv.index(b"--data-parallel-rank") + 1])
                port = argv[argv.index(b"--port") + 1].decode()
                replicas.append((rank, f"http://127.0.0.1:{port}"))
        (_, first), (_, second) = sorted(replicas)
        # Each replica caches its own long prefix, sent to it directly: the router never saw
        # these prompts, so only the replicas' events can tell it where they are.
        prefix = {first: "The first replica's system prompt says this. " * 6,
                  second: "A different preamble lives on the second replica! " * 6}
        for url, text in prefix.items():
            complete(url, text + "Warm up.")
        deadline = time.monotonic() + 30
        while min(indexed_blocks(router.base_url).get(u, 0) for u in prefix) < 3:
            assert time.monotonic() < deadline, indexed_blocks(router.base_url)
            time.sleep(0.1)
        # Second replica's prefix first: by load alone (both idle, neither used) the first
        # replica would get it, and then the second would get the first's.
        for round_ in range(2):
            for url, text in reversed(prefix.items()):
                before = placements(router.base_url).get(url, 0)
                complete(router.base_url, text + f"Question {round_}?")
                assert placements(router.base_url)[url] == before + 1
    finally:
        router.stop()
