"""Starts, watches and stops the engine's processes (tokenizer, scheduler, workers).

The launcher lives in the caller's process (API server or offline `LLM`). A supervisor thread
waits on every child's sentinel: if one dies while the engine runs, it reports which and why,
stops the others and calls `on_failure`. `shutdown()` stops every child within a few seconds
(SIGTERM, then SIGKILL) and removes the socket directory.

Children run the caller's interpreter with its environment and import DeepInfer as the caller
did, as the installed `deepinfer` package (every module of ours lives under that one name, so
no other distribution's package can shadow one); the working directory is not put on their
path.
"""

from __future__ import annotations

import base64
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.protocol import ControlMessage, ProcessFailed, ProcessReady
from deepinfer.engine.runtime.ipc import Endpoints

log = logging.getLogger("deepinfer.launcher")

TOKENIZER = "deepinfer.engine.tokenizer.tokenizer_process:main"
SCHEDULER = "deepinfer.engine.scheduler.scheduler_process:main"
# Resolved by name in the child: the engine never imports worker (torch) code itself.
WORKER = "deepinfer.workers.worker_process:main"


class EngineStartupError(RuntimeError):
    pass


def child_argv(*args: str) -> list[str]:
    # -P (3.11+): no working directory on sys.path, where a folder named like one of our
    # dependencies (or a checkout's own deepinfer/) could shadow the installed package.
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", "deepinfer.engine.runtime.process_entry", *args]


class Launcher:
    def __init__(self, config: EngineConfig, endpoints: Endpoints) -> None:
        self.config = config
        self.endpoints = endpoints
        self.procs: dict[str, subprocess.Popen] = {}
        self.ready_info: dict[str, dict[str, str]] = {}
        self.failure: str | None = None
        self._stopping = False
        self._zmq = zmq.Context.instance()
        self._control = self._zmq.socket(zmq.PULL)
        self._control.setsockopt(zmq.LINGER, 0)
        self._control.bind(endpoints.control)
        self._decoder = msgspec.msgpack.Decoder(ControlMessage)
        self._reports: dict[str, str] = {}

    def start(self, timeout: float = 300.0) -> None:
        # Fresh interpreters (`python -m engine.runtime.process_entry`), not multiprocessing: the
        # caller's __main__ is never re-imported, so scripts need no `if __name__` guard.
        b64 = lambda data: base64.b64encode(data).decode()
        cfg, eps = b64(self.config.encode()), b64(msgspec.msgpack.encode(self.endpoints))
        # Node 0 (the only one, usually) runs the tokenizer and scheduler; every node its ranks.
        children = ([("tokenizer", TOKENIZER, 0), ("scheduler", SCHEDULER, 0)]
                    if self.config.node_rank == 0 else [])
        children += [(f"worker{r}", WORKER, r) for r in self.config.local_ranks()]
        for name, target, rank in children:
            argv = child_argv(name, target, cfg, eps, str(rank), str(os.getpid()))
            self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ready_info) < len(self.procs):
            if time.monotonic() > deadline:
                missing = sorted(set(self.procs) - set(self.ready_info))
                raise EngineStartupError(f"engine start timed out waiting for {missing}")
            if self._control.poll(100):
                msg = self._decoder.decode(self._control.recv())
                if isinstance(msg, ProcessReady):
                    self.ready_info[msg.name] = msg.info
                else:
                    raise EngineStartupError(f"{msg.name} failed to start: {msg.error}")
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    why = self._drain_reports().get(name, f"exit code {proc.returncode}")
                    raise EngineStartupError(f"{name} died during start-up: {why}")

    def _drain_reports(self) -> dict[str, str]:
        while self._control.poll(0):
            msg = self._decoder.decode(self._control.recv())
            if isinstance(msg, ProcessFailed):
                self._reports[msg.name] = msg.error
        return self._reports

    def supervise(self, on_failure: Callable[[str], None]) -> None:
        """Watch the children in a daemon thread; call on_failure(reason) if one dies."""

        def watch() -> None:
            while not self._stopping:
                dead = [name for name, p in self.procs.items() if p.poll() is not None]
                if dead:
                    break
                time.sleep(0.1)
            if self._stopping:
                return
            time.sleep(0.2)  # give a dying child's failure report time to arrive
            reports = self._drain_reports()
            parts = []
            for name in dead:
                code = self.procs[name].returncode
                parts.append(f"{name} exited (code {code})" + (
                    f": {reports[name]}" if name in reports else ""))
            self.failure = "; ".join(parts)
            log.error("engine process died: %s; stopping the others", self.failure)
            on_failure(self.failure)
            self.shutdown()

        threading.Thread(target=watch, name="deepinfer-supervisor", daemon=True).start()

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs.values())

    def shutdown(self, timeout: float = 3.0) -> None:
        self._stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(1.0)
        self._control.close(0)
        self.endpoints.remove()
