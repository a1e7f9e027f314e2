"""Start `deepinfer serve` (or `deepinfer router`) as a real subprocess and wait until it is
healthy; find a server's processes and their resident memory. The one helper that benchmark
scripts and tests start servers with."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 all free now (a server whose ranks take port + i)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free port range")


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout: float) -> bool:
    """Poll /health until it answers 200 (True), `proc` exits or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


class ServerProcess:
    """`deepinfer <command> [--model MODEL] *args --port P` on a free local port, in its own
    session (teardown reaches its whole process group, and only it), its output in a temporary
    log; returns once /health answers 200, raising with the log's end otherwise."""

    def __init__(self, model: str | Path | None, *args: str, command: str = "serve",
                 timeout: float = 180.0, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"deepinfer-{command}-",
                                               suffix=".log")
        model_args = ["--model", str(model)] if model is not None else []
        cmd = [sys.executable, "-m", "deepinfer", command, *model_args, *args,
               "--port", str(self.port)]
        # Not from the checkout: its root on sys.path would put our kernels/ folder before
        # Hugging Face's `kernels` package (the installed `deepinfer` needs no path).
        self.proc = subprocess.Popen(
            cmd, cwd=tempfile.gettempdir(), stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {})))
        if wait_healthy(self.base_url, self.proc, timeout):
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"deepinfer {command} exited ({self.proc.returncode}):\n"
                               f"{self.output()}")
        self.stop()
        raise RuntimeError(f"deepinfer {command} not healthy after {timeout}s:\n{self.output()}")

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


def descendants(pid: int) -> dict[int, str]:
    """Live processes below `pid` (from /proc; no psutil needed): pid -> a short name from its
    argv (tokenizer, scheduler, worker<r>, or "?")."""
    parents, names = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == "Z":
            continue
        parents[int(entry.name)] = int(fields[1])
        names[int(entry.name)] = next(
            (a.decode() for a in argv if a in (b"tokenizer", b"scheduler")
             or a.startswith(b"worker")), "?")
    found, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in found:
                found[child] = names[child]
                frontier.append(child)
    return found


def disaggregation_roles(pid: int) -> dict[str, tuple[int, str]]:
    """The prefill and decode servers a `serve --prefill-servers N --decode-servers M` started
    below `pid`: role -> (pid, url) (one per role: the last found)."""
    roles = {}
    for child in descendants(pid):
        try:
            argv = open(f"/proc/{child}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"--disaggregation-mode" in argv and b"serve" in argv:
            role = argv[argv.index(b"--disaggregation-mode") + 1].decode()
            port = argv[argv.index(b"--port") + 1].decode()
            roles[role] = (child, f"http://127.0.0.1:{port}")
    return roles


def process_named(pid: int, name: str) -> int:
    """The pid of the process below `pid` named `name` (see `descendants`), e.g. worker0."""
    found = [p for p, n in descendants(pid).items() if n == name]
    if len(found) != 1:
        raise LookupError(f"{len(found)} processes named {name!r} below {pid}")
    return found[0]


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
