"""The chat path's answer as a Responses API object: a `Turn` as output items (reasoning, then
messages and function calls in the order written, as a stream opens them), OpenAI usage as
Responses usage, a finish reason as the response's status, and the request's settings echoed as
OpenAI echoes them."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from deepinfer.engine.protocol import PositionLogprobs
from deepinfer.frontend.server.common.chat_turns import Turn
from deepinfer.frontend.server.common.usage import Usage
from deepinfer.frontend.server.responses.input import echo_tools
from deepinfer.frontend.server.responses.objects import (
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningPart,
    ResponseObject,
    ResponseUsage,
)
from deepinfer.frontend.server.responses.schema import ResponsesRequest


def new_id(prefix: str) -> str:
    """An unguessable id: stored responses are read and deleted by it alone."""
    return f"{prefix}_{uuid.uuid4().hex}"


def item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def text_logprobs(positions: list[PositionLogprobs]) -> list[dict[str, Any]]:
    """Output positions as output_text's logprobs (the entries chat's logprobs.content has)."""
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob,
                "bytes": list(token.encode("utf-8", errors="replace"))}
    return [{**entry(p.chosen.token, p.chosen.logprob),
             "top_logprobs": [entry(t.token, t.logprob) for t in p.top]} for p in positions]


def function_call(call_id: str, name: str, arguments: str, namespaces: dict[str, str],
                  status: str = "completed") -> OutputFunctionCall:
    return OutputFunctionCall(id=new_id("fc"), call_id=call_id, name=name, arguments=arguments,
                              status=status, namespace=namespaces.get(name, msgspec.UNSET))


def output_items(turn: Turn, reasoning_on: bool, logprobs: bool = False,
                 namespaces: dict[str, str] | None = None) -> list[OutputItem]:
    """Reasoning (with a parser), then a message per run of text and the calls, in the order
    written (an empty message when there is neither); the last is "incomplete" when
    max_output_tokens cut it, as when streamed. With `logprobs`, the first message's text
    carries every output position's (the engine does not tell which part wrote which)."""
    out: list[OutputItem] = []
    if reasoning_on and turn.reasoning:
        out.append(OutputReasoning(id=new_id("rs"), content=[ReasoningPart(text=turn.reasoning)]))
    out.extend(OutputMessage(id=new_id("msg"), status="completed", content=[OutputText(text=p)])
               if isinstance(p, str) else
               function_call(p.id, p.name, p.arguments, namespaces or {})
               for p in turn.parts or [""])
    first = next((item for item in out if isinstance(item, OutputMessage)), None)
    if logprobs and first is not None:
        first.content[0].logprobs = text_logprobs(turn.logprobs)
    out[-1] = msgspec.structs.replace(out[-1], status=item_status(turn.finish_reason))
    return out


def response_usage(usage: Usage) -> ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    # Reasoning tokens are not counted apart from the answer's yet: 0.
    return ResponseUsage(usage.prompt_tokens, InputTokensDetails(cached),
                         usage.completion_tokens, OutputTokensDetails(), usage.total_tokens)


def _given(struct: msgspec.Struct) -> dict:
    """A request struct's fields that were given, as JSON values."""
    return {k: v for k, v in msgspec.to_builtins(struct).items() if v is not None}


def base_response(req: ResponsesRequest, rid: str, created: int, model: str,
                  stored: bool) -> ResponseObject:
    """The response in progress: no output yet, the request's settings echoed."""
    fmt = req.text.format if req.text is not None else None
    text = {"format": _given(fmt) if fmt is not None else {"type": "text"}}
    return ResponseObject(
        id=rid, created_at=created, model=model, status="in_progress", output=[], usage=None,
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, tools=echo_tools(req.tools),
        tool_choice=req.tool_choice or "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False, text=text,
        reasoning=_given(req.reasoning) if req.reasoning is not None else None,
        previous_response_id=req.previous_response_id, store=stored,
        metadata=req.metadata or {}, truncation=req.truncation or "disabled", user=req.user)


def finished(base: ResponseObject, output: list[OutputItem], finish_reason: str | None,
             usage: Usage, at: int) -> ResponseObject:
    """`base` done: cut by max_output_tokens (or the context) is "incomplete"."""
    if finish_reason == "length":
        status, details = "incomplete", IncompleteDetails("max_output_tokens")
    elif finish_reason == "abort":
        status, details = "cancelled", None
    else:
        status, details = "completed", None
    return msgspec.structs.replace(
        base, status=status, output=output, usage=response_usage(usage),
        incomplete_details=details, completed_at=at if status == "completed" else None)
