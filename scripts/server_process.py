"""Processes for benchmark scripts: start `deepinfer serve` and wait until it is healthy; find an
engine's processes and their resident memory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: list[str], timeout: float = 600.0,
                 command: str = "serve") -> tuple[subprocess.Popen, str]:
    """`deepinfer serve *serve_args` (or another `command`: router) on a free local port, in its
    own process group (stop it with os.killpg(proc.pid, SIGTERM)); returns the process and its
    base URL once healthy."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "frontend.cli", command, *serve_args, "--port", str(port),
         "--log-level", "warning"], cwd=REPO, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"deepinfer {command} {' '.join(serve_args)} did not start")


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM a server started by `start_server` (its whole process group), SIGKILL after
    `timeout` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def descendants(pid: int) -> dict[int, str]:
    """Live processes below `pid` (itself included): pid -> a short name from its argv."""
    parents, names = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
        names[int(entry.name)] = next(
            (a.decode() for a in argv if a in (b"tokenizer", b"scheduler")
             or a.startswith(b"worker")), "server")
    found, frontier = {pid: names.get(pid, "server")}, [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in found:
                found[child] = names.get(child, "?")
                frontier.append(child)
    return found


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
