"""Prompt logprobs through the real engine and the real server, against HF transformers:
log_softmax of the model's logits at each prompt position, at the next prompt token.

Prompts are longer than the prefill chunk (several chunks each), and a prompt already in the
prefix cache must still come back with all of its prompt logprobs."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.tokenizer.tokenizer import Tokenizer
from scripts.server_process import ServerProcess

TOL = 1e-4
CHUNK = 16  # prefill chunk (tokens): every prompt below spans several


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return model.eval()


def hf_prompt_logprobs(hf, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per prompt position 1..P-1 (position 0 has none): (rows [P-1, V] of log-probabilities
    predicting it, the logprob of the prompt's own token there)."""
    with torch.no_grad():
        rows = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(dim=-1)
    return rows, rows.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def prompts(n: int, lengths=(40, 23, 70)) -> list[list[int]]:
    rng = np.random.default_rng(n)
    return [rng.integers(3, 40000, size=k).tolist() for k in lengths]


def max_error(got: list[float | None], want: torch.Tensor) -> float:
    assert got[0] is None and len(got) == len(want) + 1
    return float((torch.tensor(got[1:]) - want).abs().max())


# ------------------------------------------------------------------ offline engine


def test_offline_llm_matches_hf_chunked_and_from_the_prefix_cache(tiny_model_dir, hf):
    batch = prompts(1)
    with LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=4, prefill_chunk_size=CHUNK,
             max_num_batched_tokens=2 * CHUNK) as llm:
        plain = llm.generate(batch, SamplingParams(max_tokens=1, temperature=0.0))
        scored = llm.generate(batch, SamplingParams(max_tokens=2, temperature=0.0,
                                                    prompt_logprobs=3))
        again = llm.generate(batch, SamplingParams(max_tokens=0, prompt_logprobs=0))
        hit = llm.generate(batch, SamplingParams(max_tokens=1, temperature=0.0))
    for ids, p, s, a, h in zip(batch, plain, scored, again, hit):
        rows, want = hf_prompt_logprobs(hf, ids)
        assert [e.token_id for e in s.prompt_logprobs] == ids
        assert max_error([e.logprob for e in s.prompt_logprobs], want) < TOL
        for e, row in zip(s.prompt_logprobs[1:], rows):
            assert e.rank == int((row >= row[e.token_id]).sum())
            assert [t.token_id for t in e.top] == row.topk(3).indices.tolist()
        # max_tokens 0: the prompt scored, nothing generated; the first request had cached
        # the prompt (the last request hits it), this one computed it all again.
        assert a.token_ids == [] and a.finish_reason == "length" and a.cached_tokens == 0
        assert max_error([e.logprob for e in a.prompt_logprobs], want) < TOL
        assert p.prompt_logprobs == [] and h.cached_tokens > 0
        assert s.token_ids[:1] == p.token_ids


def test_with_speculative_decoding(tiny_model_dir, hf):
    """An n-gram proposer drafts for the decodes after a prompt scored in chunks."""
    batch = [[5, 6, 7, 8, 9, 10] * 6]  # the tiny random model repeats it: lookups hit
    greedy = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=4, prefill_chunk_size=CHUNK,
             speculative_method="ngram", num_speculative_tokens=3) as llm:
        plain = llm.generate(batch, SamplingParams(**greedy))
        scored = llm.generate(batch, SamplingParams(prompt_logprobs=2, **greedy))
        stats = llm.stats()
    assert stats.spec_draft_tokens > 0
    assert scored[0].token_ids == plain[0].token_ids
    _, want = hf_prompt_logprobs(hf, batch[0])
    assert max_error([e.logprob for e in scored[0].prompt_logprobs], want) < TOL


def test_two_tensor_parallel_ranks(tiny_model_dir, hf):
    """Both ranks compute the logits (the LM head gathers the vocabulary), rank 0 answers."""
    batch = prompts(7, lengths=(37, 12))
    with LLM(str(tiny_model_dir), tensor_parallel_size=2, num_kv_blocks=64, block_size=4,
             prefill_chunk_size=8, max_num_batched_tokens=16) as llm:
        outs = llm.generate(batch, SamplingParams(max_tokens=3, temperature=0.0,
                                                  prompt_logprobs=2))
    for ids, out in zip(batch, outs):
        _, want = hf_prompt_logprobs(hf, ids)
        assert max_error([e.logprob for e in out.prompt_logprobs], want) < TOL
        assert len(out.token_ids) == 3


# ------------------------------------------------------------------ server


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ServerProcess(tiny_model_dir, "--num-kv-blocks", "256", "--block-size", "4",
                        "--max-model-len", "1024", "--served-model-name", "tiny",
                        "--prefill-chunk-size", str(CHUNK),
                        "--max-num-batched-tokens", str(2 * CHUNK))
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                         timeout=60)


