"""Fan-out of n engine requests: merging, admission slots, abort on close."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.engine.protocol import FinishReason, GenerateRequest, SamplingParams
from deepinfer.frontend.server.common.generation import Generation, collect, seeded
from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.state import ServerState
from tests.frontend.server.fake_engine import FakeEngineClient


def _state(engine: FakeEngineClient, max_pending: int = 8) -> ServerState:
    state = ServerState(max_pending)
    state.client = engine
    engine.started = True
    return state


def _requests(n: int, max_tokens: int, prompt: str = "a b c") -> list[GenerateRequest]:
    params = SamplingParams(max_tokens=max_tokens, seed=3)
    return [GenerateRequest(f"r-{i}", seeded(params, i), prompt=prompt) for i in range(n)]


def test_seeded():
    assert [seeded(SamplingParams(seed=5), i).seed for i in range(3)] == [5, 6, 7]
    assert seeded(SamplingParams(), 2).seed is None


@pytest.mark.parametrize("seed", [2**63 - 1, 2**63 - 5, -(2**63), -1])
def test_seeded_choices_stay_signed_64_bit_and_distinct(seed):
    seeds = [seeded(SamplingParams(seed=seed), i).seed for i in range(16)]
    assert all(-(2**63) <= s < 2**63 for s in seeds)
    assert len(set(seeds)) == 16
    assert seeds == [seeded(SamplingParams(seed=seed), i).seed for i in range(16)]


def test_seeded_wraps_around_at_the_top():
    top = 2**63 - 1
    assert [seeded(SamplingParams(seed=top), i).seed for i in range(3)] == [
        top, -(2**63), -(2**63) + 1]


def test_collect_merges_choices_and_releases_slots():
    async def main():
        engine = FakeEngineClient(delay=0.001)
        state = _state(engine)
        gen = Generation(state, "test", _requests(3, 4), "prompt")
        assert state.pending == 3
        firsts = await gen.first_outputs()
        assert [f.prompt_text for f in firsts] == ["a b c"] * 3
        results = await collect(gen)
        assert ["".join(r.text) for r in results] == [" w0 w1 w2 w3"] * 3
        assert state.pending == 0
        usage = gen.usage(3)
        assert (usage.prompt_tokens, usage.completion_tokens) == (3, 12)
        assert engine.aborted == []

    asyncio.run(main())


def test_close_mid_way_aborts_every_request():
    async def main():
        engine = FakeEngineClient(delay=0.01)
        state = _state(engine)
        gen = Generation(state, "test", _requests(2, 50), "prompt")
        await gen.first_outputs()
        async for _ in gen:
            break
        await gen.close()
        assert sorted(engine.aborted) == ["r-0", "r-1"]
        assert state.pending == 0

    asyncio.run(main())


def test_rejected_prompt_raises_400():
    async def main():
        engine = FakeEngineClient()
        state = _state(engine)
        gen = Generation(state, "test", _requests(2, 5, prompt=""), "prompt")
        with pytest.raises(APIError) as exc:
            await gen.first_outputs()
        await gen.close()
        assert exc.value.status == 400 and exc.value.param == "prompt"
        assert state.pending == 0

    asyncio.run(main())


def test_a_reader_that_falls_behind_is_aborted_with_its_buffer_bounded():
    async def main():
        engine = FakeEngineClient(context_len=1000)
        state = _state(engine)
        state.max_buffered_outputs = 8
        gen = Generation(state, "test", _requests(1, 500), "prompt")
        await gen.first_outputs()
        for _ in range(50):  # the client reads nothing while the engine runs ahead
            await asyncio.sleep(0)
        assert engine.aborted == ["r-0"]  # the engine request stopped, not just the stream
        assert gen._queue.qsize() <= 8 + 2  # its outputs, the error, the end marker
        outputs = [out async for _, out in gen]
        assert len(outputs) <= 9 and outputs[-1].finish_reason == FinishReason.ERROR
        assert "too slowly" in outputs[-1].error
        await gen.close()
        assert state.pending == 0

    asyncio.run(main())
