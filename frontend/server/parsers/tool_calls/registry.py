"""Every tool-call format by the name `--tool-call-parser` takes, and the one a chat template
implies. A new family is its own file (a `CallFormat`, call_format.py) and its lines here."""

from __future__ import annotations

from deepinfer.frontend.server.parsers.tool_calls.call_format import CallFormat
from deepinfer.frontend.server.parsers.tool_calls.deepseek import (
    DEEPSEEK_V3,
    DEEPSEEK_V31,
    DS_CALLS_BEGIN,
)
from deepinfer.frontend.server.parsers.tool_calls.hermes import HERMES
from deepinfer.frontend.server.parsers.tool_calls.mistral import MISTRAL, MISTRAL_CALLS
from deepinfer.frontend.server.parsers.tool_calls.qwen3_xml import QWEN3_XML


def format_for_template(template: str | None) -> str:
    """The tool-call parser a chat template implies: the format it writes earlier calls back
    in; hermes when it shows none it knows."""
    template = template or ""
    if DS_CALLS_BEGIN in template:  # V3 fences the arguments, V3.1 and V4 do not
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_xml"
    if MISTRAL_CALLS in template:
        return "mistral"
    return "hermes"


TOOL_CALL_PARSERS: dict[str, CallFormat] = {
    "hermes": HERMES,
    "llama3_json": HERMES,
    "qwen3_xml": QWEN3_XML,
    "qwen3_coder": QWEN3_XML,
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v31": DEEPSEEK_V31,
    "mistral": MISTRAL,
}
