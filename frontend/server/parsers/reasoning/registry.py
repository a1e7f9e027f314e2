"""Every reasoning parser by the name `--reasoning-parser` takes. A new family is its own file
(a `ReasoningParser` subclass, base.py) and one line here."""

from __future__ import annotations

from deepinfer.frontend.server.parsers.reasoning.base import ReasoningParser
from deepinfer.frontend.server.parsers.reasoning.deepseek_r1 import DeepSeekR1Parser
from deepinfer.frontend.server.parsers.reasoning.deepseek_v3 import DeepSeekV3Parser
from deepinfer.frontend.server.parsers.reasoning.qwen3 import Qwen3Parser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1Parser,
    "qwen3": Qwen3Parser,
    "deepseek_v3": DeepSeekV3Parser,
}
