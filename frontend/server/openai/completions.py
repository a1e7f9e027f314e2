"""POST /v1/completions (the legacy text completions endpoint)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from deepinfer.engine.protocol import FinishReason, GenerateRequest, SamplingParams, pack_ids
from deepinfer.frontend.server.common.generation import Generation, collect, engine_error, seeded
from deepinfer.frontend.server.common.kv_transfer import apply_kv_transfer, response_params
from deepinfer.frontend.server.common.openai_schema import CompletionRequest, decode_completion
from deepinfer.frontend.server.common.prompts import completion_prompts
from deepinfer.frontend.server.common.sampling import completion_params
from deepinfer.frontend.server.common.structured import grammar_spec
from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.http_io import (
    SSE_DONE,
    SSEResponse,
    read_json,
    run_until_disconnect,
    sse_event,
)
from deepinfer.frontend.server.openai.logprobs import (
    completion_logprobs,
    echo_logprobs,
    joined,
    prompt_logprobs_out,
)
from deepinfer.frontend.server.openai.objects import Completion, CompletionChoice
from deepinfer.frontend.server.state import ServerState

_encode = msgspec.json.Encoder().encode


def _engine_requests(
    rid: str, prompts: list[str | list[int]], params: SamplingParams, n: int
) -> list[GenerateRequest]:
    """Choice index p * n + j is prompt p's j-th sample."""
    out = []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            sub, sp = f"{rid}-{p * n + j}", seeded(params, j)
            if isinstance(prompt, str):
                out.append(GenerateRequest(sub, sp, prompt=prompt))
            else:
                out.append(GenerateRequest(sub, sp, prompt_token_ids=pack_ids(prompt)))
    return out


async def create_completion(state: ServerState, request: Request) -> Response | SSEResponse:
    req = await read_json(request, decode_completion)
    lora = state.check_model(req.model)
    params = completion_params(req, state.context_len,
                               grammar_spec(req, state.grammar_max_bytes))
    params = msgspec.structs.replace(params, lora=lora)
    prompts = completion_prompts(req)
    n = req.n or 1
    params = apply_kv_transfer(request, req.kv_transfer_params, params, state,
                               n * len(prompts), bool(req.stream))
    rid = f"cmpl-{uuid.uuid4().hex}"
    gen = Generation(state, "completions", _engine_requests(rid, prompts, params, n), "prompt")
    try:
        firsts = await gen.first_outputs()
    except BaseException:
        await gen.close()
        raise
    echoes = [(f.prompt_text or "") if req.echo else "" for f in firsts]
    created = int(time.time())
    if req.stream:
        return SSEResponse(_events(gen, req, rid, created, lora or state.model_name, echoes, n))
    results = await run_until_disconnect(request, collect(gen))
    if results is None:
        return Response(status_code=499)
    choices = []
    for i, r in enumerate(results):
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(r.logprobs, offset=len(echoes[i]))
            if req.echo:
                logprobs = joined(echo_logprobs(r.prompt_logprobs, req.logprobs), logprobs)
        choice = CompletionChoice(i, echoes[i] + "".join(r.text), logprobs, r.finish_reason)
        if req.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs_out(r.prompt_logprobs, req.prompt_logprobs)
        choices.append(choice)
    out = Completion(rid, created, lora or state.model_name, choices, usage=gen.usage(n),
                     kv_transfer_params=response_params(results[0].kv_transfer, state))
    return Response(_encode(out), media_type="application/json")


async def _events(
    gen: Generation, req: CompletionRequest, rid: str, created: int, model: str,
    echoes: list[str], n: int,
) -> AsyncGenerator[bytes, None]:
    def chunk(choices: list[CompletionChoice], **kw) -> bytes:
        return sse_event(_encode(Completion(rid, created, model, choices, **kw)))

    offsets = [len(e) for e in echoes]
    # An echo with logprobs waits for the prompt's logprobs (they come with the first token).
    echo_later = req.echo and req.logprobs is not None
    try:
        for i, echo in enumerate(echoes):
            if echo and not echo_later:
                yield chunk([CompletionChoice(i, echo, None, None)])
        async for i, out in gen:
            if out.finish_reason == FinishReason.ERROR:
                raise engine_error(gen.state, out.error or "request failed", gen.param)
            if echo_later and out.prompt_logprobs:
                yield chunk([CompletionChoice(i, echoes[i], echo_logprobs(
                    out.prompt_logprobs, req.logprobs or 0), None)])
            if not (out.text or out.logprobs or out.finish_reason is not None):
                continue
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(out.logprobs, offset=offsets[i])
            offsets[i] += len(out.text)
            finish = FinishReason(out.finish_reason).openai() if out.finish_reason else None
            yield chunk([CompletionChoice(i, out.text, logprobs, finish)])
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage=gen.usage(n))
    except APIError as exc:
        yield sse_event(_encode(exc.body()))
    finally:
        await gen.close()
    yield SSE_DONE
