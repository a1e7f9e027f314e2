"""End to end: a real `deepinfer serve` process, the tiny model, the real `openai` client."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer.tokenizer import Tokenizer
from tests.frontend.server_process import REPO, ServerProcess, descendants

MAX_PENDING = 4
NO_EOS = {"ignore_eos": True}
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ServerProcess(tiny_model_dir, "--num-kv-blocks", "128", "--max-model-len", "1024",
                        "--max-pending", str(MAX_PENDING), "--served-model-name", "tiny")
    children = descendants(srv.proc.pid)
    yield srv
    code = srv.stop()
    assert code == 0, srv.output()
    time.sleep(0.5)
    alive = [p for p in children if Path(f"/proc/{p}").exists()]
    assert not alive, f"engine processes left behind: {alive}"
    assert children, "the engine runs in child processes"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer(str(tiny_model_dir))


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_models_health_version(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]


def test_chat_usage_matches_tokenizer(client, tok):
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6,
                                       temperature=0, extra_body=NO_EOS)
    _, ids = tok.encode_chat(HELLO)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == len(ids) + 6
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content


def test_chat_stream_equals_non_stream(client):
    kw = dict(model="tiny", messages=HELLO, max_tokens=8, temperature=0, extra_body=NO_EOS)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_completions_usage_stream_and_echo(client, tiny_model_dir):
    prompt = "The quick brown fox"
    n_prompt = len(HFTokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(prompt).ids)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                  extra_body=NO_EOS)
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 5
    text = r.choices[0].text
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=5,
                                       temperature=0, stream=True, extra_body=NO_EOS)
    assert "".join(c.choices[0].text for c in stream if c.choices) == text
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, echo=True,
                                       temperature=0, extra_body=NO_EOS)
    assert echoed.choices[0].text == prompt + text


def test_n_choices(client):
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, n=2,
                                       seed=1, extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 8


def test_stop_string(client):
    kw = dict(model="tiny", prompt="Once upon a time", temperature=0)
    first = client.completions.create(**kw, max_tokens=16, extra_body=NO_EOS).choices[0].text
    words = [w for w in first.split() if len(w) >= 2]
    assert words, f"no usable stop string in {first!r}"
    stop = words[len(words) // 2]
    r = client.completions.create(**kw, max_tokens=16, stop=[stop], extra_body=NO_EOS)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == first[: first.index(stop)]
    assert stop not in r.choices[0].text


def test_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4,
                                       logprobs=True, top_logprobs=3, extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert all(t.logprob <= 0 for t in entry.top_logprobs)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    c = client.completions.create(model="tiny", prompt="Hi there", max_tokens=3, logprobs=2,
                                  extra_body=NO_EOS)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(2 <= len(top) <= 3 and all(v <= 0 for v in top.values())
               for top in lp.top_logprobs)
    assert "".join(lp.tokens) == c.choices[0].text


def test_seed_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt="Tell me", max_tokens=10,
                                          temperature=1.0, seed=seed,
                                          extra_body=NO_EOS).choices[0].text

    assert sample(123) == sample(123)


def test_abort_mid_stream_frees_blocks(client, server):
    total = metric(server, "deepinfer_kv_blocks_total")
    steps_before = metric(server, "deepinfer_engine_steps_total")
    stream = client.completions.create(model="tiny", prompt="Count forever", max_tokens=900,
                                       stream=True, extra_body=NO_EOS)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while metric(server, "deepinfer_kv_blocks_free") != total:
        assert time.monotonic() < deadline, "KV blocks not freed after the client went away"
        time.sleep(0.1)
    assert metric(server, "deepinfer_num_requests_running") == 0
    assert metric(server, "deepinfer_requests_in_flight") == 0
    # it stopped early, not by running to its 900 tokens
    assert metric(server, "deepinfer_engine_steps_total") - steps_before < 600


def test_abort_non_streaming_on_disconnect(server):
    total = metric(server, "deepinfer_kv_blocks_total")
    steps_before = metric(server, "deepinfer_engine_steps_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.base_url}/v1/completions", timeout=0.5,
                   json={"prompt": "Count forever", "max_tokens": 900, "ignore_eos": True})
    deadline = time.monotonic() + 20
    while metric(server, "deepinfer_kv_blocks_free") != total:
        assert time.monotonic() < deadline, "KV blocks not freed after the client went away"
        time.sleep(0.1)
    assert metric(server, "deepinfer_requests_in_flight") == 0
    assert metric(server, "deepinfer_engine_steps_total") - steps_before < 600


BAD_CASES = [
    ("chat", b"{oops", 400),
    ("chat", {"messages": HELLO, "bogus_field": 1}, 400),
    ("chat", {"messages": HELLO, "max_tokens": 10**7}, 400),
    ("chat", {"messages": HELLO, "max_tokens": -5}, 400),
    ("chat", {"messages": HELLO, "temperature": -1}, 400),
    ("chat", {"messages": HELLO, "top_p": 2}, 400),
    ("chat", {"messages": HELLO, "n": 0}, 400),
    ("chat", {"messages": []}, 400),
    ("chat", {"messages": [{"role": "user", "content": "word " * 1100}]}, 400),
    ("chat", {"messages": HELLO, "model": "nope"}, 404),
    ("chat", {"messages": HELLO, "n": MAX_PENDING + 1}, 503),
    ("completions", {"prompt": "word " * 1100}, 400),
    ("completions", {"prompt": [10**9]}, 400),
    ("completions", {"prompt": "x", "max_tokens": "many"}, 400),
]


@pytest.mark.parametrize("endpoint,body,status", BAD_CASES)
def test_bad_input_then_still_serving(client, server, endpoint, body, status):
    url = f"{server.base_url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    if isinstance(body, dict):
        body.setdefault("model", "tiny")
        r = httpx.post(url, json=body, timeout=30)
    else:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    if status == 503:
        assert r.headers["retry-after"]
    ok = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1)
    assert ok.choices[0].message.content is not None


def test_openai_client_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-x", messages=HELLO, max_tokens=1)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=HELLO, temperature=-2)
    assert exc.value.body["param"] == "temperature"


def test_bench_serve(server, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "bench", "serve", "--base-url", server.base_url,
         "--num-prompts", "8", "--max-concurrency", "4", "--random-input-len", "16",
         "--random-output-len", "8", "--result-file", str(out), "--disable-tqdm",
         "--goodput", "ttft:60000"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 8 and report["failed"] == 0
    assert report["total_output_tokens"] == 64
    assert report["good_requests"] == 8
    assert report["model"] == "tiny"


def test_metrics_counters(server):
    text = httpx.get(f"{server.base_url}/metrics").text
    assert 'deepinfer_requests_total{endpoint="chat",status="200"}' in text
    assert 'deepinfer_requests_total{endpoint="chat",status="400"}' in text
    assert "deepinfer_time_to_first_token_seconds_count" in text
    assert metric(server, "deepinfer_generation_tokens_total") > 0


def test_repeated_chat_hits_the_prefix_cache(client, server):
    messages = [{"role": "user", "content": "Tell me a long story about a cache. " * 6}]
    kw = dict(model="tiny", messages=messages, max_tokens=4, temperature=0, extra_body=NO_EOS)
    first = client.chat.completions.create(**kw)
    second = client.chat.completions.create(**kw)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    assert second.choices[0].message.content == first.choices[0].message.content
    assert metric(server, "deepinfer_prefix_cache_hit_rate") > 0
    assert metric(server, "deepinfer_kv_blocks_cached") > 0


def test_second_chat_turn_reuses_the_first_turn(client):
    turn1 = [{"role": "user", "content": "Describe a lighthouse keeper's day in detail. " * 4}]
    kw = dict(model="tiny", max_tokens=8, temperature=0, extra_body=NO_EOS)
    r1 = client.chat.completions.create(messages=turn1, **kw)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And at night?"}]
    r2 = client.chat.completions.create(messages=turn2, **kw)
    # The whole first prompt (whole blocks of it) comes from the cache.
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens // 16 * 16
