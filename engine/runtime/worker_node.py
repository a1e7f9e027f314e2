"""A node that only runs worker ranks (`deepinfer serve --nnodes N --node-rank R`, R > 0).

Node 0 runs the API server, tokenizer, scheduler and its own ranks; every other node starts its
ranks here and supervises them. They join node 0's torch.distributed group and take their plans
from node 0's scheduler over tcp; when node 0 stops, its scheduler tells every rank to exit, and
this node exits with them.
"""

from __future__ import annotations

import logging
import signal
import threading

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.runtime.ipc import Endpoints
from deepinfer.engine.runtime.launcher import Launcher

log = logging.getLogger("deepinfer.node")


def run_worker_node(config: EngineConfig) -> int:
    endpoints = Endpoints.create(config.tensor_parallel_size, config.dist_address())
    launcher = Launcher(config, endpoints)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    ranks = list(config.local_ranks())
    log.info("node %d: starting ranks %s; node 0 at %s", config.node_rank, ranks,
             config.dist_address())
    launcher.start(timeout=1800.0)  # the ranks wait for node 0 to join the group
    log.info("node %d: ranks %s ready", config.node_rank, ranks)
    launcher.supervise(lambda reason: done.set())
    done.wait()
    clean = launcher.failure is None or all(
        p.returncode == 0 for p in launcher.procs.values() if p.poll() is not None)
    launcher.shutdown()
    return 0 if clean else 1
