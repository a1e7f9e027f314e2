"""What the HTTP handlers share: the engine client, metrics, the admission bound, the model."""

from __future__ import annotations

import fnmatch
import re
import time
from typing import Any, Protocol

from deepinfer.engine.protocol import GenerateRequest, LoRAUpdate, LoRAUpdated, SchedulerStats
from deepinfer.frontend.server.errors import APIError, server_error
from deepinfer.frontend.server.metrics import Metrics
from deepinfer.frontend.server.parsers.tool_calls.registry import TOOL_CALL_PARSERS
from deepinfer.frontend.server.responses.store import ResponseStore

_PATTERN = re.compile(r"[*?\[]")  # an alias with these is an fnmatch pattern


class EngineClient(Protocol):
    """What the server uses of `engine.runtime.async_client.AsyncEngineClient` (tests fake it)."""

    model_name: str
    context_len: int
    stats: SchedulerStats
    dead_reason: str | None
    lora_load_seconds: dict[str, float]  # the --lora-modules adapters' load times, once started

    @property
    def healthy(self) -> bool: ...

    async def start(self, on_failure: Any = None) -> None: ...

    def generate(self, request: GenerateRequest) -> Any: ...  # AsyncIterator[RequestOutput]

    async def update_lora(self, update: LoRAUpdate) -> LoRAUpdated: ...

    async def shutdown(self) -> None: ...


class ServerState:
    def __init__(self, max_pending: int, model_aliases: tuple[str, ...] = (),
                 grammar_max_bytes: int = 65536, api_key: str | None = None,
                 max_buffered_outputs: int = 4096, reasoning_parser: str | None = None,
                 tool_call_parser: str = "hermes", responses_store_size: int = 1000,
                 responses_store_mb: float = 256.0,
                 lora_adapters: dict[str, str] | None = None, ui: bool = True,
                 allow_lora_updates: bool = False) -> None:
        self.client: EngineClient | None = None
        self.api_key = api_key  # /v1 routes want it as a Bearer token (frontend/auth.py)
        self.ui = ui  # serve the browser page at / (--no-ui: off)
        self.draining = False  # shutting down: requests in flight finish, new ones get 503
        self.metrics = Metrics(self)
        self.max_pending = max_pending
        self.pending = 0  # engine requests admitted and not yet finished
        self.model_aliases = model_aliases
        self.lora_adapters = lora_adapters or {}  # --lora-modules: name -> path
        self.allow_lora_updates = allow_lora_updates  # --allow-runtime-lora-updating
        self.grammar_max_bytes = grammar_max_bytes  # longest schema/regex/grammar text accepted
        # A stream whose client reads slower than the engine writes buffers its outputs here;
        # past this many the request is aborted rather than the server's memory grown.
        self.max_buffered_outputs = max_buffered_outputs
        self.reasoning_parser = reasoning_parser  # --reasoning-parser (parsers/reasoning/)
        self.tool_call_format = TOOL_CALL_PARSERS[tool_call_parser]  # (parsers/tool_calls/)
        # Finished /v1/responses kept for GET and previous_response_id (responses/store.py).
        self.responses = ResponseStore(responses_store_size, int(responses_store_mb * (1 << 20)))
        self.created = int(time.time())
        self.failure: str | None = None

    @property
    def ready(self) -> bool:
        return self.client is not None

    @property
    def engine_dead(self) -> bool:
        return self.failure is not None or (
            self.client is not None and self.client.dead_reason is not None
        )

    @property
    def healthy(self) -> bool:
        return self.client is not None and not self.engine_dead and self.client.healthy

    @property
    def model_name(self) -> str:
        return self.client.model_name if self.client is not None else ""

    @property
    def context_len(self) -> int:
        return self.client.context_len if self.client is not None else 0

    def is_alias(self, name: str) -> bool:
        """`name` is one of --served-model-name's other names, or matches one of its patterns
        ('claude-*': Claude Code names Claude models, and its background calls other ones)."""
        return any(name == alias or (_PATTERN.search(alias) and fnmatch.fnmatchcase(name, alias))
                   for alias in self.model_aliases)

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for a model
        this server does not serve. An adapter's own name wins over an alias pattern."""
        if name is not None and name in self.lora_adapters and name not in self.model_aliases:
            return name
        if name is None or name == self.model_name or self.is_alias(name):
            return None
        served = ", ".join(repr(n) for n in (self.model_name, *self.lora_adapters))
        raise APIError(
            f"the model {name!r} does not exist; this server serves {served}",
            status=404,
            param="model",
            code="model_not_found",
        )

    def response_model(self, name: str | None) -> str:
        """The `model` a response names: the LoRA adapter the request picked (as vLLM
        answers), else the served model's name."""
        return self.check_model(name) or self.model_name

    def admit(self, count: int) -> None:
        """Take `count` slots of the bounded queue, or raise 503 (retry later)."""
        if self.draining:
            raise APIError("the server is shutting down", status=503, type="server_error",
                           code="shutting_down")
        if not self.healthy:
            reason = self.failure or (self.client.dead_reason if self.client else None)
            raise server_error(f"the engine is not available: {reason or 'starting'}")
        if self.pending + count > self.max_pending:
            raise APIError(
                f"server busy: {self.pending} requests pending (limit {self.max_pending})",
                status=503,
                type="server_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        self.pending += count
        self.metrics.in_flight.inc(count)

    def release(self, count: int) -> None:
        self.pending -= count
        self.metrics.in_flight.dec(count)

