"""GET /openapi.json: the server's OpenAPI 3.1 description, generated from the structs the
handlers decode requests into and encode responses from (openai_schema.py,
openai_responses.py), so it cannot drift from what the server accepts."""

from __future__ import annotations

from typing import Any

import msgspec

from deepinfer.frontend.server.openai_responses import ChatCompletion, Completion, ModelList
from deepinfer.frontend.server.openai_schema import ChatCompletionRequest, CompletionRequest

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
                          (404, "no such model"),
                          (413, "request body too large"),
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
            **_errors(400, 401, 404, 413, 503)}}}


def _plain_get(name: str, summary: str, content: dict[str, Any]) -> dict[str, Any]:
    return {"get": {"operationId": name, "summary": summary,
                    "responses": {"200": {"description": summary, "content": content},
                                  **_errors(401, 503)}}}


def openapi_document(version: str, api_key: bool) -> dict[str, Any]:
    (chat, completion, chat_out, completion_out, models), schemas = \
        msgspec.json.schema_components(
            [ChatCompletionRequest, CompletionRequest, ChatCompletion, Completion, ModelList],
            ref_template=_REF)
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
            "/v1/models": _plain_get("listModels", "the served model",
                                     {"application/json": {"schema": models}}),
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
    if api_key:  # /v1 routes want the key; /health, /metrics and /version stay open
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in doc["paths"].items():
            if path.startswith("/v1/"):
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return doc
