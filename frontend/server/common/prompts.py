"""What the engine is asked to continue: chat messages or completion prompts, validated."""

from __future__ import annotations

from deepinfer.engine.protocol import ChatMessage
from deepinfer.frontend.server.common.openai_schema import CompletionRequest, Message
from deepinfer.frontend.server.common.sampling import INT32_MAX
from deepinfer.frontend.server.errors import APIError

ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
_TEXT_PARTS = {"text", "input_text"}


def _content(msg: Message, i: int) -> str:
    content = msg.content
    if content is None:
        if msg.role == "assistant":  # e.g. an earlier turn that only called tools
            return ""
        raise APIError(f"messages[{i}] has no content", param=f"messages[{i}].content")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise APIError(
                f"content part type {part.type!r} is not supported by this text model",
                param=f"messages[{i}].content[{j}].type",
            )
        texts.append(part.text)
    return "".join(texts)


def chat_messages(messages: list[Message]) -> list[ChatMessage]:
    if not messages:
        raise APIError("messages must not be empty", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if msg.role not in ROLES:
            raise APIError(f"unknown role {msg.role!r}", param=f"messages[{i}].role")
        role = "system" if msg.role == "developer" else msg.role
        out.append(ChatMessage(role, _content(msg, i), _tool_calls(msg, i), msg.tool_call_id,
                               msg.name, msg.reasoning_content or msg.reasoning))
    return out


def _tool_calls(msg: Message, i: int) -> list[dict] | None:
    """An assistant turn's earlier tool calls, as chat templates read them."""
    if not msg.tool_calls:
        return None
    for j, call in enumerate(msg.tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError("a tool call needs a function with a name",
                           param=f"messages[{i}].tool_calls[{j}].function")
    return list(msg.tool_calls)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one string, several strings, one token list or several."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    if all(isinstance(p, int) for p in prompt):
        prompts: list[list[int]] = [prompt]  # type: ignore[list-item]
    elif all(isinstance(p, list) for p in prompt):
        prompts = prompt  # type: ignore[assignment]
    else:
        raise APIError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token id lists",
            param="prompt",
        )
    for ids in prompts:
        if not ids:
            raise APIError("a token prompt must not be empty", param="prompt")
        # Past the vocabulary the tokenizer process rejects them; past int32 they cannot travel.
        if min(ids) < 0 or max(ids) > INT32_MAX:
            raise APIError(f"token ids must be in [0, {INT32_MAX}]", param="prompt")
    return prompts  # type: ignore[return-value]
