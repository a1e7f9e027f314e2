"""Run the router (`deepinfer router`), or N replicas and the router in one command
(`deepinfer serve --data-parallel-size N`)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import uvicorn

from frontend.router.app import Router, build_router_app
from frontend.router.policy import Policy

log = logging.getLogger("deepinfer.router")


def run_router(urls: list[str], host: str, port: int, policy: Policy,
               health_interval: float = 1.0, log_level: str = "info",
               api_key: str | None = None) -> int:
    app = build_router_app(Router(urls, policy, health_interval, api_key))
    log.info("routing %s over %d replicas: %s", policy.name, len(urls), ", ".join(urls))
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a replica exited during start-up")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"replica {url} was not healthy after {timeout:.0f} s")


def serve_data_parallel(replica_args: list[str], size: int, host: str, port: int,
                        policy: Policy, worker_threads: int | None,
                        api_key: str | None = None, start_timeout: float = 600.0) -> int:
    """Start `size` replicas (`deepinfer serve` with `replica_args`, each on a free local
    port), wait until each is healthy, then route on host:port until a signal; the replicas
    stop with the router."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = worker_threads or max(1, (cores or 1) // size)  # the replicas share the cores
    procs, urls = [], []
    try:
        for _ in range(size):
            p = free_port()
            argv = [sys.executable, "-m", "frontend.cli", "serve", *replica_args,
                    "--host", "127.0.0.1", "--port", str(p), "--worker-threads", str(threads)]
            # The key reaches the replicas through their environment, not their argv.
            env = dict(os.environ, DEEPINFER_API_KEY=api_key) if api_key else None
            procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env))
            urls.append(f"http://127.0.0.1:{p}")
        for url in urls:
            _wait_healthy(url, procs, start_timeout)
        return run_router(urls, host, port, policy, api_key=api_key)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
