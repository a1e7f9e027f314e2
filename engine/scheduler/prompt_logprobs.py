"""Prompt logprobs in the scheduler: which prefill chunks compute them, and where they wait.

The workers compute them in the prefill (workers/sample/prompt_logprobs.py), chunk by chunk;
the scheduler keeps each request's pieces, in position order, until the request's first delta
(the one with its first token, or its finish), which carries them all to the tokenizer.

A request that still lacks some of them takes no cached prefix: the cache holds a prefix's KV,
not the logits its positions gave, so a hit would leave those positions without logprobs.
Recomputing the prompt is what vLLM does too; keeping every position's top-k beside the KV
blocks would cost memory on every cached block for a rare request. Its own blocks still enter
the cache for the requests after it. Preempted before its pieces all came back, it recomputes
its prompt from 0; pieces of positions already received are trimmed (`since`), so each
position arrives once.
"""

from __future__ import annotations

from deepinfer.engine.protocol import PromptChunkLogprobs
from deepinfer.engine.request import Request


def wants(req: Request) -> bool:
    """It asked for prompt logprobs and some have not come back yet."""
    return req.params.prompt_logprobs is not None and req.prompt_logprobs_next < req.num_prompt


def chunk_asks(req: Request, start: int, n: int) -> bool:
    """Whether computing positions [start, start + n) should report prompt logprobs: their
    logits predict prompt tokens start + 1 .. min(start + n, P - 1), some still missing."""
    return wants(req) and min(start + n, req.num_prompt - 1) >= req.prompt_logprobs_next


def receive(req: Request, piece: PromptChunkLogprobs) -> None:
    """Keep a chunk's prompt logprobs (only the positions not yet received)."""
    piece = piece.since(req.prompt_logprobs_next)
    if piece.count and piece.start == req.prompt_logprobs_next:
        req.prompt_logprobs_held.append(piece)
        req.prompt_logprobs_next += piece.count


def take(req: Request) -> list[PromptChunkLogprobs]:
    """The pieces held so far, handed over once (to the request's next delta)."""
    held, req.prompt_logprobs_held = req.prompt_logprobs_held, []
    return held
