"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API as a thin
translation onto the shared chat path (common/chat_turns.py).

The request (after any stored conversation it continues) becomes a chat request
(input.py), runs as one, and its turn is put back as output items (output.py) or
streamed as Responses events (stream.py). With `store` (the default) the finished response
and its conversation are kept (store.py).
"""

from __future__ import annotations

import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from deepinfer.frontend.server.common.chat_turns import decode_chat_dict, start_chat
from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.http_io import SSEResponse, read_json
from deepinfer.frontend.server.responses.input import (
    chat_request,
    parse_items,
    responses_error,
    tool_namespaces,
    wants_logprobs,
)
from deepinfer.frontend.server.responses.objects import ResponseDeleted, ResponseObject
from deepinfer.frontend.server.responses.output import (
    base_response,
    finished,
    new_id,
    output_items,
)
from deepinfer.frontend.server.responses.schema import decode_responses
from deepinfer.frontend.server.responses.store import StoredResponse
from deepinfer.frontend.server.responses.stream import response_events
from deepinfer.frontend.server.responses.truncation import fit_context
from deepinfer.frontend.server.state import ServerState

_encode = msgspec.json.Encoder().encode


def _json(body: msgspec.Struct) -> Response:
    return Response(_encode(body), media_type="application/json")


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(f"no response with id {response_id!r} is stored", status=404, param=param,
                    code="not_found")


def _stored(state: ServerState, response_id: str, param: str | None = None) -> StoredResponse:
    stored = state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id, param)
    return stored


async def create_response(state: ServerState, request: Request) -> Response | SSEResponse:
    try:
        return await _create(state, request)
    except APIError as exc:  # the chat path names chat fields: name them as this API does
        raise responses_error(exc) from None


async def _create(state: ServerState, request: Request) -> Response | SSEResponse:
    req = await read_json(request, decode_responses)
    earlier = (_stored(state, req.previous_response_id, "previous_response_id").items
               if req.previous_response_id is not None else [])
    items = earlier + parse_items(req.input)
    if req.truncation == "auto":
        items = await fit_context(state, request, req, items)
    chat = decode_chat_dict(chat_request(req, items))
    store = req.store is not False and state.responses.enabled
    base = base_response(req, new_id("resp"), int(time.time()), state.response_model(chat.model),
                         store)
    run = await start_chat(state, request, chat, base.id)

    def keep(response: ResponseObject) -> None:
        if store:
            output = parse_items(msgspec.to_builtins(response.output))
            state.responses.put(StoredResponse(response, items + output))

    if req.stream:
        return SSEResponse(response_events(run, base, keep, wants_logprobs(req),
                                           tool_namespaces(req.tools)))
    turns = await run.results(request)
    if turns is None:
        return Response(status_code=499)
    turn = turns[0]
    output = output_items(turn, run.reasoning_on, wants_logprobs(req), tool_namespaces(req.tools))
    body = finished(base, output, turn.finish_reason,
                    run.usage(), int(time.time()))
    keep(body)
    return _json(body)


async def stored_response(state: ServerState, request: Request) -> Response:
    """GET (or HEAD) returns the stored response, DELETE forgets it (one route, so that a 405
    lists both methods)."""
    response_id = request.path_params["response_id"]
    if request.method != "DELETE":
        return _json(_stored(state, response_id).response)
    if not state.responses.delete(response_id):
        raise _not_found(response_id)
    return _json(ResponseDeleted(response_id))
