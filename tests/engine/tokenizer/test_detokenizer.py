"""Incremental detokenization and stop strings with the default model's real tokenizer."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from deepinfer.engine.protocol import ChatMessage, GenerateRequest, SamplingParams
from deepinfer.engine.tokenizer.detokenizer import IncrementalDetokenizer
from deepinfer.engine.tokenizer.tokenizer import ChatTemplateError, Tokenizer, chat_dict


@pytest.fixture(scope="module")
def tok(default_model):
    return Tokenizer(str(default_model))


def stream(tok, text: str, stop: list[str]) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, stop, skip_special_tokens=True)
    pieces = []
    for tid in tok.encode(text, add_special_tokens=False):
        d.add([tid])
        pieces.append(d.take(final=False))
        if d.stopped:
            break
    pieces.append(d.take(final=True))
    return pieces, d


def test_utf8_safe_across_tokens(tok):
    text = "héllo wörld 日本語 emoji 🎉 done"
    pieces, _ = stream(tok, text, [])
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_spanning_tokens_is_cut_and_excluded(tok):
    text = "The answer is forty-two. END OF ANSWER and more words"
    pieces, d = stream(tok, text, ["END OF ANSWER"])
    assert d.stopped
    assert "".join(pieces) == "The answer is forty-two. "


def test_earliest_stop_string_wins(tok):
    pieces, d = stream(tok, "alpha beta gamma delta", ["delta", "beta"])
    assert d.stopped and "".join(pieces) == "alpha "


def test_chat_template_matches_transformers(tok, default_model):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_model))
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    text, ids = tok.encode_chat(msgs, add_generation_prompt=True)
    assert text == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ref = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    assert ids == list(ref)


def test_ids_past_the_vocabulary_do_not_break_the_stream(tok):
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    ids = tok.encode("hello world", add_special_tokens=False)
    d.add([ids[0], tok.vocab_size + 5, *ids[1:]])
    assert d.take(final=True) == "hello world"


def test_template_kwargs_and_sent_back_reasoning_reach_the_template(default_model):
    tok = Tokenizer(str(default_model))  # its own: a template that shows what it was given
    tok.chat_template = ("{% for m in messages %}[{{ m.role }}|{{ m.reasoning_content }}]"
                         "{% endfor %}{{ 'T' if thinking else 'F' }}")
    msgs = [chat_dict(ChatMessage("assistant", "4", reasoning_content="2+2")),
            chat_dict(ChatMessage("user", "and 3+3?"))]
    assert tok.apply_chat_template(msgs, True, None, {"thinking": True}) == \
        "[assistant|2+2][user|]T"
    assert tok.apply_chat_template(msgs, True).endswith("F")


def test_a_template_error_is_a_request_error_not_a_crash(default_model):
    from deepinfer.engine.protocol import ChatMessage, GenerateRequest, SamplingParams
    from deepinfer.engine.tokenizer.tokenizer_process import TokenizerService

    tok = Tokenizer(str(default_model))  # its own: the template is broken on purpose
    tok.chat_template = "{{ messages[0].nonexistent.deeper }}"
    tok._compiled = None
    service = TokenizerService(tok, 1024)
    req = GenerateRequest("r", SamplingParams(), messages=[ChatMessage("user", "hi")])
    tokenized, first = service.tokenize(req)
    assert tokenized is None and first.error and "tokenize" in first.error


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory):
    """A small Llama-2/Mistral-style tokenizer: Metaspace pre-tokenizer and decoder, which drop
    the leading space of a sequence's first token."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    hf.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                    decoders.ByteFallback(), decoders.Fuse()])
    corpus = ["The capital of France is Paris.", "Paris is a city in France."] * 50
    hf.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    out = tmp_path_factory.mktemp("sentencepiece")
    hf.save(str(out / "tokenizer.json"))
    return out


