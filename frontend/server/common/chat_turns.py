"""The one request path under every chat-shaped endpoint (OpenAI chat, Anthropic messages,
OpenAI responses): a validated `ChatCompletionRequest` in, the assistant's turns out.

`start_chat` resolves tools, grammar, sampling, template kwargs and KV transfer, admits the
engine requests and waits for their first outputs (a bad prompt is a 400 before any byte is
sent). The `ChatRun` it returns gives each choice's whole `Turn` (`results`), or `TurnDelta`s
as they arrive (`deltas`): reasoning, content and tool calls already split apart by the
reasoning and tool-call parsers. A delta holds content or calls, not both, so the order the
model wrote them in survives; a whole turn keeps that order too (`parts`), so an API whose
answer is a list of blocks or items lists them alike whole and streamed. Endpoints only
translate shapes.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
from starlette.requests import Request

from deepinfer.engine.protocol import (
    ChatMessage,
    FinishReason,
    GenerateRequest,
    GrammarSpec,
    KVTransferParams,
    PositionLogprobs,
    PromptLogprob,
)
from deepinfer.frontend.server.common.generation import Generation, engine_error, seeded
from deepinfer.frontend.server.common.kv_transfer import apply_kv_transfer
from deepinfer.frontend.server.common.openai_schema import ChatCompletionRequest
from deepinfer.frontend.server.common.prompts import chat_messages
from deepinfer.frontend.server.common.sampling import chat_params
from deepinfer.frontend.server.common.structured import grammar_spec
from deepinfer.frontend.server.common.thinking import template_kwargs, thinking_on
from deepinfer.frontend.server.common.usage import Usage
from deepinfer.frontend.server.errors import APIError, decode_error
from deepinfer.frontend.server.http_io import run_until_disconnect
from deepinfer.frontend.server.parsers.reasoning.base import END as REASONING_END
from deepinfer.frontend.server.parsers.reasoning.base import START as REASONING_START
from deepinfer.frontend.server.parsers.reasoning.base import ReasoningDelta, ReasoningParser
from deepinfer.frontend.server.parsers.reasoning.registry import REASONING_PARSERS
from deepinfer.frontend.server.parsers.tool_calls.call_log import ToolCall, ToolCallDelta
from deepinfer.frontend.server.parsers.tool_calls.parser import ParsedDelta, ToolCallParser
from deepinfer.frontend.server.parsers.tool_calls.tools import ToolSetup, parse_tools
from deepinfer.frontend.server.state import ServerState


@dataclass
class Turn:
    """One choice, whole."""

    reasoning: str  # "" when no reasoning parser is on or the model did not think
    content: str
    calls: list[ToolCall]
    logprobs: list[PositionLogprobs]
    finish_reason: str | None  # OpenAI's: "stop", "length", "tool_calls", "abort"
    stop_reason: str | None  # the stop string that ended it
    kv_transfer: KVTransferParams | None = None
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)  # when asked
    # content and calls in the order written (runs of text merged): what block-shaped answers
    # (Anthropic's content, Responses' output items) list after the reasoning; not given, the
    # content then the calls
    parts: list[str | ToolCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.parts:
            self.parts = [*([self.content] if self.content else []), *self.calls]


@dataclass
class TurnDelta:
    """What one output of one choice adds."""

    index: int
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    kv_transfer: KVTransferParams | None = None
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)  # with the first token


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


def _runs(parsed: ParsedDelta) -> list[ParsedDelta]:
    """`parsed` cut where it turns from content to calls or back (at least one, maybe empty)."""
    runs: list[ParsedDelta] = []
    for part in parsed.parts:
        if runs and isinstance(part, str) == isinstance(runs[-1].parts[-1], str):
            runs[-1].parts.append(part)
        else:
            runs.append(ParsedDelta([part]))
    return runs or [ParsedDelta()]


def _finish_reason(reason: FinishReason | None, called: bool) -> str | None:
    """OpenAI says "tool_calls" when a turn that called tools ended by itself."""
    if reason is None:
        return None
    text = FinishReason(reason).openai()
    return "tool_calls" if called and text == "stop" else text


def _ordered(parts: list[str | ToolCallDelta], calls: list[ToolCall]) -> list[str | ToolCall]:
    """A parser's parts as a turn's: runs of text merged, each call whole."""
    out: list[str | ToolCall] = []
    for part in parts:
        if not isinstance(part, str):
            out.append(calls[part.index])
        elif out and isinstance(out[-1], str):
            out[-1] += part
        else:
            out.append(part)
    return out


class ChatRun:
    """A chat request admitted to the engine; `close()` (or reading to the end) ends it."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest, gen: Generation,
                 tools: ToolSetup | None, thinking: bool | None) -> None:
        self.state = state
        self.req = req
        self.model = state.response_model(req.model)  # what the response names
        self.gen = gen
        self.n = gen.n
        self.tools = tools
        self.reasoning_on = state.reasoning_parser is not None
        self.created = int(time.time())
        self._reasoning = _Reasoning(state.reasoning_parser, thinking, self.n)
        self._tools = [ToolCallParser(tools, state.tool_call_format) for _ in range(self.n)]

    def usage(self) -> Usage:
        return self.gen.usage(self.n)

    async def close(self) -> None:
        await self.gen.close()

    async def deltas(self) -> AsyncIterator[TurnDelta]:
        """Each output, parsed; an engine failure is raised as an APIError. Closes the run."""
        try:
            async for i, out in self.gen:
                if out.finish_reason == FinishReason.ERROR:
                    raise engine_error(self.state, out.error or "request failed", self.gen.param)
                final = out.finish_reason is not None
                if not (out.text or out.logprobs or out.prompt_logprobs or final):
                    continue
                split = self._reasoning.split(i, out.text, final)
                parser = self._tools[i]
                parsed = parser.feed(split.content)
                if final:
                    parsed = parsed.merge(parser.finish())
                *runs, last = _runs(parsed)
                for j, run in enumerate(runs):  # the reasoning goes first, the rest with the last
                    yield TurnDelta(i, "" if j else split.reasoning, run.content, run.calls)
                yield TurnDelta(
                    i, "" if runs else split.reasoning, last.content, last.calls,
                    list(out.logprobs), _finish_reason(out.finish_reason, bool(parser.calls)),
                    out.stop_reason, out.kv_transfer, out.prompt_logprobs)
        finally:
            await self.gen.close()

    async def _collect(self) -> list[Turn]:
        turns = [Turn("", "", [], [], None, None) for _ in range(self.n)]
        reasoning: list[list[str]] = [[] for _ in range(self.n)]
        async for d in self.deltas():
            t = turns[d.index]
            reasoning[d.index].append(d.reasoning)
            t.logprobs.extend(d.logprobs)
            t.prompt_logprobs = d.prompt_logprobs or t.prompt_logprobs
            if d.finish_reason is not None:
                t.finish_reason, t.stop_reason = d.finish_reason, d.stop_reason
                t.kv_transfer = d.kv_transfer
        for i, t in enumerate(turns):
            t.reasoning = "".join(reasoning[i])
            t.content = self._tools[i].content
            t.calls = self._tools[i].calls
            t.parts = _ordered(self._tools[i].parts, t.calls)
        return turns

    async def results(self, request: Request) -> list[Turn] | None:
        """Every choice whole; None when the client went away first (the run is aborted)."""
        return await run_until_disconnect(request, self._collect())


