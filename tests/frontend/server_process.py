"""Start `deepinfer serve` as a real subprocess for end-to-end tests, and clean up after it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout: float) -> bool:
    """Poll /health until it answers 200 (True), `proc` exits or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def descendants(pid: int) -> list[int]:
    """Pids of every live process below `pid` (from /proc; no psutil needed)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


class ServerProcess:
    def __init__(self, model_dir: Path, *extra: str, timeout: float = 180.0,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="deepinfer-server-", suffix=".log")
        cmd = [sys.executable, "-m", "frontend.cli", "serve", "--model", str(model_dir),
               "--port", str(self.port), *extra]
        env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false",
                   **(env or {}))
        # Its own session: teardown can reach the whole group, and only this group.
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        self._wait_healthy(timeout)

    def _wait_healthy(self, timeout: float) -> None:
        if wait_healthy(self.base_url, self.proc, timeout):
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.output()}")
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-6000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Signal the server, wait for it; SIGKILL the group if it hangs. Returns its code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        try:  # anything of ours still around (there should be nothing)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.returncode
