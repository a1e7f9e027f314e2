"""The input-grounded dataset of the serving benchmark: fixed chat prompts, answers end at EOS."""

from __future__ import annotations

import pytest

from deepinfer.frontend import cli
from deepinfer.frontend.bench import serving
from deepinfer.frontend.bench.client import payload
from deepinfer.frontend.bench.datasets import input_grounded_requests, random_requests
from deepinfer.frontend.bench.grounded_prompts import GROUNDED_PROMPTS

CHAT = "/v1/chat/completions"


def test_prompts_are_fixed_instructions_over_text_to_copy():
    assert len(GROUNDED_PROMPTS) == 16 and len(set(GROUNDED_PROMPTS)) == 16
    for prompt in GROUNDED_PROMPTS:
        instruction, body = prompt.split("\n\n", 1)
        assert instruction.strip() and "\n" not in instruction
        assert len(body) >= 250  # enough text for the answer to copy
    assert "rename the variable `x` to `count`" in GROUNDED_PROMPTS[0]


def test_requests_cycle_through_the_prompts_and_keep_eos():
    reqs = input_grounded_requests(18, max_tokens=64)
    assert [r.prompt for r in reqs] == list(GROUNDED_PROMPTS) + list(GROUNDED_PROMPTS[:2])
    assert all(r.output_len == 64 and r.ignore_eos is False for r in reqs)
    assert reqs[0].input_words == len(GROUNDED_PROMPTS[0].split())


def test_payload_never_asks_a_grounded_answer_to_ignore_eos():
    grounded = payload(CHAT, "m", input_grounded_requests(1, 32)[0], 0.0, ignore_eos=True)
    assert "ignore_eos" not in grounded and grounded["max_tokens"] == 32
    assert grounded["messages"] == [{"role": "user", "content": GROUNDED_PROMPTS[0]}]
    rand = payload(CHAT, "m", random_requests(1, 4, 4, 0.0, seed=0)[0], 0.0, ignore_eos=True)
    assert rand["ignore_eos"] is True  # the other datasets are unchanged


def test_cli_builds_grounded_requests():
    args = cli.build_parser().parse_args(
        ["bench", "serve", "--dataset", "input-grounded", "--endpoint", CHAT,
         "--num-prompts", "3", "--grounded-max-tokens", "40"])
    serving.check_args(args)
    reqs = serving.build_requests(args)
    assert [r.prompt for r in reqs] == list(GROUNDED_PROMPTS[:3])
    assert {r.output_len for r in reqs} == {40}
    default = cli.build_parser().parse_args(["bench", "serve", "--dataset", "input-grounded"])
    assert default.grounded_max_tokens == 256


def test_grounded_prompts_need_the_chat_endpoint(capsys):
    args = cli.build_parser().parse_args(["bench", "serve", "--dataset", "input-grounded"])
    with pytest.raises(ValueError, match="chat/completions"):
        serving.check_args(args)
    assert serving.run(args) == 2  # refused before any connection is made
    assert "--endpoint /v1/chat/completions" in capsys.readouterr().err
