"""The token that stopped an output (EOS or a stop token id) is counted, not written: with
special tokens kept (`skip_special_tokens: false`, which the chat path sets for Mistral's
[TOOL_CALLS]), the EOS text `<|im_end|>` ended every plain answer."""

from __future__ import annotations

import pytest

from deepinfer.engine.protocol import (
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenDelta,
    pack_ids,
)
from deepinfer.engine.tokenizer.tokenizer import Tokenizer
from deepinfer.engine.tokenizer.tokenizer_process import TokenizerService

EOS = 2  # the default model's <|im_end|>


@pytest.fixture(scope="module")
def tok(default_model):
    return Tokenizer(str(default_model))


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_the_stop_token_is_counted_not_written(tok, skip_special_tokens):
    service = TokenizerService(tok, 1024)
    params = SamplingParams(skip_special_tokens=skip_special_tokens, stop_token_ids=[EOS])
    service.tokenize(GenerateRequest("r", params, prompt="The capital of France is"))
    paris = tok.encode(" Paris", add_special_tokens=False)
    outs, _ = service.outputs(TokenDelta("r", pack_ids(paris)))
    done, _ = service.outputs(TokenDelta("r", pack_ids([tok.encode(".")[0], EOS]),
                                         finish_reason=FinishReason.STOP))
    assert outs[0].text + done[0].text == " Paris."
    assert done[0].completion_tokens == len(paris) + 2
    assert done[0].finish_reason == FinishReason.STOP


def test_only_a_stop_ends_without_its_text(tok):
    """Cut by max_tokens, the last token is the output's own."""
    service = TokenizerService(tok, 1024)
    service.tokenize(GenerateRequest("r", SamplingParams(skip_special_tokens=False),
                                     prompt="The capital of France is"))
    done, _ = service.outputs(TokenDelta("r", pack_ids(tok.encode(" Paris")),
                                         finish_reason=FinishReason.LENGTH))
    assert done[0].text == " Paris"
