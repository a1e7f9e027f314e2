"""Block identities: the base model's ids hash as int32 (digests unchanged for its blocks), a
LoRA adapter's salted ids as int64, so no tier can hand one adapter's KV to another."""

from __future__ import annotations

import numpy as np

from deepinfer.engine.kvcache.block_hash import block_digest, chain, token_bytes
from deepinfer.engine.kvcache.connectors.host_tier import prefix_digest

KEY = b"k" * 32
TOKENS = np.array([5, 6, 7, 8], dtype=np.int64)


def salted(salt: int) -> np.ndarray:
    return TOKENS + (salt << 32)


def test_base_ids_hash_as_int32():
    assert token_bytes(TOKENS) == TOKENS.astype("<i4").tobytes()
    assert token_bytes([]) == b""


def test_each_adapters_blocks_have_their_own_identity():
    digests = {block_digest(None, t, KEY) for t in (TOKENS, salted(1), salted(2))}
    assert len(digests) == 3
    assert len({prefix_digest(t) for t in (TOKENS, salted(1), salted(2))}) == 3
    # a chain over salted ids is the chain of its blocks' salted digests
    both = np.concatenate([salted(1), salted(1)])
    first = block_digest(None, salted(1), KEY)
    assert chain(both, 4, KEY) == [first, block_digest(first, salted(1), KEY)]
