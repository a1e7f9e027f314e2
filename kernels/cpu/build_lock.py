"""One build at a time in a native op's build folder, across processes, and no wait on the dead.

torch's cpp_extension guards a build folder with a `lock` file that it creates (O_EXCL) before
building and removes after (torch/utils/file_baton.py), and a loader that finds it there waits,
silently and with no limit, for it to go. A process killed while it builds (Ctrl-C during the
first start, an OOM kill) leaves it behind, and every later start hung.

So around torch's load we hold a flock on a file of our own in the same folder: the kernel drops
it when its holder dies, however it dies. Holding it means no DeepInfer process is building
there, so a `lock` file still present is stale and is removed. Waiting for a live builder is
logged, and bounded: past the bound the caller gets BuildLockTimeout (and falls back).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("deepinfer.kernels")

OUR_LOCK = "deepinfer.lock"  # flocked while a DeepInfer process builds or loads; never removed
TORCH_LOCK = "lock"  # torch's FileBaton


class BuildLockTimeout(TimeoutError):
    pass


@contextmanager
def build_lock(build_dir: Path, op: str, timeout: float, poll: float = 0.2) -> Iterator[None]:
    """Hold the build folder of native op `op` for this process, waiting at most `timeout`
    seconds for another process's build, with torch's lock file gone if it was stale."""
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / OUR_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, build_dir, op, timeout, poll)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # named by those who wait
        stale = build_dir / TORCH_LOCK
        if stale.exists():
            log.info("removing %s, left by a process that died while it built native op %s",
                     stale, op)
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # and with it the flock


def _acquire(fd: int, build_dir: Path, op: str, timeout: float, poll: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        holder = _holder(fd)
        if not waiting:
            log.info("waiting for another process (%s) to finish building native op %s in %s",
                     holder, op, build_dir)
            waiting = True
        if time.monotonic() >= deadline:
            raise BuildLockTimeout(
                f"gave up after {timeout:.0f} s waiting for another process ({holder}) to "
                f"finish building native op {op} in {build_dir} (it holds "
                f"{build_dir / OUR_LOCK}); stop that process if it is stuck")
        time.sleep(poll)


def _holder(fd: int) -> str:
    pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return f"pid {pid}" if pid else "pid unknown"
