"""A checkpoint's chat template, as its files give it: tokenizer_config.json's `chat_template`
(the default one of a named list), else chat_template.jinja. The tokenizer renders it; the API
server reads it to recognise the model's tool-call format."""

from __future__ import annotations

import json
from pathlib import Path


def read_chat_template(model_dir: str) -> str | None:
    path = Path(model_dir)
    cfg_path = path / "tokenizer_config.json"
    template = json.loads(cfg_path.read_text()).get("chat_template") if cfg_path.exists() \
        else None
    jinja_path = path / "chat_template.jinja"
    if template is None and jinja_path.exists():
        template = jinja_path.read_text()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template
