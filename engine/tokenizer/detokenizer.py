"""Incremental, UTF-8 safe detokenization and stop-string matching for one request."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from deepinfer.engine.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns new token ids into new text; holds back text that may start a stop string.

    A stop string can span tokens, so up to (longest stop - 1) characters stay unsent until
    the next token shows whether they begin a match. The stop string itself is never emitted.

    The stream is primed with the prompt's last tokens (their text is not emitted): decoders
    such as SentencePiece's Metaspace drop the leading space of a sequence's first token, which
    would turn "... is" + " Paris" into "... isParis" and hide a stop string starting with a
    space.
    """

    PRIME_TOKENS = 6  # enough context for a word boundary and a split UTF-8 character

    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool,
                 prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        prime = [int(t) for t in prompt_ids[-self.PRIME_TOKENS:]]
        self.stream = DecodeStream(ids=prime or None, skip_special_tokens=skip_special_tokens)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0  # characters of self.text already emitted
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the output

    def add(self, token_ids) -> int:
        """Feed new tokens; sets `stopped` when a stop string appears (text cut before it).
        Returns how many of them were used: tokens after the one completing a stop string (a
        speculative step can return several) are not part of the output."""
        for used, tid in enumerate(token_ids):
            if self.stopped:
                return used
            try:
                piece = self.stream.step(self.tokenizer.hf, int(tid))
            except Exception:  # an id past the tokenizer's vocabulary (padded embeddings)
                continue
            if not piece:
                continue
            search_from = max(0, len(self.text) - self.hold)
            self.text += piece
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) != -1]
            if hits:
                at, self.stop_string = min(hits, key=lambda hit: hit[0])
                self.text = self.text[:at]
                self.stopped = True
        return len(token_ids)

    def take(self, final: bool) -> str:
        """The text not yet emitted that is safe to emit now (everything when final)."""
        if final or self.stopped:
            end = len(self.text)
        else:
            end = max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta
