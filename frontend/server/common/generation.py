"""One HTTP request's engine work: n engine requests run concurrently, merged into one stream.

A `Generation` holds admission slots (the bounded queue), records metrics, and on `close()`
cancels whatever still runs: cancelling the task that iterates `client.generate` makes the engine
client abort the request in every engine process.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator

import msgspec

from deepinfer.engine.protocol import (
    FinishReason,
    GenerateRequest,
    KVTransferParams,
    PositionLogprobs,
    PromptLogprob,
    RequestOutput,
    SamplingParams,
)
from deepinfer.frontend.server.common.usage import PromptTokensDetails, Usage
from deepinfer.frontend.server.errors import APIError, server_error
from deepinfer.frontend.server.state import ServerState

_DONE = object()
_INT64_HALF = 1 << 63


def engine_error(state: ServerState, message: str, param: str | None) -> APIError:
    """An error output of the engine: the engine's fault (503) or the request's (400)."""
    if state.engine_dead or message.startswith(("engine failed", "KV transfer failed")):
        return server_error(message)
    code = "context_length_exceeded" if "context length" in message else None
    return APIError(message, param=param, code=code)


class Generation:
    def __init__(
        self, state: ServerState, endpoint: str, requests: list[GenerateRequest],
        param: str | None,
    ) -> None:
        self.state = state
        self.endpoint = endpoint
        self.param = param
        self.n = len(requests)
        self.adapters = [r.params.lora for r in requests]  # LoRA adapter per request, or None
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.prompt_tokens = [0] * self.n
        self.completion_tokens = [0] * self.n
        self.cached_tokens = [0] * self.n
        state.admit(self.n)  # raises 503 when the queue is full
        self._closed = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._early: deque[tuple[int, RequestOutput]] = deque()
        self._live = self.n
        client = state.client
        self._tasks = [
            asyncio.create_task(self._pump(i, client, r)) for i, r in enumerate(requests)
        ]

    async def _pump(self, i: int, client, request: GenerateRequest) -> None:
        limit = self.state.max_buffered_outputs
        try:
            async for out in client.generate(request):
                if self._queue.qsize() >= limit:
                    # The client reads slower than the engine writes: leaving the loop aborts
                    # the engine request (client.generate's cleanup); memory stays bounded.
                    self.state.metrics.slow_readers.inc()
                    self._queue.put_nowait((i, RequestOutput(
                        request.request_id, finish_reason=FinishReason.ERROR,
                        error=f"aborted: the client read the stream too slowly ({limit} "
                              "outputs waiting)")))
                    return
                self._queue.put_nowait((i, out))
        except Exception as exc:  # EngineDeadError and the like
            self._queue.put_nowait((i, exc))
        finally:
            self._queue.put_nowait((i, _DONE))

    async def _next(self) -> tuple[int, RequestOutput] | None:
        while self._live:
            i, item = await self._queue.get()
            if item is _DONE:
                self._live -= 1
                continue
            if isinstance(item, Exception):
                raise server_error(f"engine unavailable: {item}")
            self._account(i, item)
            return i, item
        return None

    def _account(self, i: int, out: RequestOutput) -> None:
        if out.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self.state.metrics.ttft.observe(self.first_token_at - self.started)
        self.prompt_tokens[i] = out.prompt_tokens or self.prompt_tokens[i]
        self.completion_tokens[i] = max(self.completion_tokens[i], out.completion_tokens)
        self.cached_tokens[i] = max(self.cached_tokens[i], out.cached_tokens)
        if out.finish_reason is not None and not out.error:
            self.state.metrics.replayed.observe(out.replayed_tokens)

    def usage(self, choices_per_prompt: int) -> Usage:
        """OpenAI usage: each prompt counted once however many choices it has."""
        firsts = range(0, self.n, choices_per_prompt)
        prompt = sum(self.prompt_tokens[i] for i in firsts)
        completion = sum(self.completion_tokens)
        cached = sum(self.cached_tokens[i] for i in firsts)
        return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached),
                     prompt_cache_hit_tokens=cached, prompt_cache_miss_tokens=prompt - cached)

    async def first_outputs(self) -> list[RequestOutput]:
        """Wait for every request's first output (prompt accepted or rejected).

        Raises the first rejection as an APIError, so a bad prompt is a 400 even when streaming.
        """
        firsts: list[RequestOutput | None] = [None] * self.n
        while any(f is None for f in firsts):
            item = await self._next()
            if item is None:
                raise server_error("the engine ended a request without an answer")
            i, out = item
            if firsts[i] is None:
                firsts[i] = out
                if out.finish_reason == FinishReason.ERROR:
                    raise engine_error(self.state, out.error or "request rejected", self.param)
                if out.text or out.token_ids or out.finish_reason is not None:
                    self._early.append((i, _without_prompt(out)))
            else:
                self._early.append((i, out))
        return firsts  # type: ignore[return-value]

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._early:
            yield self._early.popleft()
        while (item := await self._next()) is not None:
            yield item

    async def close(self) -> None:
        """Abort what still runs (idempotent) and record the request's metrics."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.state.release(self.n)
        m = self.state.metrics
        m.e2e.observe(time.monotonic() - self.started)
        m.prompt_tokens.inc(sum(self.prompt_tokens))
        m.generation_tokens.inc(sum(self.completion_tokens))
        for adapter, prompt, completion in zip(self.adapters, self.prompt_tokens,
                                               self.completion_tokens):
            if adapter is not None:
                m.lora_requests.labels(adapter).inc()
                m.lora_prompt_tokens.labels(adapter).inc(prompt)
                m.lora_generation_tokens.labels(adapter).inc(completion)

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class ChoiceResult:
    """One choice of a non-streaming response, accumulated from its outputs."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[PositionLogprobs] = []
        self.prompt_logprobs: list[PromptLogprob] = []  # when asked: one per prompt token
        self.finish_reason: str | None = None
        self.kv_transfer: KVTransferParams | None = None  # held for a decode server


async def collect(gen: Generation) -> list[ChoiceResult]:
    """Run every request to its end; an engine failure on the way is a 5xx."""
    results = [ChoiceResult() for _ in range(gen.n)]
    async with gen:
        async for i, out in gen:
            if out.finish_reason == FinishReason.ERROR:
                raise engine_error(gen.state, out.error or "request failed", gen.param)
            r = results[i]
            r.text.append(out.text)
            r.logprobs.extend(out.logprobs)
            r.prompt_logprobs = out.prompt_logprobs or r.prompt_logprobs
            if out.finish_reason is not None:
                r.finish_reason = FinishReason(out.finish_reason).openai()
                r.kv_transfer = out.kv_transfer
    return results


def seeded(params: SamplingParams, i: int) -> SamplingParams:
    """The i-th choice's params: a given seed becomes seed + i so choices differ.

    The sum wraps around inside the signed 64-bit range, the range the API accepts for a seed,
    so that a seed near its top still gives n distinct seeds the engine can carry.
    """
    if params.seed is None or i == 0:
        return params
    seed = (params.seed + i + _INT64_HALF) % (2 * _INT64_HALF) - _INT64_HALF
    return msgspec.structs.replace(params, seed=seed)


def _without_prompt(out: RequestOutput) -> RequestOutput:
    return msgspec.structs.replace(out, prompt_text=None)
