"""Offline API: `LLM(model).generate(prompts, params)` through the same processes as the server."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import threading
from collections.abc import Sequence

import msgspec

from deepinfer.engine import model_store
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.protocol import (
    ChatMessage,
    FinishReason,
    GenerateRequest,
    PositionLogprobs,
    PromptLogprob,
    SamplingParams,
    pack_ids,
    unpack_ids,
)
from deepinfer.engine.runtime.async_client import AsyncEngineClient


class CompletionOutput(msgspec.Struct):
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[PositionLogprobs]
    prompt_tokens: int
    cached_tokens: int
    prompt_logprobs: list[PromptLogprob] = []  # one per prompt token, when asked


def check_params(params: SamplingParams) -> SamplingParams:
    """`params`, or ValueError for settings that cannot work together (as the server answers
    them with a 400)."""
    if params.grammar is not None and params.ignore_eos:
        raise ValueError("ignore_eos cannot be combined with structured output: the grammar "
                         "decides where the output ends")
    if params.prompt_logprobs is not None and params.prompt_logprobs < 0:
        raise ValueError(f"prompt_logprobs must be >= 0, got {params.prompt_logprobs}")
    if params.prompt_logprobs is not None and params.remote_prefill is not None:
        raise ValueError("prompt_logprobs need the prompt computed here, not pulled from a "
                         "prefill server")
    return params


class LLM:
    """Starts an engine (tokenizer, scheduler, workers) and runs requests to completion.

    The engine's asyncio client runs on a private event loop thread, so this class works from
    plain synchronous code (scripts, notebooks, tests).
    """

    def __init__(self, model: str = "default", **engine_args) -> None:
        # Settings checked, a named model prepared on first use, a directory checked
        # (ModelConfigError), before any process starts.
        self.config = model_store.ensure_config(EngineConfig(model=model, **engine_args))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        self._closed = False
        self.client = self._run(self._make_client())
        # Ctrl-C or the end of a script must still stop the engine processes cleanly.
        atexit.register(self.shutdown)

    async def _make_client(self) -> AsyncEngineClient:
        client = AsyncEngineClient(self.config)
        await client.start()
        return client

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for each prompt (text or token ids); results in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        reqs = []
        for i, prompt in enumerate(prompts):
            p = check_params(params[i] if isinstance(params, Sequence)
                             else (params or SamplingParams()))
            rid = f"offline-{next(self._ids)}"
            if isinstance(prompt, str):
                reqs.append(GenerateRequest(rid, p, prompt=prompt))
            else:
                reqs.append(GenerateRequest(rid, p, prompt_token_ids=pack_ids(prompt)))
        return self._run(self._gather(reqs))

    def chat(
        self, messages: list[dict[str, str]], params: SamplingParams | None = None
    ) -> CompletionOutput:
        msgs = [ChatMessage(m["role"], m["content"]) for m in messages]
        req = GenerateRequest(f"offline-{next(self._ids)}",
                              check_params(params or SamplingParams()), messages=msgs)
        return self._run(self._gather([req]))[0]

    async def _gather(self, reqs: list[GenerateRequest]) -> list[CompletionOutput]:
        return list(await asyncio.gather(*(self._one(r) for r in reqs)))

    async def _one(self, req: GenerateRequest) -> CompletionOutput:
        text, ids, logprobs, prompt_logprobs = [], [], [], []
        last = None
        async for out in self.client.generate(req):
            if out.error:
                raise ValueError(out.error)
            text.append(out.text)
            ids.extend(unpack_ids(out.token_ids).tolist())
            logprobs.extend(out.logprobs)
            prompt_logprobs = out.prompt_logprobs or prompt_logprobs
            last = out
        assert last is not None and last.finish_reason is not None
        reason = FinishReason(last.finish_reason).openai()
        return CompletionOutput("".join(text), ids, reason, logprobs,
                                last.prompt_tokens, last.cached_tokens, prompt_logprobs)

    def stats(self):
        return self.client.stats

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(self.client.shutdown(), self._loop)
            fut.result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
