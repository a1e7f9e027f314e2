"""Run the router (`deepinfer router`), or local servers and the router in one command:
N replicas (`deepinfer serve --data-parallel-size N`) or N prefill and M decode servers
(`deepinfer serve --prefill-servers N --decode-servers M`)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import uvicorn

from deepinfer.engine.config import KVEventsConfig
from deepinfer.frontend.router.app import Router, build_router_app
from deepinfer.frontend.router.pd import PDRouter
from deepinfer.frontend.router.policy import Policy
from deepinfer.frontend.server.origin_checks import OriginPolicy

log = logging.getLogger("deepinfer.router")


def _run(router: Router, host: str, port: int, log_level: str,
         origins: OriginPolicy | None) -> int:
    """`origins`: the Host and Origin checks a server's edge makes (None: the defaults for
    `host`)."""
    origins = origins or OriginPolicy.create(host)
    uvicorn.run(build_router_app(router, origins), host=host, port=port, log_level=log_level,
                access_log=False)
    return 0


def run_router(urls: list[str], host: str, port: int, policy: Policy,
               health_interval: float = 1.0, log_level: str = "info",
               api_key: str | None = None,
               kv_events: tuple[KVEventsConfig, str] | None = None,
               origins: OriginPolicy | None = None) -> int:
    """`kv_events`: (the replicas' --kv-events-config, the model directory to tokenize with):
    place by the blocks their events say they cache."""
    log.info("routing %s over %d replicas: %s", policy.name, len(urls), ", ".join(urls))
    events = None
    if kv_events is not None:
        from deepinfer.frontend.router.kv_events import KVEventRouting

        events = KVEventRouting(urls, *kv_events)
        log.info("following KV events: %s",
                 ", ".join(s.endpoint for s in events.follower.sources))
    return _run(Router(urls, policy, health_interval, api_key, events), host, port, log_level,
                origins)


def run_pd_router(prefill_urls: list[str], decode_urls: list[str], host: str, port: int,
                  policy: Policy, health_interval: float = 1.0, log_level: str = "info",
                  api_key: str | None = None, origins: OriginPolicy | None = None) -> int:
    log.info("prefill on %s (%s), decode on %s (least load)", ", ".join(prefill_urls),
             policy.name, ", ".join(decode_urls))
    router = PDRouter(prefill_urls, decode_urls, policy, health_interval, api_key)
    return _run(router, host, port, log_level, origins)


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


def threads_each(worker_threads: int | None, servers: int) -> int:
    """Intra-op threads per local server: as given, or the cores shared out among them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return worker_threads or max(1, (cores or 1) // servers)


@contextlib.contextmanager
def local_servers(serve_args: list[list[str]], api_key: str | None,
                  start_timeout: float) -> Iterator[list[str]]:
    """`deepinfer serve *args` for each entry of `serve_args`, each on a free local port; yields
    their URLs once every one is healthy, and stops them when the block exits."""
    procs, urls = [], []
    try:
        for args in serve_args:
            p = free_port()
            argv = [sys.executable, "-m", "deepinfer", "serve", *args,
                    "--host", "127.0.0.1", "--port", str(p)]
            # The key reaches the servers through their environment, not their argv.
            env = dict(os.environ, DEEPINFER_API_KEY=api_key) if api_key else None
            procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env))
            urls.append(f"http://127.0.0.1:{p}")
        for url in urls:
            _wait_healthy(url, procs, start_timeout)
        yield urls
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def serve_data_parallel(replica_args: list[str], size: int, host: str, port: int,
                        policy: Policy, worker_threads: int | None,
                        api_key: str | None = None, start_timeout: float = 600.0,
                        kv_events: tuple[KVEventsConfig, str] | None = None,
                        origins: OriginPolicy | None = None) -> int:
    """Start `size` replicas (`deepinfer serve` with `replica_args`, each on a free local
    port), wait until each is healthy, then route on host:port until a signal; the replicas
    stop with the router. `kv_events` (the replicas' --kv-events-config, the model directory):
    replica i publishes on its ports plus i, and the router places by those events."""
    args = [*replica_args, "--worker-threads", str(threads_each(worker_threads, size))]
    argvs = [args] * size
    if kv_events is not None:
        argvs = [[*args, "--data-parallel-rank", str(i)] for i in range(size)]
    with local_servers(argvs, api_key, start_timeout) as urls:
        return run_router(urls, host, port, policy, api_key=api_key, kv_events=kv_events,
                          origins=origins)


def serve_disaggregated(server_args: list[str], prefill: int, decode: int, host: str,
                        port: int, policy: Policy, worker_threads: int | None,
                        api_key: str | None = None, start_timeout: float = 600.0,
                        origins: OriginPolicy | None = None) -> int:
    """Start `prefill` prefill and `decode` decode servers (`deepinfer serve` with
    `server_args`, which must not set --disaggregation-mode: each gets its role here), wait
    until each is healthy, then run the prefill/decode router on host:port until a signal;
    the servers stop with it."""
    threads = ["--worker-threads", str(threads_each(worker_threads, prefill + decode))]
    roles = ["prefill"] * prefill + ["decode"] * decode
    argvs = [[*server_args, *threads, "--disaggregation-mode", role] for role in roles]
    with local_servers(argvs, api_key, start_timeout) as urls:
        return run_pd_router(urls[:prefill], urls[prefill:], host, port, policy,
                             api_key=api_key, origins=origins)
