"""The request's tool fields, checked (OpenAI chat-completions shapes, which every endpoint
translates onto).

`parse_tools` checks the request's `tools` / `tool_choice` / `parallel_tool_calls` and returns a
`ToolSetup` (or None when tools play no part): the functions the chat template renders, the
grammar a forced call needs, and the mode `ToolCallParser` (parser.py) reads the output in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from deepinfer.frontend.server.errors import APIError

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolSetup:
    mode: str  # "none" | "auto" | "required" | "named"
    functions: list[dict[str, Any]]  # each {"name", "description", "parameters"}
    named: str | None = None
    parallel: bool = True

    def grammar_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow, or None when the model writes freely."""
        if self.mode == "named":
            return next(f["parameters"] for f in self.functions if f["name"] == self.named)
        if self.mode != "required":
            return None
        alternatives = [
            {
                "type": "object",
                # "name" first: the grammar generates properties in schema order, and the parser
                # can only start streaming a call once its name is known.
                "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.functions
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": alternatives}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def render_tools(self) -> list[dict[str, Any]] | None:
        """The tools as a chat template receives them; None when the model must not call any."""
        if self.mode == "none":
            return None
        return [{"type": "function", "function": dict(f)} for f in self.functions]


def _function(i: int, tool: Any) -> dict[str, Any]:
    at = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise APIError(f"{at} must be an object", param=at)
    if tool.get("type") != "function":
        raise APIError(f"{at}.type must be 'function'", param=f"{at}.type")
    fn = tool.get("function")
    at += ".function"
    if not isinstance(fn, dict):
        raise APIError(f"{at} must be an object", param=at)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise APIError(
            f"{at}.name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'", param=f"{at}.name"
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(f"{at}.description must be a string", param=f"{at}.description")
    parameters = fn.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise APIError(f"{at}.parameters must be a JSON schema object", param=f"{at}.parameters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(f"{at}.strict must be a boolean", param=f"{at}.strict")
    return {
        "name": name,
        "description": description or "",
        "parameters": parameters if parameters is not None else dict(_DEFAULT_PARAMETERS),
    }


def _choice(tool_choice: str | dict | None, has_tools: bool) -> tuple[str, str | None]:
    """(mode, named function) for `tool_choice`; the name is checked against the tools later."""
    if tool_choice is None:
        return ("auto" if has_tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(
                f"tool_choice must be 'none', 'auto', 'required' or a function: {tool_choice!r}",
                param="tool_choice",
            )
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise APIError(
            'tool_choice must be {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return "named", name


def parse_tools(
    tools: list | None, tool_choice: str | dict | None, parallel_tool_calls: bool | None
) -> ToolSetup | None:
    """Validate the request's tool fields; None when no tools are given and none are forced."""
    if tools is not None and not isinstance(tools, list):
        raise APIError("tools must be an array", param="tools")
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or []):
        fn = _function(i, tool)
        if any(f["name"] == fn["name"] for f in functions):
            raise APIError(
                f"duplicate function name {fn['name']!r}", param=f"tools[{i}].function.name"
            )
        functions.append(fn)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise APIError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")

    mode, named = _choice(tool_choice, bool(functions))
    if not functions:
        if mode in ("required", "named"):
            raise APIError(f"tool_choice {mode!r} needs tools", param="tool_choice")
        return None  # "none" or "auto" with nothing to call: plain chat
    if named is not None and all(f["name"] != named for f in functions):
        raise APIError(f"tool_choice names unknown function {named!r}", param="tool_choice")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolSetup(mode, functions, named, parallel)
