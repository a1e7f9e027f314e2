from __future__ import annotations

import msgspec
import numpy as np

from deepinfer.engine.protocol import (
    ChatMessage,
    GenerateRequest,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    TokenizerInbound,
    WorkerInbound,
    pack_ids,
    unpack_ids,
)


def test_token_ids_travel_as_raw_int32():
    ids = np.arange(1000, dtype=np.int32)
    data = pack_ids(ids)
    assert isinstance(data, bytes) and len(data) == 4000
    assert unpack_ids(data).tolist() == ids.tolist()


def test_round_trip_through_tagged_unions():
    enc = msgspec.msgpack.Encoder()
    req = GenerateRequest("r1", SamplingParams(max_tokens=5, stop=["\n"], seed=3, logprobs=2),
                          messages=[ChatMessage("user", "hi")])
    assert msgspec.msgpack.Decoder(TokenizerInbound).decode(enc.encode(req)) == req
    plan = StepPlan(4, [ScheduledSeq("r1", pack_ids([1, 2]), 0, [pack_ids([9])], True)],
                    finished=["r0"])
    back = msgspec.msgpack.Decoder(WorkerInbound).decode(enc.encode(plan))
    assert back == plan and unpack_ids(back.seqs[0].token_ids).tolist() == [1, 2]

