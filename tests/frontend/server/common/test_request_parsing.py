"""Request decoding and validation, no server, no engine."""

from __future__ import annotations

import msgspec
import pytest

from deepinfer.frontend.bench.client import RequestResult
from deepinfer.frontend.bench.datasets import random_requests, shared_prefix_requests
from deepinfer.frontend.bench.metrics import parse_goodput, summarize, tpot
from deepinfer.frontend.server.common.openai_schema import decode_chat, decode_completion
from deepinfer.frontend.server.common.prompts import chat_messages, completion_prompts
from deepinfer.frontend.server.common.sampling import chat_params, completion_params
from deepinfer.frontend.server.errors import APIError, decode_error
from deepinfer.frontend.server.state import ServerState

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


@pytest.mark.parametrize("value,expected", [("", True), (', "speculative_decoding": null', True),
                                            (', "speculative_decoding": true', True),
                                            (', "speculative_decoding": false', False)])
def test_speculative_decoding_opt_out(value, expected):
    assert chat_params(chat_req(value), 10).speculative is expected
    comp = decode_completion(b'{"prompt": "x"' + value.encode() + b"}")
    assert completion_params(comp, 10).speculative is expected


def test_speculative_decoding_must_be_a_bool():
    with pytest.raises(msgspec.ValidationError) as exc:
        chat_req(', "speculative_decoding": "no"')
    assert decode_error(exc.value).param == "speculative_decoding"


@pytest.mark.parametrize("body,param", [
    (b'{"messages": 3}', "messages"),
    (b'{"messages": [{"role": "user"}], "temperature": "hot"}', "temperature"),
    (b'{"messages": [], "stream_options": {"include_usage": 1}}', "stream_options.include_usage"),
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


INT32_MAX = 2**31 - 1


@pytest.mark.parametrize("extra,param", [
    (', "top_k": -2', "top_k"),
    (f', "seed": {2**63}', "seed"),
    (f', "seed": {2**64 - 1}', "seed"),
    (f', "seed": {-(2**63) - 1}', "seed"),
    (f', "stop_token_ids": [{2**31}]', "stop_token_ids"),
    (', "stop_token_ids": [3, -1]', "stop_token_ids"),
    (', "n": 0', "n"),
    (', "n": 17', "n"),
    (', "max_tokens": 0', "max_tokens"),
    (f', "max_tokens": {2**64}', "max_tokens"),
    (f', "max_completion_tokens": {2**63}', "max_completion_tokens"),
    (', "logprobs": true, "top_logprobs": -1', "top_logprobs"),
    (', "logprobs": true, "top_logprobs": 21', "top_logprobs"),
])
def test_out_of_range_integers_name_the_field(extra, param):
    with pytest.raises(APIError) as exc:
        chat_params(chat_req(extra), 10)
    assert exc.value.status == 400 and exc.value.param == param


@pytest.mark.parametrize("extra,param", [
    (', "logprobs": -1', "logprobs"),
    (', "logprobs": 21', "logprobs"),
    (f', "best_of": {2**64}', "best_of"),
    (f', "seed": {2**63}', "seed"),
])
def test_out_of_range_completion_integers_name_the_field(extra, param):
    with pytest.raises(APIError) as exc:
        completion_params(decode_completion(b'{"prompt": "x"' + extra.encode() + b"}"), 10)
    assert exc.value.status == 400 and exc.value.param == param


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63 - 1])
def test_signed_64_bit_seeds_are_accepted(seed):
    assert chat_params(chat_req(f', "seed": {seed}'), 10).seed == seed


@pytest.mark.parametrize("top_k,expected", [
    (-1, 0), (0, 0), (1, 1), (50, 50), (INT32_MAX, INT32_MAX),
    # past the vocabulary top-k is off anyway: clamped into int32, never an overflow downstream
    (2**31, INT32_MAX), (2**63, INT32_MAX), (2**64 - 1, INT32_MAX), (2**100, INT32_MAX),
])
def test_top_k_is_clamped_into_int32(top_k, expected):
    assert chat_params(chat_req(f', "top_k": {top_k}'), 10).top_k == expected


def test_stop_token_ids_bounds():
    assert chat_params(chat_req(f', "stop_token_ids": [0, {INT32_MAX}]'), 10).stop_token_ids == [
        0, INT32_MAX]


@pytest.mark.parametrize("field", [
    "temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty",
])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_floats_name_the_field(field, value):
    req = msgspec.structs.replace(chat_req(), **{field: value})
    with pytest.raises(APIError) as exc:
        chat_params(req, 10)
    assert exc.value.status == 400 and exc.value.param == field


@pytest.mark.parametrize("body", [b"1e999", b"NaN", b"Infinity"])
def test_non_finite_json_numbers_are_400(body):
    with pytest.raises(msgspec.MsgspecError) as exc:
        decode_chat(b"{" + MSG + b', "top_p": ' + body + b"}")
    assert decode_error(exc.value).status == 400


@pytest.mark.parametrize("prompt", [[2**31], [2**40], [1, 2**64], [[1], [2, 2**31]], [-1]])
def test_token_ids_outside_int32_name_the_prompt(prompt):
    req = decode_completion(msgspec.json.encode({"prompt": prompt}))
    with pytest.raises(APIError) as exc:
        completion_prompts(req)
    assert exc.value.status == 400 and exc.value.param == "prompt"


def test_largest_int32_token_id_passes_the_api():
    # (past the model's vocabulary the tokenizer process rejects it later, also with a 400)
    assert completion_prompts(decode_completion(b'{"prompt": [0, 2147483647]}')) == [
        [0, INT32_MAX]]
