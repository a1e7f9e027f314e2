"""`deepinfer serve --data-parallel-size 2`: two real replicas behind the router, through HTTP."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from scripts.server_process import ServerProcess, descendants


def placements(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(
        r'deepinfer_router_requests_total\{replica="([^"]+)"\} ([0-9.e+]+)', text)}


def complete(base_url: str, prompt: str, **extra) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra})


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    from scripts.tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path_factory.mktemp("dp"))
    server = ServerProcess(model, "--data-parallel-size", "2", "--num-kv-blocks", "64",
                           "--served-model-name", "tiny")
    try:
        yield server
    finally:
        server.stop()


def test_a_repeated_prefix_stays_on_one_replica_and_distinct_prompts_spread(router):
    system = "You are a careful assistant who answers in one word. " * 6
    for i in range(4):
        assert complete(router.base_url, system + f"Question {i}?").status_code == 200
    after_prefix = placements(router.base_url)
    assert sorted(after_prefix.values()) == [0.0, 4.0] or len(after_prefix) == 1
    for i in range(8):
        r = complete(router.base_url, f"{i} unrelated words about topic {i}, " * 5)
        assert r.status_code == 200
    counts = placements(router.base_url)
    assert len(counts) == 2 and sum(counts.values()) == 12
    assert abs(counts[min(counts)] - counts[max(counts)]) <= 1  # 4 + 2 and 0 + 6


def test_streams_pass_through(router):
    with httpx.stream("POST", f"{router.base_url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "Hello", "max_tokens": 5, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) >= 3


def test_anthropic_messages_pass_through(router):
    import anthropic

    client = anthropic.Anthropic(base_url=router.base_url, api_key="none", max_retries=0)
    message = client.messages.create(model="tiny", max_tokens=4,
                                     messages=[{"role": "user", "content": "Hello"}])
    assert message.type == "message" and message.usage.output_tokens == 4
    count = client.messages.count_tokens(model="tiny",
                                         messages=[{"role": "user", "content": "Hello"}])
    assert count.input_tokens == message.usage.input_tokens + \
        (message.usage.cache_read_input_tokens or 0)


def test_stored_responses_are_found_on_the_replica_that_made_them(router):
    """Responses spread over both replicas; each is read, continued and deleted through the
    router, which finds the replica that stores it."""
    import openai

    client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key="none", max_retries=0)
    before = placements(router.base_url)
    made = [client.responses.create(model="tiny", max_output_tokens=3, temperature=0,
                                    input=f"{i} distinct words on topic {i}, " * 4)
            for i in range(6)]
    after = placements(router.base_url)
    assert all(after[r] > before.get(r, 0) for r in after) and len(after) == 2  # both made some
    for first in made:
        assert client.responses.retrieve(first.id).id == first.id
        follow = client.responses.create(model="tiny", max_output_tokens=3, input="And then?",
                                         previous_response_id=first.id)
        assert follow.usage.input_tokens > first.usage.input_tokens
        assert client.responses.delete(first.id) is None
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)


def test_a_dead_replica_loses_no_request_that_had_not_started(router):
    replicas = {}
    for pid in descendants(router.proc.pid):
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        if b"--worker-threads" in argv:
            replicas[pid] = f"http://127.0.0.1:{argv[argv.index(b'--port') + 1].decode()}"
    assert len(replicas) == 2
    dead_pid, dead = next(iter(replicas.items()))
    before = placements(router.base_url)
    os.kill(dead_pid, signal.SIGKILL)
    # Sent at once: those placed on the dead replica before a health check notices find it
    # unreachable and are retried on the other one.
    responses = [complete(router.base_url, f"prompt number {i} " * 3) for i in range(6)]
    assert [r.status_code for r in responses] == [200] * 6
    metrics = httpx.get(f"{router.base_url}/metrics", timeout=10).text
    retried = float(re.search(r"deepinfer_router_retries_total ([0-9.e+]+)", metrics)[1])
    assert retried == placements(router.base_url)[dead] - before[dead]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = httpx.get(f"{router.base_url}/health", timeout=5).json()
        if health["healthy_replicas"] == 1:
            break
        time.sleep(0.2)
    assert health == {"healthy_replicas": 1, "replicas": 2}
