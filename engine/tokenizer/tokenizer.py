"""The model's tokenizer and chat template, from its HF files, without transformers."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from deepinfer.engine.chat_template import read_chat_template
from deepinfer.engine.protocol import ChatMessage
from deepinfer.engine.tokenizer.tool_prompt import hermes_messages, renders_tools


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


# Placed after a final assistant message's text to find where the template wrote it.
_CONTINUE_MARK = "<deepinfer-continue-here> "


class ChatTemplateError(ValueError):
    pass


def chat_dict(msg: ChatMessage) -> dict:
    """A message as chat templates read it: role and content, tool fields when present."""
    out: dict = {"role": msg.role, "content": msg.content}
    if msg.tool_calls:
        out["tool_calls"] = msg.tool_calls
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.name is not None:
        out["name"] = msg.name
    if msg.reasoning_content is not None:
        out["reasoning_content"] = msg.reasoning_content
    return out


class Tokenizer:
    def __init__(self, model_dir: str) -> None:
        path = Path(model_dir)
        self.hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.chat_template: str | None = read_chat_template(model_dir)
        self._compiled = None
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest text one token stands for (at most its vocabulary string's length): a
        text of n characters is at least n / this many tokens."""
        return max(map(len, self.hf.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, letting other threads run meanwhile (tokenizers' batch call releases the
        GIL, its single one does not)."""
        return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (special tokens included)."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True,
        tools: list[dict] | None = None, template_kwargs: dict | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """`template_kwargs`: more variables for the template (the API refuses the names it
        sets itself). `continue_final_message`: the last message is an assistant's answer begun
        (a prefill): the prompt ends with its text, for the model to go on, instead of closing
        that turn (as transformers cuts it: where a mark placed after the text lands)."""
        if continue_final_message:
            return self._continued(messages, tools, template_kwargs)
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        extra = dict(template_kwargs or {})
        if renders_tools(self.chat_template):
            if tools:
                extra["tools"] = tools
        elif tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = hermes_messages(messages, tools)
        if self._compiled is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
            self._compiled = env.from_string(self.chat_template)
        return self._compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    def _continued(self, messages: list[dict], tools: list[dict] | None,
                   template_kwargs: dict | None) -> str:
        """The prompt ending with the final assistant message's text, for the model to go on.
        A mark after the text finds where the template put it; a template that trims the text
        trims the mark's space too, and then the text's trailing space goes as well."""
        final = messages[-1] if messages else {}
        if final.get("role") != "assistant":
            raise ChatTemplateError("only an assistant message can be continued")
        if final.get("tool_calls"):
            raise ChatTemplateError("an assistant message with tool calls cannot be continued")
        if not final["content"]:  # an empty answer begun: a new turn is the same thing
            return self.apply_chat_template(messages[:-1], True, tools, template_kwargs)
        marked = [*messages[:-1], {**final, "content": final["content"] + _CONTINUE_MARK}]
        text = self.apply_chat_template(marked, False, tools, template_kwargs)
        at = text.rfind(_CONTINUE_MARK.strip())
        if at < 0:
            raise ChatTemplateError("the chat template does not write the final assistant "
                                    "message as sent, so it cannot be continued")
        kept = text[at: at + len(_CONTINUE_MARK)] == _CONTINUE_MARK
        return text[:at] if kept else text[:at].rstrip()

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True,
        tools: list[dict] | None = None, template_kwargs: dict | None = None,
        continue_final_message: bool = False,
    ) -> tuple[str, list[int]]:
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs,
                                        continue_final_message)
        # The template already holds every special token it wants.
        return text, self.encode(text, add_special_tokens=False)


def _raise(message: str):
    raise ChatTemplateError(message)
