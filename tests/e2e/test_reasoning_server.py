"""`deepinfer serve --reasoning-parser qwen3` on a checkpoint whose greedy reply is a fixed
script with a reasoning block (scripts/scripted_model.py), through the real `openai` SDK:
reasoning_content apart from the answer, whole and streamed, and the same text without the
parser."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import openai
import pytest

from scripts.scripted_model import save_scripted_model
from scripts.server_process import ServerProcess

REASONING, ANSWER = "Adding two and three", "The answer is five"
SCRIPT = f"<think>{REASONING}</think>{ANSWER}"
ASK = [{"role": "user", "content": "What is two plus three?"}]


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory):
    return save_scripted_model(tmp_path_factory.mktemp("scripted") / "model", SCRIPT,
                               ("<think>", "</think>"))


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0,
                         timeout=60)


@contextlib.contextmanager
def _served(model, *args: str) -> Iterator[openai.OpenAI]:
    """A server of `model` (named "s") with `args`, and a client of it; it must stop cleanly."""
    srv = ServerProcess(model, "--num-kv-blocks", "64", "--served-model-name", "s", *args)
    try:
        yield _client(srv)
    finally:
        assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(scripted_dir):
    with _served(scripted_dir, "--reasoning-parser", "qwen3") as client:
        yield client


def _ask(client: openai.OpenAI, stream: bool, **kw) -> tuple[str, str]:
    """(reasoning, content) of a chat answer to ASK, whole or streamed."""
    kw = dict(model="s", messages=ASK, max_tokens=40, temperature=0, **kw)
    if not stream:
        message = client.chat.completions.create(**kw).choices[0].message
        return message.model_extra["reasoning_content"], message.content
    reasoning = content = ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    return reasoning, content


def test_the_reasoning_comes_apart_from_the_answer(client):
    r = client.chat.completions.create(model="s", messages=ASK, max_tokens=40, temperature=0)
    message = r.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == \
        REASONING
    assert r.choices[0].finish_reason == "stop"


def test_streamed_reasoning_then_answer(client):
    stream = client.chat.completions.create(model="s", messages=ASK, max_tokens=40,
                                            temperature=0, stream=True)
    reasoning, content = "", ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == (REASONING, ANSWER)


ONLY_FIVE = {"type": "object", "properties": {"answer": {"enum": [5]}}, "required": ["answer"],
             "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_constrains_only_the_answer(client, stream):
    """The grammar starts after `</think>`: the reasoning is the model's own, the answer the
    schema's (a grammar from the first token would have forced JSON into the reasoning)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ONLY_FIVE}}
    reasoning, content = _ask(client, stream, response_format=fmt)
    assert reasoning == REASONING
    assert json.loads(content) == {"answer": 5}


def test_without_the_parser_the_model_writes_the_script(scripted_dir):
    with _served(scripted_dir) as client:
        r = client.chat.completions.create(model="s", messages=ASK, max_tokens=40,
                                           temperature=0)
        assert r.choices[0].message.content == SCRIPT


@pytest.fixture(scope="module")
def r1_client(tmp_path_factory):
    """DeepSeek-R1's way: the template opens `<think>` in the prompt, the model only closes it.
    The script follows `<think>` alone, so the model writes it only if the prompt the server
    renders ends with it (the template in tokenizer_config.json wins over chat_template.jinja:
    an edit of the latter alone never reached the prompt, and the test passed anyway)."""
    model = save_scripted_model(tmp_path_factory.mktemp("r1") / "model", f"{REASONING}</think>"
                                f"{ANSWER}", ("<think>", "</think>"), prompt_end="<think>")
    opening = "{{ '<|im_start|>assistant\n' }}"
    config = model / "tokenizer_config.json"
    cfg = json.loads(config.read_text())
    assert opening in cfg["chat_template"]
    cfg["chat_template"] = cfg["chat_template"].replace(
        opening, "{{ '<|im_start|>assistant\n<think>' }}")
    config.write_text(json.dumps(cfg))
    (model / "chat_template.jinja").write_text(cfg["chat_template"])
    with _served(model, "--reasoning-parser", "deepseek_r1") as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
def test_deepseek_r1_reasoning_opened_by_the_template(r1_client, stream):
    assert _ask(r1_client, stream) == (REASONING, ANSWER)


@pytest.fixture(scope="module")
def answers_at_once(tmp_path_factory):
    """Qwen3 answering without `<think>` (its README: then the answer has no reasoning)."""
    model = save_scripted_model(tmp_path_factory.mktemp("plain") / "model", ANSWER,
                                ("<think>", "</think>"))
    with _served(model, "--reasoning-parser", "qwen3") as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_without_reasoning_follows_the_grammar(answers_at_once, stream):
    """The grammar waited for a `</think>` that never came, so the model wrote its script
    unconstrained; now it starts with the first token that is not `<think>`."""
    reasoning, content = _ask(answers_at_once, stream)
    assert (reasoning or "", content) == ("", ANSWER)  # unconstrained: the script
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ONLY_FIVE}}
    reasoning, content = _ask(answers_at_once, stream, response_format=fmt)
    assert (reasoning or "", json.loads(content)) == ("", {"answer": 5})