def test_echo_with_logprobs_puts_the_prompts_logprobs_first(client, hf):
    ids = prompts(2)[2]  # 70 tokens: five chunks
    rows, want = hf_prompt_logprobs(hf, ids)
    out = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=3,
                                    max_tokens=2, temperature=0)
    choice = out.choices[0]
    lp = choice.logprobs
    p = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == p + 2
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    err = max_error(lp.token_logprobs[:p], want)
    assert err < TOL, err
    for i in range(1, p):
        assert lp.tokens[i] in lp.top_logprobs[i]  # the prompt's own token is always there
        assert len(lp.top_logprobs[i]) <= 4
        best = int(rows[i - 1].argmax())
        assert max(lp.top_logprobs[i].values()) == pytest.approx(float(rows[i - 1, best]),
                                                                 abs=TOL)
    assert choice.text.startswith("".join(lp.tokens[:p]))
    assert all(v is not None for v in lp.token_logprobs[p:])  # the two generated tokens


def test_a_cached_prompt_keeps_its_prompt_logprobs(client, hf):
    ids = prompts(3)[0]
    _, want = hf_prompt_logprobs(hf, ids)
    kw = dict(model="tiny", prompt=ids, temperature=0)
    client.completions.create(max_tokens=1, **kw)  # now the prompt is in the prefix cache
    assert client.completions.create(max_tokens=1, **kw).usage.prompt_tokens_details \
        .cached_tokens > 0
    first = client.completions.create(max_tokens=1, echo=True, logprobs=1, **kw)
    second = client.completions.create(max_tokens=1, echo=True, logprobs=1, **kw)
    p = len(ids)
    for out in (first, second):
        assert max_error(out.choices[0].logprobs.token_logprobs[:p], want) < TOL
    assert first.choices[0].logprobs.token_logprobs == second.choices[0].logprobs.token_logprobs


def test_max_tokens_zero_with_echo_scores_the_prompt(client, hf):
    ids = prompts(4)[1]
    _, want = hf_prompt_logprobs(hf, ids)
    out = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=0,
                                    max_tokens=0)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(ids)
    assert choice.text == "".join(choice.logprobs.tokens)
    assert max_error(choice.logprobs.token_logprobs, want) < TOL


def check_vllm_shape(prompt_logprobs: list, ids: list[int], rows: torch.Tensor, k: int) -> float:
    """vLLM's prompt_logprobs: [None, {token id: {logprob, rank, decoded_token}}, ...]; each
    position holds the prompt's token and the top k. Returns the largest error."""
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    err = 0.0
    for pos in range(1, len(ids)):
        entries, row = prompt_logprobs[pos], rows[pos - 1]
        own = entries[str(ids[pos])]
        err = max(err, abs(own["logprob"] - float(row[ids[pos]])))
        assert own["rank"] == int((row >= row[ids[pos]]).sum())
        assert isinstance(own["decoded_token"], str)
        top = row.topk(k)
        for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entries[str(tid)]["rank"] == rank
            assert entries[str(tid)]["logprob"] == pytest.approx(value, abs=TOL)
        assert len(entries) in (k, k + 1)
    return err


def test_prompt_logprobs_on_completions(client, hf):
    ids = prompts(5)[0]
    rows, _ = hf_prompt_logprobs(hf, ids)
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=1,
                                    extra_body={"prompt_logprobs": 2})
    choice = out.choices[0]
    assert choice.logprobs is None and not choice.text.startswith("<")
    assert check_vllm_shape(choice.model_extra["prompt_logprobs"], ids, rows, 2) < TOL


def test_prompt_logprobs_on_chat(client, hf, tiny_model_dir):
    messages = [{"role": "user", "content": "Score this prompt, every token of it, please."}]
    _, ids = Tokenizer(str(tiny_model_dir)).encode_chat(messages)
    rows, _ = hf_prompt_logprobs(hf, ids)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                         extra_body={"prompt_logprobs": 1})
    assert len(ids) > CHUNK and out.usage.prompt_tokens == len(ids)
    err = check_vllm_shape(out.model_extra["prompt_logprobs"], ids, rows, 1)
    assert err < TOL, err
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert "prompt_logprobs" not in (plain.model_extra or {})


def test_streamed_echo_sends_the_prompts_logprobs_first(server, hf):
    ids = prompts(6)[1]
    _, want = hf_prompt_logprobs(hf, ids)
    body = {"model": "tiny", "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 3,
            "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["logprobs"]["top_logprobs"][0] is None
    assert max_error(first["logprobs"]["token_logprobs"], want) < TOL
    assert first["text"] == "".join(first["logprobs"]["tokens"])


@pytest.mark.parametrize("value", [-1, 21, "3", 1.5, True, None])
def test_bad_prompt_logprobs_is_a_400_naming_it(server, value):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1, "prompt_logprobs": value}
    if value is None:  # valid on its own: refused only with stream (as vLLM)
        body |= {"prompt_logprobs": 1, "stream": True}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_logprobs"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
            "prompt_logprobs": body["prompt_logprobs"], "stream": body.get("stream", False)}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_max_tokens_zero_needs_a_scoring_request(server):
    r = httpx.post(f"{server.base_url}/v1/completions",
                   json={"model": "tiny", "prompt": "Hi", "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
