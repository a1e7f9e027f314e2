"""Token usage as OpenAI reports it, the one every endpoint's usage is built from: the shared
request path counts it (generation.py), OpenAI's endpoints send it as is, and the Anthropic and
Responses endpoints translate it into their own shapes."""

from __future__ import annotations

import msgspec


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # DeepSeek's API reports the prefix cache this way too: hit + miss = prompt_tokens.
    prompt_cache_hit_tokens: int = 0
    prompt_cache_miss_tokens: int = 0
