"""End to end: a real `deepinfer serve` process, the tiny model, the real `openai` client.

Raw sockets stand in for a client where a client library's habits would blur the test: a
disconnect must really close the connection, and a large body must really be sent to its end.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import Tokenizer as HFTokenizer

from deepinfer.engine.tokenizer.tokenizer import Tokenizer
from scripts.server_process import ServerProcess, descendants
from tests.conftest import LONG_CONTEXT as CONTEXT
from tests.conftest import NEVER_ENDING as FOREVER

MAX_PENDING = 4
NO_EOS = {"ignore_eos": True}
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def server(long_tiny_model_dir):
    blocks = CONTEXT // 16 + 16
    srv = ServerProcess(long_tiny_model_dir, "--num-kv-blocks", str(blocks),
                        "--max-model-len", str(CONTEXT),
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


def test_a_final_assistant_message_is_continued(client, tiny_model_dir):
    """continue_final_message (vLLM's): the prompt is transformers' rendering ending with the
    answer begun, and the greedy answer goes on from it as a completion of that text does."""
    from transformers import AutoTokenizer

    begun = [*HELLO, {"role": "assistant", "content": "I am a"}]
    prompt = AutoTokenizer.from_pretrained(str(tiny_model_dir)).apply_chat_template(
        begun, continue_final_message=True, tokenize=False)
    assert prompt.endswith("I am a")
    kw = dict(model="tiny", max_tokens=6, temperature=0)
    r = client.chat.completions.create(messages=begun, **kw, extra_body={
        **NO_EOS, "continue_final_message": True, "add_generation_prompt": False})
    ref = client.completions.create(prompt=prompt, **kw, extra_body=NO_EOS)
    assert r.choices[0].message.content == ref.choices[0].text
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    alone = client.chat.completions.create(messages=begun, **kw, extra_body={
        **NO_EOS, "continue_final_message": True})  # implies no generation prompt
    assert alone.choices[0].message.content == ref.choices[0].text
    for messages, both in [(begun, True), (HELLO, False)]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(messages=messages, **kw, extra_body={
                "continue_final_message": True, "add_generation_prompt": both})
        assert refused.value.body["param"] == "continue_final_message"


def test_a_long_prompt_tokenized_off_the_loop_counts_as_the_tokenizer_does(client, tok):
    """A prompt text past INLINE_PROMPT_CHARS is tokenized on the tokenizer process's thread:
    the same ids (usage) as the tokenizer gives in place, and an ordinary answer."""
    from deepinfer.engine.tokenizer.tokenizer_process import INLINE_PROMPT_CHARS

    prompt = "The quick brown fox jumps. " * (INLINE_PROMPT_CHARS // 27 + 1)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                  extra_body=NO_EOS)
    assert r.usage.prompt_tokens == len(tok.encode(prompt)) and r.usage.completion_tokens == 3


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


def _raw_post(server: ServerProcess, path: str, body: bytes, *headers: str) -> socket.socket:
    """A socket that has sent one complete HTTP/1.1 POST (no client library in between)."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(60)  # a guard against hanging forever, not part of any assertion
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {len(body)}", *headers]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    return sock


def _scrape(http: httpx.Client) -> dict[str, float]:
    """Every unlabelled metric of one /metrics scrape."""
    text = http.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+) ([0-9.e+-]+)$", text, re.M)}


def _wait_running(http: httpx.Client, steps_before: float) -> None:
    """Until the request is admitted and the engine has stepped since `steps_before`.

    `http` is a client already connected, and each look is one scrape: a new client per look
    costs more than a short request may take, which would end before it was seen.
    """
    deadline = time.monotonic() + 60
    while True:
        m = _scrape(http)
        in_flight, steps = m["deepinfer_requests_in_flight"], m["deepinfer_engine_steps_total"]
        if in_flight == 1 and steps > steps_before:
            return
        assert time.monotonic() < deadline, (
            f"the request never started running: in flight {in_flight}, steps {steps} "
            f"(before {steps_before})")
        time.sleep(0.01)


def _assert_aborted(server: ServerProcess, steps_before: float) -> None:
    total = metric(server, "deepinfer_kv_blocks_total")
    deadline = time.monotonic() + 20
    while metric(server, "deepinfer_kv_blocks_free") != total:
        assert time.monotonic() < deadline, "KV blocks not freed after the client went away"
        time.sleep(0.1)
    assert metric(server, "deepinfer_requests_in_flight") == 0
    assert metric(server, "deepinfer_num_requests_running") == 0
    # it stopped early, not by running to its end
    assert metric(server, "deepinfer_engine_steps_total") - steps_before < FOREVER // 2


