"""Request bodies of the OpenAI API, as msgspec Structs: the shape every endpoint's request
becomes (the Anthropic and Responses endpoints translate theirs into a chat request).

Every field OpenAI documents is accepted (clients send many of them, often as null); fields we
cannot honour are rejected later, in `frontend.server.common.sampling`, with a message naming them.
Anything else is an unknown field and fails decoding with a 400 that names it. Optional fields
default to None so that an explicit JSON null means "not given", as in the OpenAI API.
"""

from __future__ import annotations

from typing import Any

import msgspec

from deepinfer.frontend.server.common.lenient import decode_lenient

_REQ = dict(forbid_unknown_fields=True, kw_only=True)


class StreamOptions(msgspec.Struct, **_REQ):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM extension: usage on every chunk


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content; only text parts can be served by a text model."""

    type: str
    text: str | None = None


class Message(msgspec.Struct, **_REQ):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any | None = None
    refusal: str | None = None
    audio: Any | None = None
    # An assistant turn's reasoning sent back (DeepSeek asks for it after tool calls).
    reasoning_content: str | None = None
    reasoning: str | None = None


class _SamplingFields(msgspec.Struct, **_REQ):
    """What chat and completions requests share (OpenAI fields, then DeepInfer extensions)."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # extensions (vLLM names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    # Top-k logprobs of every prompt token (vLLM's field; not with stream).
    prompt_logprobs: int | None = None
    # DeepInfer extension: false opts this request out of speculative decoding.
    speculative_decoding: bool | None = None
    # vLLM's: only requests with the same salt share cached prefixes (tenant isolation).
    cache_salt: str | None = None
    # Structured output: OpenAI's response_format, then vLLM's guided decoding extensions.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[Any] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # Prefill/decode disaggregation (frontend/server/common/kv_transfer.py).
    kv_transfer_params: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingFields, **_REQ):
    messages: list[Message]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    prediction: Any | None = None
    audio: Any | None = None
    web_search_options: Any | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None
    # extensions
    add_generation_prompt: bool | None = None
    # vLLM's: the final assistant message is an answer begun; the model goes on from its text.
    continue_final_message: bool | None = None
    # Handed to the chat template (vLLM): e.g. {"thinking": true} or {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    # DeepSeek's switch: {"type": "enabled"} or {"type": "disabled"}.
    thinking: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, **_REQ):
    # str, list[str], list[int] or list[list[int]]; mixed lists are rejected in
    # frontend.server.common.prompts
    prompt: str | list[str | int | list[int]]
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None


def decode_chat(body: bytes) -> ChatCompletionRequest:
    return decode_lenient(body, ChatCompletionRequest, "/v1/chat/completions")


def decode_completion(body: bytes) -> CompletionRequest:
    return decode_lenient(body, CompletionRequest, "/v1/completions")
