"""Response bodies of the OpenAI API (non-streaming objects and SSE chunks); their `usage` is
common/usage.py's, which the other APIs translate."""

from __future__ import annotations

import msgspec

from deepinfer.frontend.server.common.usage import Usage


class PromptLogprobOut(msgspec.Struct):
    """One token of a prompt position in vLLM's prompt_logprobs: a list with one object per
    prompt token (null for the first), keyed by token id, holding the prompt's token and the
    top alternatives."""

    logprob: float
    rank: int | None
    decoded_token: str


# Per prompt position: token id (as a JSON key) -> its entry; None at the first position.
PromptLogprobsOut = list[dict[str, PromptLogprobOut] | None]


# ---------------------------------------------------------------- chat


class ChatTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprobEntry] | None
    refusal: list[ChatLogprobEntry] | None = None


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str | None
    refusal: str | None = None
    # Only on turns that called tools (left out, not null, otherwise; as OpenAI does).
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET
    # With --reasoning-parser: the reasoning, under DeepSeek's name and vLLM's newer one.
    reasoning_content: str | None | msgspec.UnsetType = msgspec.UNSET
    reasoning: str | None | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None
    # A prefill server's answer: where the prompt's KV waits (server/common/kv_transfer.py).
    kv_transfer_params: dict | msgspec.UnsetType = msgspec.UNSET
    prompt_logprobs: PromptLogprobsOut | msgspec.UnsetType = msgspec.UNSET  # (vLLM's place)


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(msgspec.Struct, omit_defaults=True):
    """A piece of one tool call: the first names it (id, type, function name), the following
    ones carry further text of its arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None
    usage: Usage | None = None


# ---------------------------------------------------------------- completions


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobsOut | msgspec.UnsetType = msgspec.UNSET  # when asked


class Completion(msgspec.Struct):
    """Both the non-streaming body and each SSE chunk (usage is None in chunks)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None
    kv_transfer_params: dict | msgspec.UnsetType = msgspec.UNSET


# ---------------------------------------------------------------- models


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "deepinfer"
    max_model_len: int | None = None
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