def test_abort_mid_stream_frees_blocks(client, server):
    steps_before = metric(server, "deepinfer_engine_steps_total")
    stream = client.completions.create(model="tiny", prompt="Count forever", max_tokens=FOREVER,
                                       stream=True, extra_body=NO_EOS)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    _assert_aborted(server, steps_before)


def _abort_by_closing_the_socket(server: ServerProcess, stream: bool) -> None:
    body = json.dumps({"prompt": "Count forever", "max_tokens": FOREVER, "ignore_eos": True,
                       "model": "tiny", "stream": stream}).encode()
    with httpx.Client(base_url=server.base_url) as http:
        steps_before = _scrape(http)["deepinfer_engine_steps_total"]
        sock = _raw_post(server, "/v1/completions", body)
        try:
            _wait_running(http, steps_before)
            sock.shutdown(socket.SHUT_RDWR)  # the client really goes away: FIN, then no fd
        finally:
            sock.close()  # also when the wait failed, so the next test starts from an idle server
    _assert_aborted(server, steps_before)


def test_abort_non_streaming_on_disconnect(server):
    _abort_by_closing_the_socket(server, stream=False)


def test_abort_streaming_on_socket_close(server):
    _abort_by_closing_the_socket(server, stream=True)


def test_huge_top_k_is_off(client):
    """top_k past the vocabulary (even past int64) is clamped: it samples as top_k off."""
    def sample(top_k: int) -> str:
        return client.completions.create(
            model="tiny", prompt="Tell me", max_tokens=6, temperature=1.0, seed=7,
            extra_body={**NO_EOS, "top_k": top_k}).choices[0].text

    off = sample(0)
    assert sample(2**63) == off
    assert sample(2**64 - 1) == off


BAD_CASES = [
    ("chat", b"{oops", 400, None),
    ("chat", {"messages": HELLO, "bogus_field": 1, "max_tokens": 2}, 200, None),  # ignored
    ("chat", {"messages": HELLO, "max_tokens": 10**7}, 400, None),
    ("chat", {"messages": HELLO, "max_tokens": -5}, 400, None),
    ("chat", {"messages": HELLO, "temperature": -1}, 400, None),
    ("chat", {"messages": HELLO, "top_p": 2}, 400, None),
    ("chat", {"messages": HELLO, "n": 0}, 400, None),
    ("chat", {"messages": []}, 400, None),
    ("chat", {"messages": [{"role": "user", "content": "word " * (CONTEXT + 10)}]}, 400, None),
    ("chat", {"messages": HELLO, "model": "nope"}, 404, None),
    ("chat", {"messages": HELLO, "n": MAX_PENDING + 1}, 503, None),
    ("completions", {"prompt": "word " * (CONTEXT + 10)}, 400, None),
    ("completions", {"prompt": [10**9]}, 400, None),
    ("completions", {"prompt": "x", "max_tokens": "many"}, 400, None),
    # integers past what the engine can carry: a 400 naming the field, or clamped (top_k)
    ("chat", {"messages": HELLO, "top_k": 2**63, "max_tokens": 2}, 200, None),
    ("chat", {"messages": HELLO, "top_k": 2**64 - 1, "max_tokens": 2}, 200, None),
    ("chat", {"messages": HELLO, "seed": 2**64 - 1, "n": 2}, 400, "seed"),
    ("chat", {"messages": HELLO, "seed": 2**63}, 400, "seed"),
    ("completions", {"prompt": [2**31]}, 400, "prompt"),
    ("completions", {"prompt": [2**40]}, 400, "prompt"),
    ("completions", {"prompt": "x", "stop_token_ids": [2**31]}, 400, "stop_token_ids"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD_CASES)
def test_bad_input_then_still_serving(client, server, endpoint, body, status, param):
    url = f"{server.base_url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    if isinstance(body, dict):
        body.setdefault("model", "tiny")
        r = httpx.post(url, json=body, timeout=30)
    else:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    if status == 200:
        assert r.json()["choices"]
    else:
        assert r.json()["error"]["message"]
    if param is not None:
        assert r.json()["error"]["param"] == param
    if status == 503:
        assert r.headers["retry-after"]
    _still_serving(client)


def _still_serving(client: openai.OpenAI) -> None:
    ok = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1)
    assert ok.choices[0].message.content is not None


@pytest.fixture(scope="module")
def big_chat() -> bytes:
    """A 10 MB chat body: over the server's 8 MiB limit, under its 128 MiB drain cap."""
    text = "x" * (10 << 20)
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}]}).encode()


def _assert_413(status: int, body: bytes) -> None:
    assert status == 413, body[:300]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_body_413_httpx(client, server, big_chat, chunked):
    mib = 1 << 20
    chunks = [big_chat[i:i + mib] for i in range(0, len(big_chat), mib)]
    content = iter(chunks) if chunked else big_chat  # an iterator goes out chunked
    r = httpx.post(f"{server.base_url}/v1/chat/completions", content=content,
                   headers={"content-type": "application/json"}, timeout=60)
    _assert_413(r.status_code, r.content)
    _still_serving(client)


