"""A real `deepinfer serve --speculative-method ngram`: the flags, /metrics, opt-out, aborts."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import openai
import pytest

from scripts.server_process import ServerProcess
from tests.conftest import LONG_CONTEXT, NEVER_ENDING
from tests.frontend.server.test_server_e2e import _raw_post, _scrape, _wait_running

REPEAT = [5, 6, 7, 8, 9, 10] * 4  # the tiny random model keeps repeating: lookups hit


@pytest.fixture(scope="module")
def server(long_tiny_model_dir):
    srv = ServerProcess(long_tiny_model_dir, "--num-kv-blocks", str(LONG_CONTEXT // 16 + 16),
                        "--max-model-len", str(LONG_CONTEXT),
                        "--served-model-name", "tiny", "--speculative-method", "ngram",
                        "--num-speculative-tokens", "3", "--ngram-min", "1", "--ngram-max", "3")
    yield srv
    assert srv.stop() == 0, srv.output()


def spec_counters(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics").text
    return {name: float(value) for name, value in re.findall(
        r"^(deepinfer_spec_decode_\w+) ([0-9.e+-]+)$", text, re.M)}


def test_speculation_through_the_server(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    before = spec_counters(server)
    kw = dict(model="tiny", prompt=REPEAT, max_tokens=40, temperature=0,
              extra_body={"ignore_eos": True})
    spec = client.completions.create(**kw)
    after = spec_counters(server)
    drafts = (after["deepinfer_spec_decode_draft_tokens_total"]
              - before["deepinfer_spec_decode_draft_tokens_total"])
    assert drafts > 0 and after["deepinfer_spec_decode_accepted_tokens_total"] > 0
    assert spec.usage.completion_tokens == 40
    # The per-request opt-out: the same text, no drafts.
    kw["extra_body"] = {"ignore_eos": True, "speculative_decoding": False}
    plain = client.completions.create(**kw)
    assert plain.choices[0].text == spec.choices[0].text
    assert spec_counters(server)["deepinfer_spec_decode_draft_tokens_total"] == (
        after["deepinfer_spec_decode_draft_tokens_total"])


@pytest.mark.parametrize("stream", [False, True])
def test_abort_mid_speculation_frees_every_block(server, stream):
    body = json.dumps({"prompt": REPEAT, "max_tokens": NEVER_ENDING, "ignore_eos": True,
                       "model": "tiny", "stream": stream}).encode()
    with httpx.Client(base_url=server.base_url) as http:
        before = _scrape(http)
        sock = _raw_post(server, "/v1/completions", body)
        try:
            _wait_running(http, before["deepinfer_engine_steps_total"])
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
        for _ in range(200):
            m = _scrape(http)
            if m["deepinfer_kv_blocks_free"] == m["deepinfer_kv_blocks_total"]:
                break
            time.sleep(0.1)
        assert m["deepinfer_kv_blocks_free"] == m["deepinfer_kv_blocks_total"]
        assert m["deepinfer_requests_in_flight"] == 0
        generated = (m["deepinfer_generation_tokens_total"]
                     - before["deepinfer_generation_tokens_total"])
        assert generated < NEVER_ENDING // 2  # it was stopped, not run to its end
