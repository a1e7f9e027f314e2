"""ZeroMQ endpoints of one engine instance, all ipc:// sockets in a private 0700 temp dir (the
worker ranks' plan sockets: tcp:// with CURVE across hosts).

Every socket that receives bounds the size of a message (`bound_message_size`): ZeroMQ reads
the size before the body and drops the connection of a peer that announces more, so nothing
buffers a message past the bound, whoever reaches the socket.
"""

from __future__ import annotations

import hmac
import shutil
import socket
import tempfile

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from deepinfer.engine.trust import curve_keys

# The largest message between the engine's own processes: far above any the engine sends (a
# plan starting 64 sequences with 1M-token prompts holds 256 MiB of ids; a request body is at
# most the API's 8 MiB), so only a broken or hostile peer meets it.
MAX_MESSAGE_BYTES = 1 << 30


def bound_message_size(sock: zmq.Socket, max_bytes: int) -> zmq.Socket:
    """ZMQ_MAXMSGSIZE: a peer that sends a message over `max_bytes` is disconnected and the
    message dropped unread. Set before bind/connect (connections made earlier keep no bound)."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    return sock


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
        each rank's plans on the ports after it (tcp, the scheduler binds; CURVE)."""
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


def pull(ctx: zmq.Context, addr: str, max_bytes: int = MAX_MESSAGE_BYTES) -> zmq.Socket:
    """A process's inbound socket (bound; messages over `max_bytes` are dropped)."""
    sock = bound_message_size(ctx.socket(zmq.PULL), max_bytes)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    return sock


def plan_sender(ctx: zmq.Context, addr: str, secret: bytes | None) -> zmq.Socket:
    """The scheduler's socket to one worker rank. Over tcp (ranks on other hosts) the scheduler
    binds on the host the operator named (--dist-init-addr), and admits only peers that complete
    a CURVE handshake with the cluster's client key (engine/trust.py): PUSH deals plans to
    whoever connects, so a stranger's connection would take plans away from a rank."""
    if not addr.startswith("tcp://"):
        return push(ctx, addr)
    server_public, server_secret, client_public, _ = curve_keys(_required(secret))
    _admit_only(ctx, client_public)
    sock = bound_message_size(ctx.socket(zmq.PUSH), MAX_MESSAGE_BYTES)  # it reads handshakes
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_server = True
    sock.curve_publickey, sock.curve_secretkey = server_public, server_secret
    host, port = addr[len("tcp://"):].rsplit(":", 1)
    sock.bind(f"tcp://{_address_of(host)}:{port}")
    return sock


def plan_receiver(ctx: zmq.Context, addr: str, secret: bytes | None) -> zmq.Socket:
    """A worker rank's socket for its plans (the counterpart of `plan_sender`)."""
    if not addr.startswith("tcp://"):
        return pull(ctx, addr)
    server_public, _, client_public, client_secret = curve_keys(_required(secret))
    sock = bound_message_size(ctx.socket(zmq.PULL), MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_serverkey = server_public
    sock.curve_publickey, sock.curve_secretkey = client_public, client_secret
    sock.connect(addr)
    return sock


def _required(secret: bytes | None) -> bytes:
    if not secret:  # engine/config.py refuses --nnodes > 1 without one: this is a bug
        raise RuntimeError("plan sockets over tcp need the cluster secret")
    return secret


def _address_of(host: str) -> str:
    """An IP address to bind for `host` (a name or an address)."""
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


class _OneKey:
    """ZAP credentials: the cluster's client key, and no other."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.key)


_authenticators: dict[int, ThreadAuthenticator] = {}


def _admit_only(ctx: zmq.Context, client_public: bytes) -> None:
    """Start the context's ZAP handler (once): CURVE peers need `client_public`."""
    if id(ctx) in _authenticators:
        return
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_OneKey(client_public))
    _authenticators[id(ctx)] = auth
