"""tokenizer.json, tokenizer_config.json and chat_template.jinja from a GGUF's tokenizer.ggml.*.

Built with the `tokenizers` library alone, the way transformers' GGUF loader builds them:
- GPT-2 style byte-level BPE (`tokenizer.ggml.model` "gpt2": SmolLM2, Llama 3, Qwen): BPE from
  the tokens and merges, byte-level pre-tokenizer (GPT-2 regex, no prefix space) and decoder;
- Gemma's sentencepiece BPE (`tokenizer.ggml.model` "llama" in a gemma3 file): spaces become
  "▁" before BPE, unknown bytes fall back to <0xNN> tokens, and the merges, which the file does
  not list, are rebuilt from the vocabulary (see `_vocabulary_merges`).
Either way, control tokens (type 3) become special added tokens and user-defined ones (type 4)
added tokens.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from deepinfer.engine.model_store.errors import ModelPrepareError

_CONTROL, _USER_DEFINED = 3, 4
# llama.cpp pre-tokenizer names whose split is GPT-2's own regex (the ByteLevel default), as
# transformers treats them. (SmolLM2's also splits digits, but its vocabulary has no token with
# two digits, so the ids are the same.)
_GPT2_SPLIT = {"default", "gpt2", "gpt-2", "smollm", "starcoder", "refact"}


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the spelling of every byte-level BPE token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _spell(token: str) -> str:
    """A token in the byte alphabet; one written in plain UTF-8 is re-spelled byte by byte."""
    alphabet = _bytes_to_unicode()
    if set(token) <= set(alphabet.values()):
        return token
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind == "llama" and meta.get("general.architecture") == "gemma3":
        return _gemma_tokenizer(meta)
    if kind != "gpt2" or pre not in _GPT2_SPLIT:
        raise ModelPrepareError(
            f"GGUF tokenizer {kind!r} (pre-tokenizer {pre!r}) cannot be converted yet")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {_spell(tok): i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(meta, tokens)
    alphabet = set(_bytes_to_unicode().values())
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel: skipped, as
    # transformers does (adding it would grow the vocabulary past the model's).
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types)
                            if k == _CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return tok


_SPACE = "\u2581"  # sentencepiece's visible space


def _gemma_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    # Tokens made only of spaces are stored with real spaces; the model looks them up as "▁"s.
    tokens = [_SPACE * len(t) if " " in t and not t.strip() else t
              for t in meta["tokenizer.ggml.tokens"]]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_vocabulary_merges(tokens, vocab),
                               dropout=None, unk_token=tokens[unk] if unk is not None else None,
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", _SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.post_processor = _post_processor(meta, tokens)
    original = meta["tokenizer.ggml.tokens"]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types) if k == _CONTROL])
    # A respelled (all-space) user-defined token is an ordinary vocabulary entry now.
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, o, k in zip(tokens, original, types) if k == _USER_DEFINED and t == o])
    return tok


def _vocabulary_merges(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: every split of a token into two tokens is a merge.
    Gemma's file order is its merge order (its scores are not): a token listed earlier merges
    first, and among one token's splits the longer left piece goes first."""
    merges = []
    for token in tokens:
        splits = [(token[:i], token[i:]) for i in range(len(token) - 1, 0, -1)]
        merges += [(a, b) for a, b in splits if a in vocab and b in vocab]
    return merges


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.TemplateProcessing:
    """Adds BOS / EOS around a text when the GGUF says so (SmolLM2: neither)."""

    def end(flag: str, key: str) -> tuple[str, int] | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if not meta.get(f"tokenizer.ggml.{flag}") or token_id is None:
            return None
        return tokens[token_id], token_id

    bos, eos = end("add_bos_token", "bos_token_id"), end("add_eos_token", "eos_token_id")

    def template(seq: str, type_id: int) -> list[str]:
        return ([f"{bos[0]}:{type_id}"] if bos else []) + [f"${seq}:{type_id}"] + (
            [f"{eos[0]}:{type_id}"] if eos else [])

    return processors.TemplateProcessing(single=template("A", 0),
                                         pair=template("A", 0) + template("B", 1),
                                         special_tokens=[e for e in (bos, eos) if e])


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]
    cfg: dict[str, Any] = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            cfg[name] = tokens[meta[f"tokenizer.ggml.{key}"]]
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in meta:
            cfg[flag] = bool(meta[f"tokenizer.ggml.{flag}"])
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    arch = meta["general.architecture"]
    cfg["model_max_length"] = meta.get(f"{arch}.context_length", 1 << 30)
    cfg["clean_up_tokenization_spaces"] = False
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    return cfg


def write_tokenizer(meta: dict[str, Any], out: Path) -> None:
    build_tokenizer(meta).save(str(out / "tokenizer.json"))
    cfg = tokenizer_config(meta)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    if "chat_template" in cfg:
        (out / "chat_template.jinja").write_text(cfg["chat_template"])