def _continues(req: ChatCompletionRequest, messages: list[ChatMessage]) -> bool:
    """Whether the final assistant message is an answer begun, for the model to go on (vLLM's
    continue_final_message; Anthropic's prefill)."""
    if not req.continue_final_message:
        return False
    if req.add_generation_prompt:
        raise APIError("continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")
    if not messages or messages[-1].role != "assistant":
        raise APIError("continue_final_message needs a final assistant message to continue",
                       param="continue_final_message")
    return True


async def start_chat(state: ServerState, request: Request, req: ChatCompletionRequest,
                     rid: str, count_only: bool = False) -> ChatRun:
    """Validate `req`, admit its engine requests and wait for their first outputs.
    `count_only`: only tokenize (the run's usage has the prompt's length; it generates
    nothing)."""
    lora = state.check_model(req.model)
    tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    tool_schema = tools.grammar_schema() if tools is not None else None
    tool_grammar = None if tool_schema is None else GrammarSpec(
        "json_schema", json.dumps(tool_schema, ensure_ascii=False))
    kwargs = template_kwargs(req)
    grammar = grammar_spec(req, state.grammar_max_bytes, tool_grammar)
    reasoning = REASONING_PARSERS[state.reasoning_parser] if state.reasoning_parser else None
    if grammar is not None and reasoning is not None and reasoning.thinks(thinking_on(kwargs)):
        # The answer follows the grammar, the reasoning before it does not (as in vLLM); a
        # model that may answer without thinking is held to the grammar from its first token
        # unless it opens its reasoning.
        grammar = msgspec.structs.replace(
            grammar, after=REASONING_END,
            opened_by=REASONING_START if reasoning.model_opens else "")
    params = msgspec.structs.replace(chat_params(req, state.context_len, grammar), lora=lora)
    if tools is not None and tools.mode == "auto" and state.tool_call_format.special_markers:
        # The call markers are special tokens (Mistral's [TOOL_CALLS]): the parser must see them.
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    messages = chat_messages(req.messages)
    rendered_tools = tools.render_tools() if tools is not None else None
    n = req.n or 1
    params = apply_kv_transfer(request, req.kv_transfer_params, params, state, n,
                               bool(req.stream))
    continuing = _continues(req, messages)
    add_prompt = req.add_generation_prompt is not False and not continuing
    engine_requests = [
        GenerateRequest(f"{rid}-{i}", seeded(params, i), messages=messages,
                        add_generation_prompt=add_prompt, continue_final_message=continuing,
                        tools=rendered_tools, template_kwargs=kwargs, count_only=count_only)
        for i in range(n)
    ]
    gen = Generation(state, "chat", engine_requests, param="messages")
    try:
        await gen.first_outputs()
    except BaseException:
        await gen.close()
        raise
    return ChatRun(state, req, gen, tools, thinking_on(kwargs))


def decode_chat_dict(body: dict) -> ChatCompletionRequest:
    """A chat request built by another endpoint's translation, checked like a client's (a 400
    naming the field)."""
    try:
        return msgspec.convert(body, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise decode_error(exc) from None
