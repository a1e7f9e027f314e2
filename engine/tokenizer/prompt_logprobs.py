"""A request's prompt logprobs with token texts, from the workers' raw pieces.

The scheduler hands over every piece at once, on the request's first delta; position 0 has no
logprob (nothing precedes it), and so has any position no piece covers (none, unless a worker
failed to report one: better a null there than a wrong number).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from deepinfer.engine.protocol import PromptChunkLogprobs, PromptLogprob, TokenLogprob


def prompt_logprob_list(prompt_ids: Sequence[int], pieces: list[PromptChunkLogprobs],
                        token_text: Callable[[int], str]) -> list[PromptLogprob]:
    """One entry per prompt token, its text included, and the pieces' numbers where given."""
    texts: dict[int, str] = {}  # a prompt repeats tokens; each is decoded once

    def text(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = token_text(token_id)
        return texts[token_id]

    out = [PromptLogprob(int(t), text(int(t))) for t in prompt_ids]
    for piece in pieces:
        n = piece.count
        if not n:
            continue
        logprobs = np.frombuffer(piece.logprobs, dtype=np.float32).tolist()
        ranks = np.frombuffer(piece.ranks, dtype=np.int32).tolist()
        k = len(piece.top_ids) // 4 // n
        top_ids = np.frombuffer(piece.top_ids, dtype=np.int32).reshape(n, k).tolist()
        top_vals = np.frombuffer(piece.top_logprobs, dtype=np.float32).reshape(n, k).tolist()
        for j in range(n):
            pos = piece.start + j
            if not 0 < pos < len(out):
                continue
            entry = out[pos]
            entry.logprob, entry.rank = logprobs[j], ranks[j]
            entry.top = [TokenLogprob(i, text(i), v) for i, v in zip(top_ids[j], top_vals[j])]
    return out
