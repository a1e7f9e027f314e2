"""Structured output fields of a request -> the GrammarSpec the workers compile.

OpenAI's `response_format` (json_object, json_schema) and vLLM's extensions (guided_json,
guided_regex, guided_choice, guided_grammar) are one constraint each; a request may ask for one.
Shapes and sizes are checked here (400 naming the field); whether the schema, regex or grammar
compiles is the workers' answer, which also comes back as a 400 before any token.
"""

from __future__ import annotations

import json
from typing import Any

from deepinfer.engine.protocol import GrammarSpec
from deepinfer.frontend.server.common.openai_schema import _SamplingFields
from deepinfer.frontend.server.errors import APIError

BACKENDS = (None, "auto", "xgrammar")


def _json_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise APIError(f"{param} is not valid JSON: {exc}", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise APIError(f"{param} must be a JSON schema (an object)", param=param)
    return json.dumps(value, ensure_ascii=False)


def _response_format(fmt: dict[str, Any]) -> GrammarSpec | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError("response_format.json_schema must be an object with a schema",
                           param="response_format.json_schema")
        if "schema" not in spec:
            raise APIError("response_format.json_schema.schema is required",
                           param="response_format.json_schema.schema")
        return GrammarSpec("json_schema",
                           _json_text(spec["schema"], "response_format.json_schema.schema"))
    raise APIError(f"response_format type {kind!r} is not supported (text, json_object or "
                   "json_schema)", param="response_format.type")


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escapes are EBNF's as well)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _choice(choices: Any) -> GrammarSpec:
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise APIError("guided_choice must be a non-empty list of non-empty strings",
                       param="guided_choice")
    return GrammarSpec("ebnf", choice_grammar(choices))


def grammar_spec(req: _SamplingFields, max_bytes: int,
                 tools: GrammarSpec | None = None) -> GrammarSpec | None:
    """The request's one constraint (`tools`: the one tool_choice asks for), or None."""
    _check_backend(req.guided_decoding_backend)
    asked: list[tuple[str, GrammarSpec]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            asked.append(("response_format", spec))
    if req.guided_json is not None:
        asked.append(("guided_json", GrammarSpec("json_schema",
                                                 _json_text(req.guided_json, "guided_json"))))
    if req.guided_regex is not None:
        asked.append(("guided_regex", GrammarSpec("regex", req.guided_regex)))
    if req.guided_choice is not None:
        asked.append(("guided_choice", _choice(req.guided_choice)))
    if req.guided_grammar is not None:
        asked.append(("guided_grammar", GrammarSpec("ebnf", req.guided_grammar)))
    if tools is not None:
        asked.append(("tool_choice", tools))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise APIError(f"only one structured output constraint per request, got {names}",
                       param=asked[1][0])
    param, spec = asked[0]
    if len(spec.spec.encode()) > max_bytes:
        raise APIError(f"{param} is {len(spec.spec.encode())} bytes; this server compiles "
                       f"grammars of at most {max_bytes} bytes", param=param)
    if spec.kind in ("regex", "ebnf") and not spec.spec.strip():
        raise APIError(f"{param} must not be empty", param=param)
    return spec


def _check_backend(backend: str | None) -> None:
    if backend not in BACKENDS:
        raise APIError(f"guided_decoding_backend {backend!r} is not available; this server "
                       "uses xgrammar", param="guided_decoding_backend")
