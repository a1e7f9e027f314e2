"""POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine.protocol import FinishReason, GenerateRequest
from frontend.server.errors import APIError
from frontend.server.generation import Generation, collect, engine_error, seeded
from frontend.server.http_io import (
    SSE_DONE,
    SSEResponse,
    read_json,
    run_until_disconnect,
    sse_event,
)
from frontend.server.logprobs import chat_logprobs
from frontend.server.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessageOut,
)
from frontend.server.openai_schema import ChatCompletionRequest, decode_chat
from frontend.server.prompts import chat_messages
from frontend.server.sampling import chat_params
from frontend.server.state import ServerState

_encode = msgspec.json.Encoder().encode


async def create_chat_completion(state: ServerState, request: Request) -> Response | SSEResponse:
    req = await read_json(request, decode_chat)
    state.check_model(req.model)
    params = chat_params(req, state.context_len)
    messages = chat_messages(req.messages)
    n = req.n or 1
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    add_prompt = req.add_generation_prompt is not False
    engine_requests = [
        GenerateRequest(f"{rid}-{i}", seeded(params, i), messages=messages,
                        add_generation_prompt=add_prompt)
        for i in range(n)
    ]
    gen = Generation(state, "chat", engine_requests, param="messages")
    try:
        await gen.first_outputs()
    except BaseException:
        await gen.close()
        raise
    created = int(time.time())
    if req.stream:
        return SSEResponse(_events(gen, req, rid, created, state.model_name))
    results = await run_until_disconnect(request, collect(gen))
    if results is None:
        return Response(status_code=499)
    choices = [
        ChatChoice(
            index=i,
            message=ChatMessageOut("assistant", "".join(r.text)),
            logprobs=chat_logprobs(r.logprobs) if req.logprobs else None,
            finish_reason=r.finish_reason,
        )
        for i, r in enumerate(results)
    ]
    body = ChatCompletion(rid, created, state.model_name, choices, gen.usage(n))
    return Response(_encode(body), media_type="application/json")


async def _events(
    gen: Generation, req: ChatCompletionRequest, rid: str, created: int, model: str
) -> AsyncGenerator[bytes, None]:
    def chunk(choices: list[ChatChunkChoice], **kw) -> bytes:
        return sse_event(_encode(ChatCompletionChunk(rid, created, model, choices, **kw)))

    try:
        for i in range(gen.n):
            yield chunk([ChatChunkChoice(i, ChatDelta(role="assistant", content=""))])
        async for i, out in gen:
            if out.finish_reason == FinishReason.ERROR:
                raise engine_error(gen.state, out.error or "request failed", gen.param)
            if not (out.text or out.logprobs or out.finish_reason is not None):
                continue
            finish = FinishReason(out.finish_reason).openai() if out.finish_reason else None
            yield chunk([ChatChunkChoice(
                index=i,
                delta=ChatDelta(content=out.text) if out.text else ChatDelta(),
                logprobs=chat_logprobs(out.logprobs) if req.logprobs else None,
                finish_reason=finish,
            )])
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage=gen.usage(gen.n))
    except APIError as exc:  # the engine failed mid-stream: say so in-band, as vLLM does
        yield sse_event(_encode(exc.body()))
    finally:
        await gen.close()
    yield SSE_DONE
