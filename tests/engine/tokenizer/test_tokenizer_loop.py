"""The tokenizer actor's loop (engine/tokenizer/tokenizer_process.py) over real ZeroMQ sockets:
while a long prompt's text is being tokenized, every stream's tokens still become text."""

from __future__ import annotations

import threading

import msgspec
import pytest
import zmq

from deepinfer.engine.protocol import (
    Abort,
    GenerateRequest,
    OutputBatch,
    SamplingParams,
    TokenBatch,
    TokenDelta,
    TokenizedRequest,
    pack_ids,
)
from deepinfer.engine.tokenizer.tokenizer import Tokenizer
from deepinfer.engine.tokenizer.tokenizer_process import (
    INLINE_PROMPT_CHARS,
    TokenizerLoop,
    TokenizerService,
)

LONG = "word " * (INLINE_PROMPT_CHARS // 5 + 1)


@pytest.fixture()
def sockets():
    ctx = zmq.Context()
    ends = {}
    for name in ("inbound", "client", "scheduler"):
        pull = ctx.socket(zmq.PULL)
        pull.bind(f"inproc://{name}")
        push = ctx.socket(zmq.PUSH)
        push.connect(f"inproc://{name}")
        ends[name] = (push, pull)
    yield ends
    ctx.destroy(linger=0)


class HeldTokenizer(Tokenizer):
    """The default model's tokenizer, whose off-the-loop tokenization waits for `release`."""

    release = threading.Event()

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert self.release.wait(60)
        return super().encode_releasing_gil(text, add_special_tokens)


def _received(sock: zmq.Socket, kind: type) -> list:
    out = []
    while sock.poll(0):
        msg = sock.recv()
        try:
            out.append(msgspec.msgpack.decode(msg, type=kind))
        except msgspec.ValidationError:
            continue
    return out


def test_streams_go_on_while_a_long_prompt_is_tokenized(default_model, sockets):
    """Before, the loop tokenized in place: nothing else moved until a long prompt was done (a
    7 MiB one held every stream for 34 s)."""
    tok = HeldTokenizer(str(default_model))
    HeldTokenizer.release.clear()
    service = TokenizerService(tok, 1 << 20)
    loop = TokenizerLoop(service, sockets["inbound"][1], sockets["client"][0],
                         sockets["scheduler"][0])
    send = sockets["inbound"][0].send
    encode = msgspec.msgpack.encode
    service.tokenize(GenerateRequest("streaming", SamplingParams(), prompt="Hello"))
    send(encode(GenerateRequest("long", SamplingParams(), prompt=LONG)))
    loop.step(wait_ms=1000)
    assert "long" in loop.pending
    send(encode(TokenBatch([TokenDelta("streaming", pack_ids(tok.encode(" world", False)))])))
    loop.step(wait_ms=1000)  # the long prompt's tokens are still being waited for
    batches = _received(sockets["client"][1], OutputBatch)
    assert [o.text for b in batches for o in b.outputs] == [" world"]
    assert _received(sockets["scheduler"][1], TokenizedRequest) == []
    HeldTokenizer.release.set()
    for _ in range(1000):
        loop.step(wait_ms=10)
        if not loop.pending:
            break
    sent = _received(sockets["scheduler"][1], TokenizedRequest)
    assert [r.request_id for r in sent] == ["long"]
    firsts = [o for b in _received(sockets["client"][1], OutputBatch) for o in b.outputs]
    assert [(o.request_id, o.prompt_tokens) for o in firsts] == [("long", len(tok.encode(LONG)))]


def test_a_long_prompt_aborted_while_tokenized_goes_nowhere(default_model, sockets):
    tok = HeldTokenizer(str(default_model))
    HeldTokenizer.release.clear()
    loop = TokenizerLoop(TokenizerService(tok, 1 << 20), sockets["inbound"][1],
                         sockets["client"][0], sockets["scheduler"][0])
    send, encode = sockets["inbound"][0].send, msgspec.msgpack.encode
    send(encode(GenerateRequest("long", SamplingParams(), prompt=LONG)))
    loop.step(wait_ms=1000)
    send(encode(Abort(["long"])))
    loop.step(wait_ms=1000)
    HeldTokenizer.release.set()
    loop.reader.shutdown(wait=True)
    loop.step(wait_ms=10)
    assert _received(sockets["scheduler"][1], TokenizedRequest) == []
    assert "long" not in loop.service.live
    assert _received(sockets["client"][1], OutputBatch) == []
