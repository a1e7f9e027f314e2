"""GET /openapi.json: the server's OpenAPI 3.1 description, generated from the structs the
handlers decode requests into and encode responses from (common/openai_schema.py,
openai/objects.py, responses/schema.py, responses/objects.py, anthropic/schema.py), so it
cannot drift from what the server accepts."""

from __future__ import annotations

from typing import Any

import msgspec

from deepinfer.frontend.server.anthropic.schema import (
    CountTokensRequest,
    ErrorOut,
    MessageOut,
    MessagesRequest,
    TokenCount,
)
from deepinfer.frontend.server.common.openai_schema import ChatCompletionRequest, CompletionRequest
from deepinfer.frontend.server.lora_routes import LoadLoRARequest, UnloadLoRARequest
from deepinfer.frontend.server.openai.objects import ChatCompletion, Completion, ModelList
from deepinfer.frontend.server.responses.objects import ResponseDeleted, ResponseObject
from deepinfer.frontend.server.responses.schema import ResponsesRequest

_REF = "#/components/schemas/{name}"


def _error_body() -> dict[str, Any]:
    return {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "integer", "null"]}}}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(code): {"description": why, "content": {"application/json": {
        "schema": {"$ref": _REF.format(name="Error")}}}}
        for code, why in ((400, "invalid request (the message names the field)"),
                          (401, "missing or wrong API key (with --api-key)"),
                          (403, "a Host name or a web page's origin this server does not "
                                "serve (--allowed-hosts, --allowed-origins)"),
                          (404, "no such model"),
                          (413, "request body too large"),
                          (415, "a body that is not declared application/json"),
                          (503, "overloaded, draining, or the engine is down"))
        if code in codes}


def _generation(name: str, summary: str, request: dict, response: dict) -> dict[str, Any]:
    return {"post": {
        "operationId": name, "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {
            "200": {"description": "the completion (or, with stream: true, its SSE events)",
                    "content": {"application/json": {"schema": response},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 403, 404, 413, 415, 503)}}}


def _plain_get(name: str, summary: str, content: dict[str, Any]) -> dict[str, Any]:
    return {"get": {"operationId": name, "summary": summary,
                    "responses": {"200": {"description": summary, "content": content},
                                  **_errors(401, 503)}}}


def _by_response_id(name: str, summary: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"operationId": name, "summary": summary,
            "parameters": [{"name": "response_id", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {
                "200": {"description": summary,
                        "content": {"application/json": {"schema": schema}}},
                "404": {"description": "no stored response of that id", "content": {
                    "application/json": {"schema": {"$ref": _REF.format(name="Error")}}}},
                **_errors(401)}}


def _responses_api(created: dict[str, Any], response: dict[str, Any],
                   deleted: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The Responses API's paths: create, then get or delete a stored response by its id."""
    create = _generation("createResponse", "model response (OpenAI Responses API)", created,
                         response)
    create["post"]["responses"]["404"]["description"] = \
        "no such model, or no stored response of that previous_response_id"
    return {"/v1/responses": create, "/v1/responses/{response_id}": {
        "get": _by_response_id("getResponse", "a stored response", response),
        "delete": _by_response_id("deleteResponse", "the response deleted", deleted)}}


def _messages_api(doc: dict[str, Any], api_key: bool) -> None:
    """Add Anthropic's Messages API: its schemas (named Anthropic*, apart from OpenAI's), its
    two paths, and with a key, `x-api-key` as a second way to give it."""
    ref = _REF.format(name="Anthropic{name}")
    (create, count, message, tokens, error), schemas = msgspec.json.schema_components(
        [MessagesRequest, CountTokensRequest, MessageOut, TokenCount, ErrorOut], ref_template=ref)
    doc["components"]["schemas"].update({f"Anthropic{k}": v for k, v in schemas.items()})
    messages = _generation("createMessage", "message (Anthropic Messages API)", create, message)
    counting = _generation("countMessageTokens", "the prompt's token count", count, tokens)
    counting["post"]["responses"]["200"] = {"description": "the prompt's token count",
                                            "content": {"application/json": {"schema": tokens}}}
    for op in (messages["post"], counting["post"]):
        for code, answer in op["responses"].items():
            if code != "200":
                answer["content"]["application/json"]["schema"] = error
        if api_key:
            op["security"] = [{"bearer": []}, {"x-api-key": []}]
    doc["paths"].update({"/v1/messages": messages, "/v1/messages/count_tokens": counting})
    if api_key:
        doc["components"]["securitySchemes"]["x-api-key"] = {
            "type": "apiKey", "in": "header", "name": "x-api-key"}


def _lora_update(name: str, summary: str, request: dict[str, Any]) -> dict[str, Any]:
    """POST /v1/load_lora_adapter or /v1/unload_lora_adapter (--allow-runtime-lora-updating;
    404 without it); a plain-text answer, as vLLM's."""
    return {"post": {
        "operationId": name, "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {"200": {"description": summary, "content": {
            "text/plain": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 403, 404, 415, 503)}}}


def openapi_document(version: str, api_key: bool) -> dict[str, Any]:
    (chat, completion, chat_out, completion_out, models, responses_in, response, deleted), \
        schemas = msgspec.json.schema_components(
            [ChatCompletionRequest, CompletionRequest, ChatCompletion, Completion, ModelList,
             ResponsesRequest, ResponseObject, ResponseDeleted],
            ref_template=_REF)
    (load, unload), lora_schemas = msgspec.json.schema_components(
        [LoadLoRARequest, UnloadLoRARequest], ref_template=_REF)
    schemas.update(lora_schemas)
    schemas["Error"] = _error_body()
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "DeepInfer", "version": version,
                 "description": "OpenAI-compatible LLM inference server"},
        "paths": {
            "/v1/chat/completions": _generation(
                "createChatCompletion", "chat completion", chat, chat_out),
            "/v1/completions": _generation(
                "createCompletion", "text completion", completion, completion_out),
            **_responses_api(responses_in, response, deleted),
            "/v1/models": _plain_get("listModels", "the served model",
                                     {"application/json": {"schema": models}}),
            "/v1/audit": _plain_get("audit", "the exactness audit (--audit-rate): counts and "
                                    "the latest divergences",
                                    {"application/json": {"schema": {"type": "object"}}}),
            "/v1/load_lora_adapter": _lora_update("loadLoRAAdapter",
                                                  "a LoRA adapter loaded", load),
            "/v1/unload_lora_adapter": _lora_update("unloadLoRAAdapter",
                                                    "a LoRA adapter unloaded", unload),
            "/health": {"get": {"operationId": "health", "summary": "200 while serving",
                                "responses": {"200": {"description": "serving"},
                                              "503": {"description": "starting, draining or "
                                                                     "down"}}}},
            "/version": _plain_get("version", "the server's version",
                                   {"application/json": {"schema": {"type": "object"}}}),
            "/metrics": _plain_get("metrics", "Prometheus metrics",
                                   {"text/plain": {"schema": {"type": "string"}}}),
        },
        "components": {"schemas": schemas},
    }
    if api_key:  # /v1 routes and /metrics want the key; /health and /version stay open
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in doc["paths"].items():
            if path.startswith("/v1/") or path == "/metrics":
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    _messages_api(doc, api_key)
    return doc
