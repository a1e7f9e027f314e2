"""The tokenizer's part in prompt logprobs: the workers' raw pieces become one entry per prompt
token with texts, sent once, on the request's first output with a token (or its finish)."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.engine.protocol import (
    FinishReason,
    GenerateRequest,
    PromptChunkLogprobs,
    SamplingParams,
    TokenDelta,
    pack_ids,
)
from deepinfer.engine.tokenizer.prompt_logprobs import prompt_logprob_list
from deepinfer.engine.tokenizer.tokenizer import Tokenizer
from deepinfer.engine.tokenizer.tokenizer_process import TokenizerService


def piece(start: int, logprobs: list[float], top: list[list[int]]) -> PromptChunkLogprobs:
    n = len(logprobs)
    top_ids = np.asarray(top, np.int32).reshape(n, -1)
    return PromptChunkLogprobs(start, np.asarray(logprobs, np.float32).tobytes(),
                               np.arange(1, n + 1, dtype=np.int32).tobytes(), top_ids.tobytes(),
                               (-top_ids).astype(np.float32).tobytes())


def test_pieces_become_one_entry_per_prompt_token():
    prompt = [10, 11, 12, 13, 14]
    pieces = [piece(1, [-1.0, -2.0], [[7, 8], [9, 10]]), piece(3, [-3.5], [[1, 2]])]
    out = prompt_logprob_list(prompt, pieces, lambda t: f"<{t}>")
    assert [e.token_id for e in out] == prompt
    assert [e.token for e in out] == [f"<{t}>" for t in prompt]
    # Position 0 has none; position 4 no piece covered: null, not a made-up number.
    assert [e.logprob for e in out] == [None, -1.0, -2.0, -3.5, None]
    assert [e.rank for e in out] == [None, 1, 2, 1, None]
    assert [(t.token_id, t.token, t.logprob) for t in out[2].top] == [
        (9, "<9>", -9.0), (10, "<10>", -10.0)]
    # k = 0: the prompt's token alone.
    bare = prompt_logprob_list(prompt[:2], [piece(1, [-0.5], [[]])], str)
    assert bare[1].logprob == -0.5 and bare[1].top == []


@pytest.fixture(scope="module")
def tok(default_model):
    return Tokenizer(str(default_model))


def test_sent_once_on_the_first_output_with_a_token(tok):
    service = TokenizerService(tok, 1024)
    tokenized, first = service.tokenize(GenerateRequest(
        "r", SamplingParams(prompt_logprobs=1), prompt="The capital of France"))
    ids = tok.encode("The capital of France")
    assert first.prompt_logprobs == []
    scores = [piece(1, [-1.0] * (len(ids) - 1), [[5]] * (len(ids) - 1))]
    outs, _ = service.outputs(TokenDelta("r", pack_ids([tok.encode(" is")[0]]),
                                         prompt_logprobs=scores))
    got = outs[0].prompt_logprobs
    assert [e.token_id for e in got] == ids and got[0].logprob is None
    assert "".join(e.token for e in got) == "The capital of France"
    outs, _ = service.outputs(TokenDelta("r", pack_ids([tok.encode(" Paris")[0]]),
                                         finish_reason=FinishReason.STOP))
    assert outs[0].prompt_logprobs == []


def test_a_request_that_generates_nothing_gets_them_on_its_finish(tok):
    service = TokenizerService(tok, 1024)
    service.tokenize(GenerateRequest("r", SamplingParams(max_tokens=0, prompt_logprobs=0),
                                     prompt_token_ids=pack_ids([1, 2, 3])))
    outs, _ = service.outputs(TokenDelta("r", b"", finish_reason=FinishReason.LENGTH,
                                         prompt_logprobs=[piece(1, [-1.0, -2.0], [[], []])]))
    assert [e.logprob for e in outs[0].prompt_logprobs] == [None, -1.0, -2.0]