def test_oversized_body_413_raw_socket(client, server, big_chat):
    """The whole body goes out, then the 413 comes back (no connection reset on the way)."""
    with _raw_post(server, "/v1/chat/completions", big_chat, "Connection: close") as sock:
        response = b"".join(iter(lambda: sock.recv(1 << 16), b""))  # to the server's close
    head, _, body = response.partition(b"\r\n\r\n")
    _assert_413(int(head.split()[1]), body)
    _still_serving(client)


def test_openai_client_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-x", messages=HELLO, max_tokens=1)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=HELLO, temperature=-2)
    assert exc.value.body["param"] == "temperature"


def test_bench_serve(server, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "deepinfer", "bench", "serve", "--base-url", server.base_url,
         "--num-prompts", "8", "--max-concurrency", "4", "--random-input-len", "16",
         "--random-output-len", "8", "--result-file", str(out), "--disable-tqdm",
         "--goodput", "ttft:60000"],
        cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 8 and report["failed"] == 0
    assert report["total_output_tokens"] == 64
    assert report["good_requests"] == 8
    assert report["model"] == "tiny"
    # Speculation is off: the counters are there but verify nothing, so no figures.
    assert report["spec_decode_acceptance_rate"] is None and "Speculative" not in proc.stdout


def test_metrics_counters(server):
    text = httpx.get(f"{server.base_url}/metrics").text
    assert 'deepinfer_requests_total{endpoint="chat",status="200"}' in text
    assert 'deepinfer_requests_total{endpoint="chat",status="400"}' in text
    assert "deepinfer_time_to_first_token_seconds_count" in text
    assert metric(server, "deepinfer_generation_tokens_total") > 0
    assert metric(server, "deepinfer_spec_decode_draft_tokens_total") == 0


def test_repeated_chat_hits_the_prefix_cache(client, server):
    messages = [{"role": "user", "content": "Tell me a long story about a cache. " * 6}]
    kw = dict(model="tiny", messages=messages, max_tokens=4, temperature=0, extra_body=NO_EOS)
    first = client.chat.completions.create(**kw)
    second = client.chat.completions.create(**kw)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    # As DeepSeek's API reports it (the SDK keeps unknown fields).
    extra = second.usage.model_extra
    assert extra["prompt_cache_hit_tokens"] == second.usage.prompt_tokens_details.cached_tokens
    assert extra["prompt_cache_hit_tokens"] + extra["prompt_cache_miss_tokens"] == \
        second.usage.prompt_tokens
    assert second.choices[0].message.content == first.choices[0].message.content
    assert metric(server, "deepinfer_prefix_cache_hit_rate") > 0
    assert metric(server, "deepinfer_kv_blocks_cached") > 0


def test_thinking_switches_and_sent_back_reasoning_cross_the_processes(client):
    """The tiny model's template reads neither: the same prompt, the same greedy text."""
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "add them"},
                {"role": "user", "content": "and 3+3?"}]
    kw = dict(model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body=NO_EOS)
    plain = client.chat.completions.create(**kw)
    switched = client.chat.completions.create(**kw | {"extra_body": NO_EOS | {
        "chat_template_kwargs": {"enable_thinking": False}, "thinking": {"type": "enabled"},
        "reasoning_effort": "low"}})
    assert switched.choices[0].message.content == plain.choices[0].message.content
    assert switched.usage.prompt_tokens == plain.usage.prompt_tokens


def test_second_chat_turn_reuses_the_first_turn(client):
    turn1 = [{"role": "user", "content": "Describe a lighthouse keeper's day in detail. " * 4}]
    kw = dict(model="tiny", max_tokens=8, temperature=0, extra_body=NO_EOS)
    r1 = client.chat.completions.create(messages=turn1, **kw)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And at night?"}]
    r2 = client.chat.completions.create(messages=turn2, **kw)
    # The whole first prompt (whole blocks of it) comes from the cache.
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens // 16 * 16


def test_bench_serve_input_grounded(server, tmp_path):
    out = tmp_path / "grounded.json"
    proc = subprocess.run(
        [sys.executable, "-m", "deepinfer", "bench", "serve", "--base-url", server.base_url,
         "--endpoint", "/v1/chat/completions", "--dataset", "input-grounded",
         "--num-prompts", "2", "--grounded-max-tokens", "8", "--result-file", str(out),
         "--disable-tqdm"],
        cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["dataset"] == "input-grounded" and report["completed"] == 2
    assert all(0 < n <= 8 for n in report["output_lens"])
    assert all(n > 150 for n in report["input_lens"])  # the whole text to copy was sent