def test_sentencepiece_completion_keeps_its_leading_space(sentencepiece_dir):
    from deepinfer.engine.protocol import GenerateRequest, SamplingParams, TokenDelta, pack_ids
    from deepinfer.engine.tokenizer.tokenizer_process import TokenizerService

    tok = Tokenizer(str(sentencepiece_dir))
    prompt = "The capital of France is"
    completion = tok.encode("The capital of France is Paris.")[len(tok.encode(prompt)):]
    for stop, expected in (([], " Paris."), ([" Paris"], "")):
        service = TokenizerService(tok, 1024)
        service.tokenize(GenerateRequest("r", SamplingParams(stop=stop), prompt=prompt))
        out, stop_hit = service.detokenize(TokenDelta("r", pack_ids(completion)))
        assert out.text == expected
        assert stop_hit == bool(stop)


def test_tokens_after_a_stop_string_in_one_delta_are_dropped(tok):
    """A speculative step returns several tokens: the output ends at the stop string."""
    from deepinfer.engine.protocol import (
        GenerateRequest,
        SampledLogprobs,
        SamplingParams,
        TokenDelta,
        pack_ids,
    )
    from deepinfer.engine.tokenizer.tokenizer_process import TokenizerService

    service = TokenizerService(tok, 1024)
    service.tokenize(GenerateRequest("r", SamplingParams(stop=[" END"], logprobs=0),
                                     prompt="Say it"))
    ids = tok.encode(" alpha END beta gamma", add_special_tokens=False)
    lps = [SampledLogprobs(t, -1.0) for t in ids]
    out, stop_hit = service.detokenize(TokenDelta("r", pack_ids(ids), lps))
    assert stop_hit and out.text == " alpha"
    kept = tok.encode(" alpha END", add_special_tokens=False)
    assert out.token_ids == pack_ids(kept) and out.completion_tokens == len(kept)
    assert [lp.chosen.token_id for lp in out.logprobs] == kept


@pytest.mark.parametrize("begun", ["The capital", "  Sure: {\"a\": ", "x"])
def test_a_final_assistant_message_is_continued_as_transformers_does(tok, default_model, begun):
    """A prefill: the prompt ends with the assistant's text begun, not with its turn closed
    (held to transformers' continue_final_message)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_model))
    msgs = [{"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": begun}]
    text, ids = tok.encode_chat(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text == hf.apply_chat_template(msgs, continue_final_message=True, tokenize=False)
    assert text.endswith(begun)  # this template keeps the text as sent, spaces included
    ref = hf.apply_chat_template(msgs, continue_final_message=True, tokenize=True)
    assert ids == list(ref["input_ids"] if isinstance(ref, Mapping) else ref)


def test_an_empty_or_misplaced_prefill(tok):
    msgs = [{"role": "user", "content": "Hi"}]
    # An empty answer begun is a new assistant turn.
    assert tok.apply_chat_template([*msgs, {"role": "assistant", "content": ""}],
                                   continue_final_message=True) == tok.apply_chat_template(msgs)
    with pytest.raises(ChatTemplateError, match="only an assistant message"):
        tok.apply_chat_template(msgs, continue_final_message=True)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    with pytest.raises(ChatTemplateError, match="tool calls"):
        tok.apply_chat_template([*msgs, {"role": "assistant", "content": "", "tool_calls": [call]}],
                                continue_final_message=True)


@pytest.mark.parametrize("as_chat", [False, True])
def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized(tok, monkeypatch,
                                                                       as_chat):
    """Tokenizing a 7 MiB prompt held the tokenizer process (and every stream's
    detokenization behind it) for 34 s only to refuse it: a text longer than the context could
    hold in the longest tokens is refused at once, in the words of a context overflow."""
    from deepinfer.engine.tokenizer.tokenizer_process import TokenizerService

    encoded: list[int] = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: encoded.append(len(text))
                        or encode(text, *a, **k))
    service = TokenizerService(tok, 1024)
    text = "word " * (2 * tok.max_token_chars * 1024 // 5 + 1)

    def ask(prompt: str, count_only: bool = False):
        if as_chat:
            return GenerateRequest("r", SamplingParams(), messages=[ChatMessage("user", prompt)],
                                   count_only=count_only)
        return GenerateRequest("r", SamplingParams(), prompt=prompt, count_only=count_only)

    for count_only in (False, True):
        tokenized, first = service.tokenize(ask(text, count_only))
        assert tokenized is None and "the prompt has at least" in first.error
        assert "context length" in first.error and encoded == []
    _, first = service.tokenize(ask("word " * 100))  # within reach: tokenized as ever
    assert first.error is None and len(encoded) == 1
