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
    def create(cls, num_workers: int) -> Endpoints:
        # mkdtemp creates the directory with mode 0700: only this user can reach the sockets.
        root = tempfile.mkdtemp(prefix="deepinfer-")
        ep = lambda name: f"ipc://{root}/{name}"
        return cls(
            root=root,
            client_in=ep("client"),
            tokenizer_in=ep("tokenizer"),
            scheduler_in=ep("scheduler"),
            control=ep("control"),
            workers_in=tuple(ep(f"worker{r}") for r in range(num_workers)),
            dist_init=f"file://{root}/torch-distributed",
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
