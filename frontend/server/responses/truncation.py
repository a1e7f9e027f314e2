"""`truncation: "auto"`: a conversation longer than the context loses its oldest input items
(OpenAI drops items of the conversation the same way) until its prompt leaves room for the
answer; the newest item always stays, and so does nothing that answers a dropped call. Each try
only tokenizes the conversation (count_only): nothing is computed or cached."""

from __future__ import annotations

import uuid

from starlette.requests import Request

from deepinfer.frontend.server.common.chat_turns import decode_chat_dict, start_chat
from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.responses.input import chat_request
from deepinfer.frontend.server.responses.schema import (
    FunctionCallOutputItem,
    InputItem,
    ResponsesRequest,
)
from deepinfer.frontend.server.state import ServerState


async def fit_context(state: ServerState, request: Request, req: ResponsesRequest,
                      items: list[InputItem]) -> list[InputItem]:
    """`items` without as many of the oldest as it takes for the prompt and the answer's
    `max_output_tokens` (one token when unset) to fit the context."""
    room = state.context_len - max(req.max_output_tokens or 1, 1)
    while len(items) > 1:
        tokens = await _prompt_tokens(state, request, req, items)
        if tokens is not None and tokens <= room:
            break
        # Keep about the share that fits (at least one item fewer each round); half of them
        # when the conversation was too long to be counted.
        share = len(items) * room // tokens if tokens is not None else len(items) // 2
        keep = max(1, min(len(items) - 1, share))
        items = items[len(items) - keep:]
        while len(items) > 1 and isinstance(items[0], FunctionCallOutputItem):
            items = items[1:]  # its call is gone: a template may refuse an answer to nothing
    return items


async def _prompt_tokens(state: ServerState, request: Request, req: ResponsesRequest,
                         items: list[InputItem]) -> int | None:
    """The conversation's prompt length; None when it is too long to be counted."""
    chat = decode_chat_dict(chat_request(req, items))
    try:
        run = await start_chat(state, request, chat, f"count-{uuid.uuid4().hex}",
                               count_only=True)
    except APIError as exc:
        if exc.code == "context_length_exceeded":
            return None
        raise
    try:
        return run.usage().prompt_tokens
    finally:
        await run.close()
