"""Request decoding and validation, no server, no engine."""

from __future__ import annotations

import msgspec
import pytest

from frontend.bench.client import RequestResult
from frontend.bench.datasets import random_requests, shared_prefix_requests
from frontend.bench.metrics import parse_goodput, summarize, tpot
from frontend.server.errors import APIError, decode_error
from frontend.server.openai_schema import decode_chat, decode_completion
from frontend.server.prompts import chat_messages, completion_prompts
from frontend.server.sampling import chat_params, completion_params
from frontend.server.state import ServerState

MSG = b'"messages": [{"role": "user", "content": "hi"}]'


def chat_req(extra: str = ""):
    return decode_chat(b"{" + MSG + extra.encode() + b"}")


def test_openai_client_extras_are_accepted():
    req = chat_req(', "user": "u", "n": null, "stream_options": {"include_usage": true}, '
                   '"tools": [{"type": "function", "function": {"name": "f"}}], '
                   '"tool_choice": "auto", "metadata": {}, "store": false, "logit_bias": null')
    assert req.stream_options.include_usage is True
    assert chat_params(req, 100).max_tokens == 100


def test_chat_defaults():
    p = chat_params(chat_req(), 128)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.logprobs) == (1.0, 1.0, 0, 128, None)
    assert p.seed is None and p.stop == [] and p.skip_special_tokens


def test_max_completion_tokens_wins():
    p = chat_params(chat_req(', "max_tokens": 5, "max_completion_tokens": 7'), 128)
    assert p.max_tokens == 7


def test_logprobs_mapping():
    assert chat_params(chat_req(', "logprobs": true'), 10).logprobs == 0
    assert chat_params(chat_req(', "logprobs": true, "top_logprobs": 4'), 10).logprobs == 4
    comp = decode_completion(b'{"prompt": "x", "logprobs": 2}')
    assert completion_params(comp, 10).logprobs == 2
    assert completion_params(decode_completion(b'{"prompt": "x"}'), 10).max_tokens == 16


def test_top_k_minus_one_is_off():
    assert chat_params(chat_req(', "top_k": -1'), 10).top_k == 0


def test_stop_string_becomes_list():
    assert chat_params(chat_req(', "stop": "END"'), 10).stop == ["END"]


@pytest.mark.parametrize("body,param", [
    (b'{"messages": 3}', "messages"),
    (b'{"messages": [{"role": "user"}], "temperature": "hot"}', "temperature"),
    (b'{"messages": [], "stream_options": {"include_usage": 1}}', "stream_options.include_usage"),
    (b'{"messages": [], "stream_options": {"x": true}}', "stream_options.x"),
    (b'{"messages": [{"content": "x"}]}', "messages[0].role"),
])
def test_decode_errors_name_the_field(body, param):
    with pytest.raises(msgspec.ValidationError) as exc:
        decode_chat(body)
    err = decode_error(exc.value)
    assert err.status == 400 and err.param == param


def test_malformed_json():
    with pytest.raises(msgspec.DecodeError) as exc:
        decode_chat(b'{"messages": [')
    assert decode_error(exc.value).param is None


def test_messages_and_prompts():
    msgs = chat_messages(chat_req(', "model": "m"').messages)
    assert msgs[0].role == "user" and msgs[0].content == "hi"
    with pytest.raises(APIError):
        chat_messages([])
    assert completion_prompts(decode_completion(b'{"prompt": [1, 2]}')) == [[1, 2]]
    assert completion_prompts(decode_completion(b'{"prompt": [[1], [2]]}')) == [[1], [2]]
    assert completion_prompts(decode_completion(b'{"prompt": ["a", "b"]}')) == ["a", "b"]
    with pytest.raises(APIError):
        completion_prompts(decode_completion(b'{"prompt": [[1], 2]}'))
    with pytest.raises(APIError):
        completion_prompts(decode_completion(b'{"prompt": [[]]}'))


def test_admission_bound():
    state = ServerState(max_pending=2)

    class Up:
        dead_reason = None
        healthy = True
        model_name = "m"
        context_len = 8

    state.client = Up()  # type: ignore[assignment]
    state.admit(2)
    with pytest.raises(APIError) as exc:
        state.admit(1)
    assert exc.value.status == 503 and exc.value.headers == {"Retry-After": "1"}
    state.release(2)
    state.admit(1)
    state.check_model("m")
    with pytest.raises(APIError) as exc:
        state.check_model("other")
    assert exc.value.status == 404 and exc.value.code == "model_not_found"


def test_bench_pieces():
    reqs = random_requests(4, 10, 5, 0.0, seed=1)
    assert len(reqs) == 4 and all(len(r.prompt.split()) == 10 and r.output_len == 5 for r in reqs)
    assert reqs == random_requests(4, 10, 5, 0.0, seed=1)
    shared = shared_prefix_requests(3, 20, 5, 4, 0.0, seed=1)
    prefixes = {r.prompt.split("\n")[0] for r in shared}
    assert len(prefixes) == 1
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError):
        parse_goodput(["latency:3"])
    ok = RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, e2e=0.5,
                       itl=[0.1] * 4)
    assert tpot(ok) == pytest.approx(0.1)
    report = summarize([ok, RequestResult(error="x")], 1.0, {"ttft": 200})
    assert report["completed"] == 1 and report["failed"] == 1
    assert report["output_throughput"] == 5 and report["good_requests"] == 1
    assert report["mean_ttft_ms"] == pytest.approx(100)
