"""One streamed request of the serving benchmark, timed chunk by chunk (aiohttp)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from deepinfer.frontend.bench.datasets import BenchRequest


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # time.perf_counter() when it was sent


def payload(endpoint: str, model: str, req: BenchRequest, temperature: float,
            ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": temperature,
        "stream": True,
    }
    if endpoint.endswith("/messages"):  # Anthropic's API: no usage option, no ignore_eos
        body["messages"] = [{"role": "user", "content": req.prompt}]
        return body
    body["stream_options"] = {"include_usage": True}
    if ignore_eos and req.ignore_eos:
        body["ignore_eos"] = True
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_text(obj: dict[str, Any]) -> str:
    """The text an event adds: content or reasoning, OpenAI's or Anthropic's shapes."""
    if obj.get("type") == "content_block_delta":
        delta = obj.get("delta") or {}
        return delta.get("text") or delta.get("thinking") or ""
    choices = obj.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice["delta"]
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


def _usage(obj: dict[str, Any]) -> tuple[int, int]:
    """(prompt, output) tokens an event reports, 0 where it says nothing."""
    if obj.get("type") == "message_start":
        usage = (obj.get("message") or {}).get("usage") or {}
        return usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0), 0
    usage = obj.get("usage") or {}
    if obj.get("type") == "message_delta":
        return 0, usage.get("output_tokens", 0)
    return usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)


async def send(session, url: str, body: dict[str, Any]) -> RequestResult:
    """POST a streaming request; measure TTFT, inter-token latencies and E2E latency."""
    start = time.perf_counter()
    result = RequestResult(start=start)
    last = start
    chunks = 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    result.error = str(obj["error"].get("message", obj["error"]))
                    return result
                if obj.get("type") == "message_stop":  # Anthropic's stream has no [DONE]
                    break
                now = time.perf_counter()
                if _chunk_text(obj):
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks += 1
                    last = now
                prompt, output = _usage(obj)
                result.prompt_tokens = prompt or result.prompt_tokens
                result.output_tokens = output or result.output_tokens
        result.e2e = time.perf_counter() - start
        if not result.output_tokens:
            result.output_tokens = chunks  # no usage from this server: one chunk ~ one token
        result.ok = True
    except Exception as exc:  # network errors count as failed requests
        result.error = f"{type(exc).__name__}: {exc}"
    return result
