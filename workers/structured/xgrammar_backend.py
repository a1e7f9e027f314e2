"""The xgrammar grammar backend: compiles GrammarSpecs against the model's vocabulary and makes
the per-request matchers whose token bitmasks constrain sampling.

xgrammar imports torch and transformers, so it lives on the worker (the tokenizer, scheduler and
API processes stay light); the worker imports it lazily, with the first structured request.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import xgrammar as xgr

from deepinfer.engine.protocol import GrammarSpec
from deepinfer.workers.structured.masks import AfterMarker

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; users need the rest.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """A grammar the backend refuses: invalid or unsupported schema, regex or EBNF."""


def _clean(exc: Exception) -> str:
    text = str(exc).strip()
    return _LOCATION.sub("", text).split(" The JSON string is:")[0].strip()


class XGrammarBackend:
    def __init__(self, info: xgr.TokenizerInfo, threads: int = 1, tokenizer=None) -> None:
        # The compile service caches by spec itself (it also shares in-flight compiles).
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.vocab_size = info.vocab_size
        self.tokenizer = tokenizer  # a transformers tokenizer: encodes a GrammarSpec's `after`

    @classmethod
    def for_model(cls, model_dir: str, vocab_size: int, stop_token_ids: list[int]
                  ) -> XGrammarBackend:
        """The backend for a model directory's tokenizer.json; `vocab_size` is the model's
        (its logits' width, which may exceed the tokenizer's)."""
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=str(Path(model_dir) / "tokenizer.json"))
        return cls(xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)),
            tokenizer=tokenizer)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Raises GrammarError naming the problem."""
        try:
            # Compact JSON (no free whitespace): small models otherwise tend to pad with
            # endless newlines inside objects.
            if spec.kind == "json_schema":
                return self.compiler.compile_json_schema(spec.spec, any_whitespace=False)
            if spec.kind == "json_object":
                # OpenAI's JSON mode is an object, any object (xgrammar's builtin JSON grammar
                # also takes a top-level array).
                return self.compiler.compile_json_schema(
                    _ANY_OBJECT, any_whitespace=False, strict_mode=False)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.spec)
            if spec.kind == "ebnf":
                return self.compiler.compile_grammar(spec.spec)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError for bad input
            raise GrammarError(f"invalid {_NAMES[spec.kind]}: {_clean(exc)}") from exc
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")

    def matcher(self, compiled: xgr.CompiledGrammar, after: str = "", opened_by: str = ""):
        """A matcher of `compiled`; with `after`, one that starts once the output wrote it (as
        the tokenizer encodes it alone: reasoning markers are single added tokens), or at once
        when `opened_by` is a single token and the output does not start with it."""
        matcher = xgr.GrammarMatcher(compiled)
        if not after:
            return matcher
        marker = self.tokenizer.encode(after, add_special_tokens=False)
        opener = self.tokenizer.encode(opened_by, add_special_tokens=False) if opened_by else []
        return AfterMarker(matcher, list(marker), opener[0] if len(opener) == 1 else None)

    def allocate(self, rows: int) -> torch.Tensor:
        """A bitmask for `rows` logits rows, every token allowed."""
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Disallowed tokens of `rows` get -inf logits (in place)."""
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


_ANY_OBJECT = '{"type": "object"}'
_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object grammar",
          "regex": "regex", "ebnf": "EBNF grammar"}
