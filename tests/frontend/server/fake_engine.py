"""An in-process stand-in for AsyncEngineClient (words in, numbered words out) and helpers."""

from __future__ import annotations

import asyncio
import json

from deepinfer.engine.protocol import (
    FinishReason,
    GenerateRequest,
    LoRAUpdate,
    LoRAUpdated,
    PositionLogprobs,
    RequestOutput,
    SchedulerStats,
    TokenLogprob,
    pack_ids,
)


class FakeEngineClient:
    """Each prompt word is a token; output token k is the text " w{k}" (id 100 + k)."""

    def __init__(self, model_name: str = "fake-model", context_len: int = 64,
                 delay: float = 0.0) -> None:
        self.model_name = model_name
        self.context_len = context_len
        self.delay = delay
        self.stats = SchedulerStats(kv_blocks_total=100, kv_blocks_free=100)
        self.dead_reason: str | None = None
        self.started = False
        self.stopped = False
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.on_failure = None
        self.script: list[str] | None = None  # output pieces instead of " w0 w1 ..."
        self.lora_updates: list[LoRAUpdate] = []
        self.lora_load_seconds: dict[str, float] = {}

    async def update_lora(self, update: LoRAUpdate) -> LoRAUpdated:
        """Loads of a path under "bad" are refused; every update is kept in `lora_updates`."""
        self.lora_updates.append(update)
        if "bad" in update.path:
            return LoRAUpdated(update.request_id, f"{update.path}: not a PEFT LoRA adapter")
        return LoRAUpdated(update.request_id, seconds=0.02)

    @property
    def healthy(self) -> bool:
        return self.started and self.dead_reason is None

    async def start(self, on_failure=None) -> None:
        self.on_failure = on_failure
        self.started = True

    async def shutdown(self) -> None:
        self.stopped = True

    def fail(self, reason: str) -> None:
        self.dead_reason = reason
        if self.on_failure is not None:
            self.on_failure(reason)

    @staticmethod
    def prompt_text(req: GenerateRequest) -> str:
        if req.messages is not None:
            return " ".join(m.content for m in req.messages)
        if req.prompt is not None:
            return req.prompt
        return " ".join("t" for _ in range(len(req.prompt_token_ids or b"") // 4))

    async def generate(self, req: GenerateRequest):
        if self.dead_reason is not None:
            raise RuntimeError(self.dead_reason)
        self.requests.append(req)
        rid = req.request_id
        text = self.prompt_text(req)
        n_prompt = len(text.split())
        if n_prompt == 0 or n_prompt >= self.context_len:
            error = "the prompt is empty" if n_prompt == 0 else (
                f"the prompt has {n_prompt} tokens; this model's context length is "
                f"{self.context_len} tokens")
            yield RequestOutput(rid, finish_reason=FinishReason.ERROR, error=error)
            return
        finished = False
        try:
            yield RequestOutput(rid, prompt_tokens=n_prompt, prompt_text=text)
            p = req.params
            n_out = min(p.max_tokens, self.context_len - n_prompt,
                        len(self.script) if self.script is not None else p.max_tokens)
            for k in range(n_out):
                await asyncio.sleep(self.delay)
                if self.dead_reason is not None:
                    yield RequestOutput(rid, finish_reason=FinishReason.ERROR,
                                        error=f"engine failed: {self.dead_reason}")
                    return
                piece = self.script[k] if self.script is not None else f" w{k}"
                lps = []
                if p.logprobs is not None:
                    top = [TokenLogprob(200 + j, f" alt{j}", -1.0 - j) for j in range(p.logprobs)]
                    lps = [PositionLogprobs(TokenLogprob(100 + k, piece, -0.5), top)]
                stop = piece.strip() in p.stop
                last = stop or k == n_out - 1
                reason = (FinishReason.STOP if stop else FinishReason.LENGTH) if last else None
                yield RequestOutput(
                    rid, text="" if stop else piece, token_ids=pack_ids([100 + k]),
                    logprobs=lps, finish_reason=reason, prompt_tokens=n_prompt,
                    completion_tokens=k + 1,
                )
                if last:
                    break
            finished = True
        finally:
            if not finished:
                self.aborted.append(rid)


MODEL = "fake-model"


def chat(http, **body):
    body.setdefault("model", MODEL)
    body.setdefault("messages", [{"role": "user", "content": "hello there"}])
    return http.post("/v1/chat/completions", json=body)


def sse(response) -> list:
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]
