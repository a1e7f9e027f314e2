"""engine/trust.py: the router's proof, the prefill server's signature and the CURVE keys, each
refused when anything it covers changes."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from deepinfer.engine.protocol import KVTransferParams
from deepinfer.engine.trust import (
    ROUTER_PROOF_SKEW,
    TrustError,
    check_params,
    check_router_proof,
    curve_keys,
    prompt_digest,
    router_proof,
    sign_params,
)

SECRET = b"cluster"


def test_a_router_proof_covers_the_path_the_body_and_the_time():
    proof = router_proof(SECRET, "/v1/completions", b"{}", now=1000)
    assert check_router_proof(SECRET, "/v1/completions", b"{}", proof, now=1000)
    assert check_router_proof(SECRET, "/v1/completions", b"{}", proof,
                              now=1000 + ROUTER_PROOF_SKEW)
    assert not check_router_proof(SECRET, "/v1/completions", b"{}", proof,
                                  now=1001 + ROUTER_PROOF_SKEW)  # a replay, too late
    assert not check_router_proof(SECRET, "/v1/chat/completions", b"{}", proof, now=1000)
    assert not check_router_proof(SECRET, "/v1/completions", b"{ }", proof, now=1000)
    assert not check_router_proof(b"other", "/v1/completions", b"{}", proof, now=1000)
    assert not check_router_proof(None, "/v1/completions", b"{}", proof, now=1000)
    for junk in (None, "", "x", "1000.zz", "abc.00", proof.replace(".", "")):
        assert not check_router_proof(SECRET, "/v1/completions", b"{}", junk, now=1000)


def params() -> KVTransferParams:
    return KVTransferParams(do_remote_prefill=True, transfer_id="t", addresses=["tcp://h:1#n"],
                            block_ids=[[0, 1], [-1, 2]], num_tokens=20, block_size=16,
                            first_token=5, prompt_digest=prompt_digest(np.arange(20)))


def test_signed_params_survive_json_and_nothing_in_them_can_change():
    signed = sign_params(SECRET, params())
    back = msgspec.json.decode(msgspec.json.encode(signed), type=KVTransferParams)
    check_params(SECRET, back)  # what a decode server gets through the router
    for change in ({"addresses": ["tcp://evil:1#n"]}, {"block_ids": [[0, 1], [3, 2]]},
                   {"first_token": 6}, {"num_tokens": 21}, {"transfer_id": "u"},
                   {"prompt_digest": prompt_digest(np.arange(1, 21))}):
        with pytest.raises(TrustError, match="signature"):
            check_params(SECRET, msgspec.structs.replace(back, **change))
    with pytest.raises(TrustError):
        check_params(b"other", back)
    with pytest.raises(TrustError, match="no cluster secret"):
        check_params(None, back)
    with pytest.raises(TrustError):
        check_params(SECRET, msgspec.structs.replace(back, signature="not hex"))


def test_curve_keys_are_the_same_for_one_secret_and_differ_between_secrets():
    keys = curve_keys(SECRET)
    assert keys == curve_keys(SECRET) and len(set(keys)) == 4
    assert set(keys).isdisjoint(curve_keys(b"other"))
