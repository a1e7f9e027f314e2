"""Request bodies of the OpenAI Responses API (POST /v1/responses), as msgspec Structs.

Like common/openai_schema.py: every field OpenAI documents is declared (clients send many, often as
null) and anything else is an unknown field, a 400 naming it. `input` items are kept as plain
objects here and typed one by one by input.py, since a message item may leave out its
`type` and a tagged union cannot dispatch on a missing tag; the item structs below are what
each becomes. Items, unlike the request, ignore fields they do not declare: output items are
sent back as input (the usual way to continue a conversation by hand), and the SDK adds its own
fields to them (`parsed_arguments` after `responses.parse`), more with each release.
"""

from __future__ import annotations

from typing import Any

import msgspec

from deepinfer.frontend.server.common.lenient import decode_lenient

_REQ = dict(forbid_unknown_fields=True, kw_only=True)
_ITEM = dict(kw_only=True)  # see above: unknown fields are ignored


class InputContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content: input_text, output_text or refusal can be served;
    the other kinds (images, files, audio) are refused by type, so their fields pass here."""

    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(msgspec.Struct, **_ITEM):
    role: str  # user, system, developer, assistant
    content: str | list[InputContentPart]
    type: str | None = None  # "message" or left out
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(msgspec.Struct, **_ITEM):
    """A call the model made earlier, sent back with the conversation."""

    type: str
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    caller: dict[str, Any] | None = None
    namespace: str | None = None


class FunctionCallOutputItem(msgspec.Struct, **_ITEM):
    """The caller's result of a call: `output` is text, or content parts."""

    type: str
    call_id: str
    output: str | list[InputContentPart]
    id: str | None = None
    status: str | None = None
    caller: dict[str, Any] | None = None
    name: str | None = None
    namespace: str | None = None


class ReasoningText(msgspec.Struct, **_ITEM):
    text: str
    type: str = "reasoning_text"  # "summary_text" in a summary


class ReasoningItem(msgspec.Struct, **_ITEM):
    type: str
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    id: str | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(msgspec.Struct, **_REQ):
    """A function tool as the Responses API spells it: flat, not under "function"."""

    type: str
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    output_schema: dict[str, Any] | None = None


class TextFormat(msgspec.Struct, **_REQ):
    type: str  # text, json_object, json_schema
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, **_REQ):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct, **_REQ):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None
    context: str | None = None
    mode: str | None = None


class ResponsesStreamOptions(msgspec.Struct, **_REQ):
    include_obfuscation: bool | None = None


class ResponsesRequest(msgspec.Struct, **_REQ):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    cache_salt: str | None = None  # vLLM's extension (frontend/server/common/sampling.py)
    # Declared so that a client sending them learns, by name, that they are not served
    # (context_management, moderation, prompt_cache_options change nothing here: not declared,
    # so common/lenient.py ignores them and logs each once).
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None


def decode_responses(body: bytes) -> ResponsesRequest:
    return decode_lenient(body, ResponsesRequest, "/v1/responses")
