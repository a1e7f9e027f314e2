"""POST /v1/chat/completions: OpenAI's shapes around the shared chat path (common/chat_turns.py)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from deepinfer.frontend.server.common.chat_turns import ChatRun, TurnDelta, start_chat
from deepinfer.frontend.server.common.kv_transfer import response_params
from deepinfer.frontend.server.common.openai_schema import decode_chat
from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.http_io import SSE_DONE, SSEResponse, read_json, sse_event
from deepinfer.frontend.server.openai.logprobs import chat_logprobs, prompt_logprobs_out
from deepinfer.frontend.server.openai.objects import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessageOut,
    FunctionCallDelta,
    FunctionCallOut,
    ToolCallDeltaOut,
    ToolCallOut,
)
from deepinfer.frontend.server.state import ServerState

_encode = msgspec.json.Encoder().encode


async def create_chat_completion(state: ServerState, request: Request) -> Response | SSEResponse:
    req = await read_json(request, decode_chat)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    run = await start_chat(state, request, req, rid)
    if req.stream:
        return SSEResponse(_events(run, rid))
    turns = await run.results(request)
    if turns is None:
        return Response(status_code=499)
    choices = []
    for i, t in enumerate(turns):
        calls = [ToolCallOut(c.id, FunctionCallOut(c.name, c.arguments)) for c in t.calls]
        reasoning = ({"reasoning_content": t.reasoning or None, "reasoning": t.reasoning or None}
                     if run.reasoning_on else {})
        message = ChatMessageOut("assistant", t.content or (None if calls else ""),
                                 tool_calls=calls or msgspec.UNSET, **reasoning)
        choices.append(ChatChoice(
            index=i, message=message,
            logprobs=chat_logprobs(t.logprobs) if req.logprobs else None,
            finish_reason=t.finish_reason,
        ))
    body = ChatCompletion(rid, run.created, run.model, choices, run.usage(),
                          kv_transfer_params=response_params(turns[0].kv_transfer, state))
    if req.prompt_logprobs is not None:  # top level, as vLLM: the choices share the prompt
        body.prompt_logprobs = prompt_logprobs_out(turns[0].prompt_logprobs, req.prompt_logprobs)
    return Response(_encode(body), media_type="application/json")


def _delta(d: TurnDelta) -> ChatDelta:
    calls = [ToolCallDeltaOut(c.index, c.id, "function" if c.id else None,
                              FunctionCallDelta(c.name, c.arguments))
             for c in d.calls]
    return ChatDelta(content=d.content or None, reasoning_content=d.reasoning or None,
                     reasoning=d.reasoning or None, tool_calls=calls or None)


async def _events(run: ChatRun, rid: str) -> AsyncGenerator[bytes, None]:
    req = run.req

    def chunk(choices: list[ChatChunkChoice], **kw) -> bytes:
        return sse_event(_encode(ChatCompletionChunk(rid, run.created, run.model,
                                                     choices, **kw)))

    try:
        for i in range(run.n):
            yield chunk([ChatChunkChoice(i, ChatDelta(role="assistant", content=""))])
        async for d in run.deltas():
            yield chunk([ChatChunkChoice(
                index=d.index, delta=_delta(d),
                logprobs=chat_logprobs(d.logprobs) if req.logprobs else None,
                finish_reason=d.finish_reason,
            )])
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage=run.usage())
    except APIError as exc:  # the engine failed mid-stream: say so in-band, as vLLM does
        yield sse_event(_encode(exc.body()))
    finally:
        await run.close()
    yield SSE_DONE
