"""Validate OpenAI request fields and turn them into the engine's SamplingParams.

Every rejection is an APIError (400) naming the field, so a client can see what to fix.
"""

from __future__ import annotations

import math

from deepinfer.engine.protocol import GrammarSpec, SamplingParams
from deepinfer.frontend.server.common.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
)
from deepinfer.frontend.server.errors import APIError

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_CACHE_SALT = 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint
INT32_MAX = 2**31 - 1  # token ids travel as int32 (engine.protocol.pack_ids); top_k is kept in it
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a seed is a signed 64-bit integer, as in vLLM


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise APIError(message, param=param)


def _max_tokens(value: int | None, param: str, default: int, context_len: int,
                scoring: bool = False) -> int:
    """`scoring`: the request reads the prompt's logprobs, so 0 (generate nothing) is fine."""
    if value is None:
        return default
    if scoring:
        _check(value >= 0, param, f"{param} must be at least 0, got {value}")
    else:
        _check(value >= 1, param, f"{param} must be at least 1, got {value}")
    _check(
        value <= context_len,
        param,
        f"{param} is {value}, more than this model's context length ({context_len} tokens)",
    )
    return value


def _stop(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    _check(len(stops) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
    _check(all(stops), "stop", "stop strings must not be empty")
    return stops


def _floats(req: _SamplingFields) -> tuple[float, float, float, float]:
    """temperature, top_p, min_p, repetition_penalty; NaN and infinities fail every range."""
    temperature = 1.0 if req.temperature is None else req.temperature
    _check(
        math.isfinite(temperature) and temperature >= 0,
        "temperature",
        f"temperature must be >= 0, got {temperature}",
    )
    top_p = 1.0 if req.top_p is None else req.top_p
    _check(0 < top_p <= 1, "top_p", f"top_p must be in (0, 1], got {top_p}")
    min_p = req.min_p or 0.0
    _check(0 <= min_p <= 1, "min_p", f"min_p must be in [0, 1], got {min_p}")
    penalties = (
        ("frequency_penalty", req.frequency_penalty),
        ("presence_penalty", req.presence_penalty),
    )
    for name, value in penalties:
        _check(value is None or -2 <= value <= 2, name, f"{name} must be in [-2, 2], got {value}")
    rep = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    _check(
        math.isfinite(rep) and rep > 0,
        "repetition_penalty",
        f"repetition_penalty must be > 0 and finite, got {rep}",
    )
    return temperature, top_p, min_p, rep


def _top_k(value: int | None) -> int:
    """The engine's top_k, 0 meaning off.

    A k past the vocabulary is off as well (the sampler clamps k to it), so a huge k is clamped
    into int32 here rather than overflowing a worker's tensors (which kills the worker).
    """
    top_k = value or 0
    _check(top_k >= -1, "top_k", f"top_k must be -1 (off), 0 (off) or positive, got {top_k}")
    return min(max(top_k, 0), INT32_MAX)


def _seed(value: int | None) -> int | None:
    _check(
        value is None or SEED_MIN <= value <= SEED_MAX,
        "seed",
        f"seed must be a signed 64-bit integer, in [{SEED_MIN}, {SEED_MAX}], got {value}",
    )
    return value


def _stop_token_ids(ids: list[int] | None) -> list[int]:
    stop_ids = list(ids or [])
    _check(
        all(0 <= t <= INT32_MAX for t in stop_ids),
        "stop_token_ids",
        f"stop_token_ids must be in [0, {INT32_MAX}]",
    )
    return stop_ids


def _prompt_logprobs(req: _SamplingFields) -> int | None:
    """vLLM's prompt_logprobs: top-k per prompt position, for whole (non-streamed) answers."""
    value = req.prompt_logprobs
    if value is None:
        return None
    _check(0 <= value <= MAX_LOGPROBS, "prompt_logprobs",
           f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {value}")
    _check(not req.stream, "prompt_logprobs",
           "prompt_logprobs is not available when stream is true (as in vLLM)")
    return value


def _cache_salt(value: str | None) -> str | None:
    _check(value is None or 0 < len(value) <= MAX_CACHE_SALT, "cache_salt",
           f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters")
    return value


def _common(req: _SamplingFields, max_tokens: int, logprobs: int | None,
            grammar: GrammarSpec | None, prompt_logprobs: int | None = None) -> SamplingParams:
    temperature, top_p, min_p, rep = _floats(req)
    _check(not req.logit_bias, "logit_bias", "logit_bias is not supported")
    n = 1 if req.n is None else req.n
    _check(1 <= n <= MAX_N, "n", f"n must be between 1 and {MAX_N}, got {n}")
    _check(grammar is None or not req.ignore_eos, "ignore_eos",
           "ignore_eos cannot be combined with structured output: the grammar decides where the "
           "output ends")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=_top_k(req.top_k),
        min_p=min_p,
        repetition_penalty=rep,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        seed=_seed(req.seed),
        stop=_stop(req.stop),
        stop_token_ids=_stop_token_ids(req.stop_token_ids),
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens is not False,
        speculative=req.speculative_decoding is not False,
        grammar=grammar,
        cache_salt=_cache_salt(req.cache_salt),
    )


def _check_chat_features(req: ChatCompletionRequest) -> None:
    forced_fn = req.function_call not in (None, "none", "auto")
    _check(not forced_fn, "function_call",
           "the legacy function_call is not supported; use tools and tool_choice")


def chat_params(req: ChatCompletionRequest, context_len: int,
                grammar: GrammarSpec | None = None) -> SamplingParams:
    """SamplingParams for a chat request. Without a limit, generation runs to the context end."""
    _check_chat_features(req)
    if req.max_completion_tokens is not None:
        max_tokens = _max_tokens(
            req.max_completion_tokens, "max_completion_tokens", context_len, context_len
        )
    else:
        max_tokens = _max_tokens(req.max_tokens, "max_tokens", context_len, context_len)
    logprobs = None
    if req.top_logprobs is not None:
        _check(bool(req.logprobs), "top_logprobs", "top_logprobs requires logprobs to be true")
        _check(
            0 <= req.top_logprobs <= MAX_LOGPROBS,
            "top_logprobs",
            f"top_logprobs must be between 0 and {MAX_LOGPROBS}",
        )
    if req.logprobs:
        logprobs = req.top_logprobs or 0
    return _common(req, max_tokens, logprobs, grammar, _prompt_logprobs(req))


def completion_params(req: CompletionRequest, context_len: int,
                      grammar: GrammarSpec | None = None) -> SamplingParams:
    n = 1 if req.n is None else req.n
    _check(req.best_of in (None, n), "best_of", "best_of other than n is not supported")
    _check(req.suffix is None, "suffix", "suffix is not supported")
    prompt_logprobs = _prompt_logprobs(req)
    max_tokens = _max_tokens(
        req.max_tokens, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, context_len,
        scoring=bool(req.echo) or prompt_logprobs is not None,
    )
    if req.logprobs is not None:
        _check(
            0 <= req.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"logprobs must be between 0 and {MAX_LOGPROBS}",
        )
        if req.echo:  # the echoed prompt shows its logprobs too (as OpenAI and vLLM)
            prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    return _common(req, max_tokens, req.logprobs, grammar, prompt_logprobs)
