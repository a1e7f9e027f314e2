"""Tool calling for chat templates that do not render tools themselves.

A template that mentions `tools` receives them (and `tool_calls` / tool turns) as its authors
intended. Otherwise the Hermes convention is the fallback: the tools are described in the system
message inside <tools></tools>, the model is asked to answer with <tool_call>{...}</tool_call>
blocks, earlier calls are written back in that form and tool results come back as user turns in
<tool_response></tool_response>. The API's tool-call parser reads the same blocks.
"""

from __future__ import annotations

import json

_INSTRUCTIONS = (
    "You may call one or more functions to answer the user. The functions you can call are "
    "described by these JSON signatures:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one block per call, each a JSON object with the function's "
    "name and its arguments:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>'
)


def renders_tools(template: str) -> bool:
    return "tools" in template


def call_block(call: dict) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # written back as the string it was
    body = json.dumps({"name": fn.get("name", ""), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` rewritten for a template that knows nothing of tools."""
    out = []
    for msg in messages:
        role, content = msg["role"], msg.get("content") or ""
        if role == "assistant" and msg.get("tool_calls"):
            blocks = "\n".join(call_block(c) for c in msg["tool_calls"])
            content = f"{content}\n{blocks}" if content else blocks
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        described = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        text = _INSTRUCTIONS.format(tools=described)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
