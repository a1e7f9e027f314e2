"""Response bodies of the OpenAI Responses API: the response object, its output items, and
the SSE events of a streamed response (field names as OpenAI spells them)."""

from __future__ import annotations

from typing import Any

import msgspec

_ITEM = dict(tag_field="type", kw_only=True)


class OutputText(msgspec.Struct, kw_only=True):
    text: str
    annotations: list[Any] = []
    type: str = "output_text"
    # Each output position's token, logprob, bytes and top_logprobs, when asked (top_logprobs,
    # or include "message.output_text.logprobs"): [] otherwise, as OpenAI answers.
    logprobs: list[Any] = []


class ReasoningPart(msgspec.Struct, kw_only=True):
    text: str
    type: str = "reasoning_text"


class OutputReasoning(msgspec.Struct, tag="reasoning", **_ITEM):
    id: str
    summary: list[Any] = []
    content: list[ReasoningPart] = []


class OutputMessage(msgspec.Struct, tag="message", **_ITEM):
    id: str
    status: str  # in_progress, completed, incomplete
    content: list[OutputText]
    role: str = "assistant"


class OutputFunctionCall(msgspec.Struct, tag="function_call", **_ITEM):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"
    # The namespace tool `name` came from (input.tool_namespaces); left out otherwise.
    namespace: str | msgspec.UnsetType = msgspec.UNSET


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(msgspec.Struct):
    code: str  # OpenAI's: server_error, invalid_prompt, ...
    message: str


class IncompleteDetails(msgspec.Struct):
    reason: str | None  # "max_output_tokens"


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str  # completed, incomplete, in_progress, failed, cancelled
    output: list[OutputItem]
    usage: ResponseUsage | None
    # What the request asked, echoed as OpenAI does.
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    reasoning: dict[str, Any] | None
    previous_response_id: str | None
    store: bool
    metadata: dict[str, str]
    truncation: str
    user: str | None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    completed_at: int | None = None
    background: bool = False
    object: str = "response"


class ResponseDeleted(msgspec.Struct):
    id: str
    deleted: bool = True
    object: str = "response.deleted"


# ---------------------------------------------------------------- streamed events


class ResponseEvent(msgspec.Struct):
    """response.created / in_progress / completed / incomplete / failed."""

    type: str
    sequence_number: int
    response: ResponseObject


class ItemEvent(msgspec.Struct):
    """response.output_item.added / done."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class PartEvent(msgspec.Struct):
    """response.content_part.added / done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningPart


class TextDeltaEvent(msgspec.Struct, omit_defaults=True):
    """response.output_text.delta (with logprobs) / response.reasoning_text.delta."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] | None = None


class TextDoneEvent(msgspec.Struct, omit_defaults=True):
    """response.output_text.done (with logprobs) / response.reasoning_text.done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] | None = None


class ArgumentsDeltaEvent(msgspec.Struct):
    type: str  # response.function_call_arguments.delta
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(msgspec.Struct):
    type: str  # response.function_call_arguments.done
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str
