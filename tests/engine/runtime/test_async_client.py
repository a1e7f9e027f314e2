"""The API server's engine client against a real engine: when its output reader stops (here
its socket closed under it, as any unexpected end would), the engine is failed loudly (the
request in flight gets its error, the client turns unhealthy, the server's failure callback
runs) instead of the server staying healthy and never answering again."""

from __future__ import annotations

import asyncio
import os
import signal

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.protocol import FinishReason, GenerateRequest, SamplingParams
from deepinfer.engine.runtime.async_client import AsyncEngineClient


async def _reader_stops_midway(client: AsyncEngineClient, failures: list[str]) -> None:
    await client.start(on_failure=failures.append)
    assert client.healthy
    worker = client.launcher.procs["worker0"].pid
    os.kill(worker, signal.SIGSTOP)  # the request cannot finish, however fast the machine
    try:
        outputs = client.generate(GenerateRequest(
            "r1", SamplingParams(max_tokens=8, ignore_eos=True), prompt="hello"))
        pending = asyncio.ensure_future(outputs.__anext__())
        while "r1" not in client._queues:  # sent: the request is in flight
            await asyncio.sleep(0.01)
        client._in.close()  # the reader's recv ends
        out = await asyncio.wait_for(pending, 30)
        while out.finish_reason is None:  # the prompt's first output may have come before
            out = await asyncio.wait_for(outputs.__anext__(), 30)
        assert out.finish_reason == FinishReason.ERROR
        assert "output reader stopped" in out.error
        assert not client.healthy
        assert failures and "output reader stopped" in failures[0]
        await outputs.aclose()
    finally:
        os.kill(worker, signal.SIGCONT)


def test_a_stopped_output_reader_fails_the_engine_loudly(tiny_model_dir, caplog):
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32, worker_threads=1)
    client = AsyncEngineClient(config)
    failures: list[str] = []

    async def run() -> None:
        try:
            await _reader_stops_midway(client, failures)
        finally:
            await client.shutdown()

    asyncio.run(run())
    assert "the engine output reader stopped" in caplog.text
