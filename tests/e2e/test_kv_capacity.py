"""A prompt that fits the model's context but not the KV cache is a 400 up front, streaming too."""

from __future__ import annotations

import httpx
import pytest

from scripts.server_process import ServerProcess


@pytest.fixture(scope="module")
def small_kv_server(tiny_model_dir):
    # 8 blocks of 16 tokens: 128 tokens of KV, far below the 1024-token context.
    srv = ServerProcess(tiny_model_dir, "--num-kv-blocks", "8", "--max-model-len", "1024")
    yield srv
    srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_beyond_the_kv_cache_is_a_400(small_kv_server, stream):
    body = {"prompt": list(range(100, 300)), "max_tokens": 4, "stream": stream}
    r = httpx.post(f"{small_kv_server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and "200 tokens" in error["message"]
    ok = httpx.post(f"{small_kv_server.base_url}/v1/completions", timeout=60,
                    json={"prompt": list(range(100, 150)), "max_tokens": 4, "stream": stream})
    assert ok.status_code == 200


def test_models_reports_the_served_context(small_kv_server):
    card = httpx.get(f"{small_kv_server.base_url}/v1/models", timeout=10).json()["data"][0]
    assert card["max_model_len"] == 128
