"""ZeroMQ endpoints of one engine instance, all ipc:// sockets in a private 0700 temp dir."""

from __future__ import annotations

import shutil
import tempfile

import msgspec
import zmq


class Endpoints(msgspec.Struct, frozen=True):
    root: str
    client_in: str  # tokenizer -> client (RequestOutput batches)
    tokenizer_in: str  # client and scheduler -> tokenizer
    scheduler_in: str  # tokenizer and worker rank 0 -> scheduler
    control: str  # children -> launcher (ready / failed)
    workers_in: tuple[str, ...]  # scheduler -> each worker rank
    dist_init: str = ""  # the worker ranks' torch.distributed rendezvous

    @classmethod
    def create(cls, num_workers: int, dist_address: tuple[str, int] | None = None
               ) -> Endpoints:
        """One host: ipc sockets and a file rendezvous in a private directory. Several hosts
        (`dist_address`, node 0's host and port): the torch.distributed rendezvous there, and
        each rank's plans on the ports after it (tcp, the scheduler binds)."""
        # mkdtemp creates the directory with mode 0700: only this user can reach the sockets.
        root = tempfile.mkdtemp(prefix="deepinfer-")
        ep = lambda name: f"ipc://{root}/{name}"
        workers = tuple(ep(f"worker{r}") for r in range(num_workers))
        dist = f"file://{root}/torch-distributed"
        if dist_address is not None:
            host, port = dist_address
            workers = tuple(f"tcp://{host}:{port + 1 + r}" for r in range(num_workers))
            dist = f"tcp://{host}:{port}"
        return cls(
            root=root,
            client_in=ep("client"),
            tokenizer_in=ep("tokenizer"),
            scheduler_in=ep("scheduler"),
            control=ep("control"),
            workers_in=workers,
            dist_init=dist,
        )

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def push(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def pull(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    return sock


def plan_sender(ctx: zmq.Context, addr: str) -> zmq.Socket:
    """The scheduler's socket to one worker rank. Over tcp (ranks on other hosts) the scheduler
    binds, on every interface, so the ranks need only node 0's address."""
    if not addr.startswith("tcp://"):
        return push(ctx, addr)
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://*:{addr.rsplit(':', 1)[1]}")
    return sock


def plan_receiver(ctx: zmq.Context, addr: str) -> zmq.Socket:
    """A worker rank's socket for its plans (the counterpart of `plan_sender`)."""
    if not addr.startswith("tcp://"):
        return pull(ctx, addr)
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock
