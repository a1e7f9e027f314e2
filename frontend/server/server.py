"""Run the API server: the engine first, then uvicorn on uvloop.

The engine starts before uvicorn does, so a model or engine that cannot start raises
(ModelConfigError, EngineStartupError) out of `serve` before any socket is bound or uvicorn logs
a line: the command prints it as one error line.
SIGINT/SIGTERM: uvicorn shuts down gracefully, the lifespan stops the engine, exit code 0 (during
the engine's start: the engine is stopped once started, exit code 0).
Engine failure: the reason is logged, uvicorn is told to exit, exit code 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette

from deepinfer.engine.chat_template import read_chat_template
from deepinfer.engine.config import EngineConfig
from deepinfer.frontend.server.app import build_app, start_engine
from deepinfer.frontend.server.origin_checks import OriginPolicy
from deepinfer.frontend.server.parsers.tool_calls.registry import format_for_template
from deepinfer.frontend.server.state import ServerState

log = logging.getLogger("deepinfer.server")


class _Server(uvicorn.Server):
    """uvicorn, with a drain before it stops: the first SIGINT/SIGTERM turns new requests away
    (503) while those in flight finish, for up to `shutdown_timeout` seconds; a second signal
    stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float
                 ) -> None:
        super().__init__(config)
        self.state, self.shutdown_timeout = state, shutdown_timeout
        self.loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises a captured SIGINT/SIGTERM after shutdown, which would turn a clean
        # stop into a KeyboardInterrupt or a death by signal; a handled signal is a clean exit.
        self.loop = asyncio.get_running_loop()
        with super().capture_signals():
            yield
            self._captured_signals.clear()

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining or self.loop is None or self.shutdown_timeout <= 0:
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)
        self.state.draining = True
        log.info("draining: %d requests in flight, new ones get 503 (up to %g s)",
                 self.state.pending, self.shutdown_timeout)
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain(sig, frame)))

    async def _drain(self, sig: int, frame) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self.state.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.pending:
            log.warning("shutdown timeout: %d requests still in flight", self.state.pending)
        super().handle_exit(sig, frame)


def _loop_factory():
    try:
        import uvloop

        return uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.new_event_loop


async def _start_engine(app: Starlette) -> bool:
    """Start the engine; True if SIGINT/SIGTERM came meanwhile (uvicorn's handlers are not in
    place yet: the start completes, then the caller stops it instead of serving)."""
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signalled.set)
    try:
        await start_engine(app)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return signalled.is_set()


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_pending: int = 256,
    log_level: str = "info",
    access_log: bool = False,
    api_key: str | None = None,
    shutdown_timeout: float = 30.0,
    max_buffered_outputs: int = 4096,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    ui: bool = True,
    allowed_hosts: list[str] | None = None,
    allowed_origins: list[str] | None = None,
) -> int:
    """Serve until a signal (exit code 0) or an engine failure (exit code 1). An engine that
    cannot start raises (ModelConfigError, EngineStartupError) before uvicorn starts."""
    from deepinfer.engine.runtime.async_client import AsyncEngineClient

    state = ServerState(max_pending, model_aliases=config.model_aliases(),
                        grammar_max_bytes=config.grammar_max_bytes, api_key=api_key,
                        max_buffered_outputs=max_buffered_outputs,
                        reasoning_parser=reasoning_parser,
                        responses_store_size=config.responses_store_size,
                        responses_store_mb=config.responses_store_mb,
                        lora_adapters=config.lora_adapters(), ui=ui,
                        allow_lora_updates=config.allow_runtime_lora_updating,
                        tool_call_parser=tool_call_parser or format_for_template(
                            read_chat_template(config.resolved_model_dir())))
    exit_code = 0
    server: _Server | None = None

    def on_failure(reason: str) -> None:
        nonlocal exit_code
        exit_code = 1
        log.error("the engine failed (%s); stopping the server", reason)
        if server is not None:
            server.should_exit = True

    origins = OriginPolicy.create(host, allowed_hosts, allowed_origins)
    app = build_app(state, lambda: AsyncEngineClient(config), on_failure, origins)
    uv_config = uvicorn.Config(
        app, host=host, port=port, loop="uvloop", log_level=log_level, access_log=access_log,
        timeout_graceful_shutdown=5, lifespan="on",
    )
    server = _Server(uv_config, state, shutdown_timeout)
    signalled = False

    async def run() -> None:
        nonlocal signalled
        signalled = await _start_engine(app)
        if signalled:
            assert state.client is not None
            await state.client.shutdown()
            return
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"DeepInfer serving {state.model_name} at http://{host}:{port}", flush=True)
        await task

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(run())
    if signalled:
        return 0
    if not server.started:
        print("DeepInfer: the server failed to start (see the log above)", file=sys.stderr)
        return 1
    return exit_code
