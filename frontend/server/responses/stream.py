"""A streamed Responses API answer: the chat path's `TurnDelta`s as OpenAI's SSE events.

One output item is open at a time, in the order the model writes them: reasoning, message text
or a function call; a delta of another kind closes it (its `.done` events) and opens the next
(`output_item.added`, and a content part for text). Every event carries the next
`sequence_number`. The end is `response.completed`, or `response.incomplete` when
max_output_tokens cut it; an engine failure on the way is `response.failed`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable

import msgspec

from deepinfer.frontend.server.common.chat_turns import ChatRun, TurnDelta
from deepinfer.frontend.server.common.usage import Usage
from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.parsers.tool_calls.call_log import ToolCallDelta
from deepinfer.frontend.server.responses.input import responses_error
from deepinfer.frontend.server.responses.objects import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ItemEvent,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    PartEvent,
    ReasoningPart,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    TextDeltaEvent,
    TextDoneEvent,
)
from deepinfer.frontend.server.responses.output import (
    finished,
    function_call,
    item_status,
    new_id,
    text_logprobs,
)

_encode = msgspec.json.Encoder().encode
_END_EVENTS = {"completed": "response.completed", "failed": "response.failed"}


class _Events:
    """The events so far; `output` holds the closed items, `item` the open one."""

    def __init__(self, base: ResponseObject, logprobs: bool = False,
                 namespaces: dict[str, str] | None = None) -> None:
        self.base = base
        self.namespaces = namespaces or {}  # input.tool_namespaces
        self.seq = 0
        self.output: list[OutputItem] = []
        self.item: OutputItem | None = None
        self.text: list[str] = []  # the open item's text or arguments so far
        # With logprobs asked: the positions not sent yet, sent with the next text of a message
        # (a delta's own positions with its text; with reasoning or calls, those positions go
        # with the message text after them), and those sent with the open message
        self.logprobs: list[dict] | None = [] if logprobs else None
        self.sent: list[dict] = []

    def _frame(self, make: Callable[[int], msgspec.Struct]) -> bytes:
        event = make(self.seq)
        self.seq += 1
        kind = event.type  # type: ignore[attr-defined]
        return b"event: " + kind.encode() + b"\ndata: " + _encode(event) + b"\n\n"

    def response(self, kind: str, response: ResponseObject) -> bytes:
        return self._frame(lambda n: ResponseEvent(kind, n, response))

    def _open(self, item: OutputItem, part: OutputText | ReasoningPart | None) -> list[bytes]:
        at = len(self.output)
        self.item, self.text = item, []
        out = [self._frame(lambda n: ItemEvent("response.output_item.added", n, at, item))]
        if part is not None:
            out.append(self._frame(lambda n: PartEvent(
                "response.content_part.added", n, item.id, at, 0, part)))
        return out

    def _text_done(self, kind: str, item_id: str, at: int, part: OutputText | ReasoningPart,
                   logprobs: list | None) -> list[bytes]:
        return [self._frame(lambda n: TextDoneEvent(
                    f"response.{kind}.done", n, item_id, at, 0, part.text, logprobs)),
                self._frame(lambda n: PartEvent(
                    "response.content_part.done", n, item_id, at, 0, part))]

    def close(self, status: str = "completed") -> list[bytes]:
        """Close the open item (a message or call with `status`), if any."""
        item = self.item
        if item is None:
            return []
        text, at = "".join(self.text), len(self.output)
        if isinstance(item, OutputMessage):
            self._take()  # positions that wrote no text (the EOS) close the message
        sent, self.sent = self.sent, []
        done: OutputItem
        if isinstance(item, OutputFunctionCall):
            done = msgspec.structs.replace(item, arguments=text, status=status)
            out = [self._frame(lambda n: ArgumentsDoneEvent(
                "response.function_call_arguments.done", n, item.id, at, item.name, text))]
        elif isinstance(item, OutputReasoning):
            part = ReasoningPart(text=text)
            done = msgspec.structs.replace(item, content=[part])
            out = self._text_done("reasoning_text", item.id, at, part, None)
        else:
            message = OutputText(text=text, logprobs=sent)
            done = msgspec.structs.replace(item, content=[message], status=status)
            out = self._text_done("output_text", item.id, at, message, sent)
        out.append(self._frame(lambda n: ItemEvent("response.output_item.done", n, at, done)))
        self.output.append(done)
        self.item = None
        return out

    def _text(self, kind: type[OutputReasoning] | type[OutputMessage], text: str) -> list[bytes]:
        """A piece of reasoning or of the message, opening its item first if need be."""
        reasoning = kind is OutputReasoning
        out: list[bytes] = []
        if not isinstance(self.item, kind):
            out += self.close()
            out += self._open(OutputReasoning(id=new_id("rs")), ReasoningPart(text="")) \
                if reasoning else self._open_message()
        item, at = self.item, len(self.output)
        assert item is not None
        self.text.append(text)
        name, logprobs = ("reasoning_text", None) if reasoning else ("output_text", self._take())
        out.append(self._frame(lambda n: TextDeltaEvent(
            f"response.{name}.delta", n, item.id, at, 0, text, logprobs)))
        return out

    def _take(self) -> list[dict]:
        """The positions not sent yet (none unless asked), now sent with the open message."""
        if self.logprobs is None:
            return []
        taken, self.logprobs = self.logprobs, []
        self.sent += taken
        return taken

    def _open_message(self) -> list[bytes]:
        return self._open(OutputMessage(id=new_id("msg"), status="in_progress", content=[]),
                          OutputText(text=""))

    def _call(self, call: ToolCallDelta) -> list[bytes]:
        out: list[bytes] = []
        if call.id is not None:  # a new call
            out += self.close()
            out += self._open(function_call(call.id, call.name or "", "", self.namespaces,
                                            "in_progress"), None)
        item, at = self.item, len(self.output)
        if call.arguments and isinstance(item, OutputFunctionCall):
            self.text.append(call.arguments)
            out.append(self._frame(lambda n: ArgumentsDeltaEvent(
                "response.function_call_arguments.delta", n, item.id, at, call.arguments)))
        return out

    def delta(self, d: TurnDelta) -> list[bytes]:
        if self.logprobs is not None:
            self.logprobs += text_logprobs(d.logprobs)
        out = self._text(OutputReasoning, d.reasoning) if d.reasoning else []
        if d.content:
            out += self._text(OutputMessage, d.content)
        for call in d.calls:
            out += self._call(call)
        return out

    def finish(self, finish_reason: str | None, usage: Usage) -> tuple[list[bytes],
                                                                      ResponseObject]:
        out = self.close(item_status(finish_reason))
        if not any(isinstance(i, OutputMessage | OutputFunctionCall) for i in self.output):
            # Nothing said and nothing called: an empty message, as the whole response has.
            out += self._open_message()
            out += self.close(item_status(finish_reason))
        final = finished(self.base, self.output, finish_reason, usage, int(time.time()))
        out.append(self.response(_END_EVENTS.get(final.status, "response.incomplete"), final))
        return out, final

    def failed(self, exc: APIError) -> bytes:
        code = "server_error" if exc.status >= 500 else "invalid_prompt"
        message = responses_error(exc).message  # as this API names the fields
        response = msgspec.structs.replace(self.base, status="failed", output=self.output,
                                           error=ResponseError(code, message))
        return self.response("response.failed", response)


async def response_events(run: ChatRun, base: ResponseObject,
                          done: Callable[[ResponseObject], None], logprobs: bool = False,
                          namespaces: dict[str, str] | None = None
                          ) -> AsyncGenerator[bytes, None]:
    """The SSE events of `run`; `done` gets the finished response (to store it)."""
    events = _Events(base, logprobs, namespaces)
    finish_reason = None
    try:
        yield events.response("response.created", base)
        yield events.response("response.in_progress", base)
        async for d in run.deltas():
            for frame in events.delta(d):
                yield frame
            finish_reason = d.finish_reason or finish_reason
        frames, final = events.finish(finish_reason, run.usage())
        for frame in frames:
            yield frame
        done(final)
    except APIError as exc:  # the engine failed mid-stream: say so in-band
        yield events.failed(exc)
    finally:
        await run.close()
