"""What every child process runs first: signals, logging, parent watchdog, failure report.

A failure the user can fix (ModelConfigError: an unsupported architecture) is logged as one
line and reported to the launcher; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import base64
import importlib
import importlib.util
import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback

import msgspec
import zmq

from deepinfer.engine import envs
from deepinfer.engine.config import EngineConfig, ModelConfigError
from deepinfer.engine.protocol import ProcessFailed, ProcessReady
from deepinfer.engine.runtime.ipc import Endpoints


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=envs.log_level(),
        format=f"%(asctime)s {name} %(levelname)s %(message)s",
        stream=sys.stderr,
        force=True,
    )


def _watch_parent(parent_pid: int, socket_dir: str) -> None:
    # A child whose launcher is gone (even SIGKILLed) must not linger as an orphan, nor leave
    # the socket directory behind.
    while True:
        if os.getppid() != parent_pid:
            shutil.rmtree(socket_dir, ignore_errors=True)
            os._exit(1)
        time.sleep(0.5)


class ChildContext:
    """Handed to a child's main function: its name, config, endpoints and a ready signal."""

    def __init__(self, name: str, config: EngineConfig, endpoints: Endpoints, rank: int) -> None:
        self.name = name
        self.config = config
        self.endpoints = endpoints
        self.rank = rank
        self.zmq = zmq.Context()
        self._control = self.zmq.socket(zmq.PUSH)
        self._control.setsockopt(zmq.LINGER, 2000)
        self._control.connect(endpoints.control)

    def ready(self, **info: str) -> None:
        self._control.send(msgspec.msgpack.encode(ProcessReady(self.name, info)))

    def failed(self, error: str) -> None:
        self._control.send(msgspec.msgpack.encode(ProcessFailed(self.name, error)))


def run_child(
    name: str, target: str, config_bytes: bytes, endpoints_bytes: bytes, rank: int, parent: int
) -> None:
    """Entry point of every child: `target` is "module:function" taking a ChildContext."""
    # Ctrl-C reaches the whole process group; the launcher decides how children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    setup_logging(name)
    config = EngineConfig.decode(config_bytes)
    endpoints = msgspec.msgpack.decode(endpoints_bytes, type=Endpoints)
    threading.Thread(target=_watch_parent, args=(parent, endpoints.root), daemon=True).start()
    ctx = ChildContext(name, config, endpoints, rank)
    try:
        module, func = target.split(":")
        getattr(importlib.import_module(module), func)(ctx)
    except BaseException as exc:  # report why before dying, whatever it was
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        reason = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ModelConfigError):
            logging.getLogger(name).error("%s", reason)  # the user's to fix: no traceback
        else:
            logging.getLogger(name).error("failed:\n%s", traceback.format_exc())
        ctx.failed(reason)
        time.sleep(0.2)  # let the report leave before the socket closes
        os._exit(1)
    # A clean return leaves nothing to do (a worker's connectors finished their writes before
    # it returned), and tearing down an interpreter that holds torch, its thread pools and a
    # ZeroMQ context took ~0.5 s of every engine's stop: leave at once, logs flushed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _name, _target, _cfg, _eps, _rank, _parent = sys.argv[1:7]
    run_child(_name, _target, base64.b64decode(_cfg), base64.b64decode(_eps), int(_rank),
              int(_parent))
