"""POST /v1/chat/completions."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from deepinfer.engine.protocol import FinishReason, GenerateRequest, GrammarSpec
from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.generation import Generation, collect, engine_error, seeded
from deepinfer.frontend.server.http_io import (
    SSE_DONE,
    SSEResponse,
    read_json,
    run_until_disconnect,
    sse_event,
)
from deepinfer.frontend.server.kv_transfer import apply_kv_transfer, response_params
from deepinfer.frontend.server.logprobs import chat_logprobs
from deepinfer.frontend.server.openai_responses import (
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
from deepinfer.frontend.server.openai_schema import ChatCompletionRequest, decode_chat
from deepinfer.frontend.server.prompts import chat_messages
from deepinfer.frontend.server.reasoning import REASONING_PARSERS, ReasoningDelta, ReasoningParser
from deepinfer.frontend.server.sampling import chat_params
from deepinfer.frontend.server.state import ServerState
from deepinfer.frontend.server.structured import grammar_spec
from deepinfer.frontend.server.thinking import template_kwargs, thinking_on
from deepinfer.frontend.server.tool_calls import ParsedDelta, ToolCallParser, ToolSetup, parse_tools

_encode = msgspec.json.Encoder().encode


async def create_chat_completion(state: ServerState, request: Request) -> Response | SSEResponse:
    req = await read_json(request, decode_chat)
    state.check_model(req.model)
    tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    tool_schema = tools.grammar_schema() if tools is not None else None
    tool_grammar = None if tool_schema is None else GrammarSpec(
        "json_schema", json.dumps(tool_schema, ensure_ascii=False))
    params = chat_params(req, state.context_len,
                         grammar_spec(req, state.grammar_max_bytes, tool_grammar))
    messages = chat_messages(req.messages)
    kwargs = template_kwargs(req)
    rendered_tools = tools.render_tools() if tools is not None else None
    n = req.n or 1
    params = apply_kv_transfer(request, req.kv_transfer_params, params, state, n,
                               bool(req.stream))
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    add_prompt = req.add_generation_prompt is not False
    engine_requests = [
        GenerateRequest(f"{rid}-{i}", seeded(params, i), messages=messages,
                        add_generation_prompt=add_prompt, tools=rendered_tools,
                        template_kwargs=kwargs)
        for i in range(n)
    ]
    gen = Generation(state, "chat", engine_requests, param="messages")
    try:
        await gen.first_outputs()
    except BaseException:
        await gen.close()
        raise
    created = int(time.time())
    reasoning = _Reasoning(state.reasoning_parser, thinking_on(kwargs), n)
    if req.stream:
        return SSEResponse(_events(gen, req, rid, created, state.model_name, tools, reasoning))
    results = await run_until_disconnect(request, collect(gen))
    if results is None:
        return Response(status_code=499)
    choices = []
    for i, r in enumerate(results):
        split = reasoning.split(i, "".join(r.text), final=True)
        parser = ToolCallParser(tools, state.tool_call_format)
        parser.feed(split.content)
        parser.finish()
        calls = [ToolCallOut(c.id, FunctionCallOut(c.name, c.arguments)) for c in parser.calls]
        message = ChatMessageOut("assistant", parser.content or (None if calls else ""),
                                 tool_calls=calls or msgspec.UNSET,
                                 **reasoning.message_fields(split))
        choices.append(ChatChoice(
            index=i,
            message=message,
            logprobs=chat_logprobs(r.logprobs) if req.logprobs else None,
            finish_reason=_finish_reason(r.finish_reason, bool(calls)),
        ))
    body = ChatCompletion(rid, created, state.model_name, choices, gen.usage(n),
                          kv_transfer_params=response_params(results[0].kv_transfer, state))
    return Response(_encode(body), media_type="application/json")


class _Reasoning:
    """Each choice's reasoning parser (--reasoning-parser), or none: all text is content."""

    def __init__(self, name: str | None, thinking: bool | None, n: int) -> None:
        self.parsers: list[ReasoningParser] | None = (
            [REASONING_PARSERS[name](thinking) for _ in range(n)] if name else None)

    def split(self, i: int, text: str, final: bool) -> ReasoningDelta:
        if self.parsers is None:
            return ReasoningDelta(content=text)
        out = self.parsers[i].feed(text)
        return out.merge(self.parsers[i].finish()) if final else out

    def message_fields(self, split: ReasoningDelta) -> dict:
        if self.parsers is None:
            return {}
        return {"reasoning_content": split.reasoning or None, "reasoning": split.reasoning or None}


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI says "tool_calls" when a turn that called tools ended by itself."""
    return "tool_calls" if called and reason == "stop" else reason


def _delta(parsed: ParsedDelta, reasoning: str) -> ChatDelta:
    calls = [ToolCallDeltaOut(c.index, c.id, "function" if c.id else None,
                              FunctionCallDelta(c.name, c.arguments))
             for c in parsed.calls]
    return ChatDelta(content=parsed.content or None, reasoning_content=reasoning or None,
                     reasoning=reasoning or None, tool_calls=calls or None)


async def _events(
    gen: Generation, req: ChatCompletionRequest, rid: str, created: int, model: str,
    tools: ToolSetup | None, reasoning: _Reasoning,
) -> AsyncGenerator[bytes, None]:
    def chunk(choices: list[ChatChunkChoice], **kw) -> bytes:
        return sse_event(_encode(ChatCompletionChunk(rid, created, model, choices, **kw)))

    parsers = [ToolCallParser(tools, gen.state.tool_call_format) for _ in range(gen.n)]
    try:
        for i in range(gen.n):
            yield chunk([ChatChunkChoice(i, ChatDelta(role="assistant", content=""))])
        async for i, out in gen:
            if out.finish_reason == FinishReason.ERROR:
                raise engine_error(gen.state, out.error or "request failed", gen.param)
            if not (out.text or out.logprobs or out.finish_reason is not None):
                continue
            final = out.finish_reason is not None
            split = reasoning.split(i, out.text, final)
            parsed = parsers[i].feed(split.content)
            finish = None
            if final:
                parsed = parsed.merge(parsers[i].finish())
                finish = _finish_reason(FinishReason(out.finish_reason).openai(),
                                        bool(parsers[i].calls))
            yield chunk([ChatChunkChoice(
                index=i,
                delta=_delta(parsed, split.reasoning),
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
