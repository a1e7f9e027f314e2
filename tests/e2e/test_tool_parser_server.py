"""`deepinfer serve --tool-call-parser deepseek_v31` on a checkpoint whose greedy reply is a
fixed script in DeepSeek-V3.1's call format (scripts/scripted_model.py), through the real
`openai` SDK: the call comes back as message.tool_calls, whole and streamed, the text before it
as content."""

from __future__ import annotations

import json

import openai
import pytest

from scripts.scripted_model import save_scripted_model
from scripts.server_process import ServerProcess

MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
           "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
RUN_B, B, SEP, E, RUN_E = MARKERS
SCRIPT = f'Checking.{RUN_B}{B}get_weather{SEP}{{"city": "Rome"}}{E}{RUN_E}'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model = save_scripted_model(tmp_path_factory.mktemp("scripted") / "model", SCRIPT, MARKERS)
    srv = ServerProcess(model, "--num-kv-blocks", "64", "--served-model-name", "s",
                        "--tool-call-parser", "deepseek_v31", "--enable-auto-tool-choice")
    yield openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0,
                        timeout=60)
    assert srv.stop() == 0, srv.output()


def test_the_call_comes_back_as_tool_calls(client):
    r = client.chat.completions.create(model="s", messages=ASK, tools=TOOLS, max_tokens=40,
                                       temperature=0)
    choice = r.choices[0]
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome"}
    assert choice.finish_reason == "tool_calls"


def test_the_call_streams_as_tool_call_deltas(client):
    stream = client.chat.completions.create(model="s", messages=ASK, tools=TOOLS,
                                            max_tokens=40, temperature=0, stream=True)
    content, name, arguments, finish = "", None, "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            name = name or call.function.name
            arguments += call.function.arguments or ""
        finish = choice.finish_reason or finish
    assert (content, name, json.loads(arguments), finish) == (
        "Checking.", "get_weather", {"city": "Rome"}, "tool_calls")
