"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's endpoints for changing the
served LoRA adapters at run time (--allow-runtime-lora-updating), with its request bodies and
its plain-text answers, so scripts written for it work unchanged.

The workers read and check a loaded adapter (its files, rank, target modules and shapes against
this model): a problem is a 400 naming it. An unloaded adapter's name is refused to new requests
at once; the answer comes once the requests already using it have finished.
"""

from __future__ import annotations

import uuid
from typing import Annotated

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from deepinfer.engine.protocol import LoRAUpdate
from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.http_io import read_json
from deepinfer.frontend.server.state import ServerState

_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class LoadLoRARequest(msgspec.Struct, forbid_unknown_fields=False):
    lora_name: _Name
    lora_path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class UnloadLoRARequest(msgspec.Struct, forbid_unknown_fields=False):
    lora_name: _Name
    lora_path: str | None = None  # accepted and unused, as vLLM does


_decode_load = msgspec.json.Decoder(LoadLoRARequest).decode
_decode_unload = msgspec.json.Decoder(UnloadLoRARequest).decode


def _check_allowed(state: ServerState) -> None:
    if not state.allow_lora_updates:
        raise APIError("changing LoRA adapters at run time is off (start the server with "
                       "--enable-lora --allow-runtime-lora-updating)", status=404,
                       type="not_found_error")


async def load_lora_adapter(state: ServerState, request: Request) -> Response:
    _check_allowed(state)
    body = await read_json(request, _decode_load)
    name = body.lora_name
    if name == state.model_name or state.is_alias(name):
        raise APIError(f"{name!r} is the base model's name", param="lora_name")
    if name in state.lora_adapters:
        raise APIError(f"a LoRA adapter named {name!r} is already loaded", param="lora_name")
    answer = await _update(state, LoRAUpdate(_request_id(), name, body.lora_path))
    if answer.error is not None:
        raise APIError(f"cannot load the LoRA adapter {name!r}: {answer.error}",
                       param="lora_path")
    state.lora_adapters[name] = body.lora_path
    state.metrics.lora_load_seconds.observe(answer.seconds)
    return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")


async def unload_lora_adapter(state: ServerState, request: Request) -> Response:
    _check_allowed(state)
    name = (await read_json(request, _decode_unload)).lora_name
    path = state.lora_adapters.pop(name, None)  # new requests naming it: 404 from now on
    if path is None:
        raise APIError(f"no LoRA adapter {name!r} is loaded", status=404, param="lora_name",
                       type="not_found_error")
    answer = await _update(state, LoRAUpdate(_request_id(), name, unload=True))
    if answer.error is not None:  # the engine does not know it (it died meanwhile, say)
        raise APIError(f"cannot unload the LoRA adapter {name!r}: {answer.error}",
                       param="lora_name")
    return Response(f"Success: LoRA adapter '{name}' removed successfully.",
                    media_type="text/plain")


async def _update(state: ServerState, update: LoRAUpdate):
    if not state.healthy:
        raise APIError("the engine is not available", status=503, type="server_error")
    return await state.client.update_lora(update)


def _request_id() -> str:
    return f"lora-{uuid.uuid4().hex}"
