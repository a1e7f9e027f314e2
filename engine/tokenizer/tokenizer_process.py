"""The tokenizer actor: requests in (text or chat), token ids out; tokens in, text deltas out.

It keeps the API process thin (no tokenization there) and the scheduler free of strings. Stop
strings are matched here; a match finishes the request and aborts it in the scheduler.

A long prompt's text is tokenized on a thread of its own, with the GIL released, while the loop
goes on turning every stream's tokens into text (it used to wait: one 7 MiB prompt held every
stream for 34 s); short ones, the most, are tokenized in place (a thread's hand-off would cost
them more than it saves).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import zmq

from deepinfer.engine.protocol import (
    Abort,
    FinishReason,
    GenerateRequest,
    LoRAUpdate,
    LoRAUpdated,
    OutputBatch,
    PositionLogprobs,
    RequestOutput,
    TokenDelta,
    TokenizedRequest,
    TokenizerInbound,
    TokenLogprob,
    pack_ids,
    unpack_ids,
)
from deepinfer.engine.runtime.ipc import pull, push
from deepinfer.engine.runtime.process_entry import ChildContext
from deepinfer.engine.tokenizer.detokenizer import IncrementalDetokenizer
from deepinfer.engine.tokenizer.prompt_logprobs import prompt_logprob_list
from deepinfer.engine.tokenizer.tokenizer import ChatTemplateError, Tokenizer, chat_dict

log = logging.getLogger("deepinfer.tokenizer")



class _Live(msgspec.Struct):
    detok: IncrementalDetokenizer
    logprobs: bool
    prompt_tokens: int
    completion_tokens: int = 0
    # The prompt, while its prompt logprobs (when asked) are still to go out.
    prompt_ids: list[int] | None = None


# The scheduler's request (None: not for it) and the first client output (None: held).
Admission = tuple[TokenizedRequest | None, RequestOutput | None]
# Longer prompt texts are tokenized off the loop (~1 us a character: this is ~16 ms).
INLINE_PROMPT_CHARS = 16_384
PENDING_POLL_MS = 2  # how often the loop looks for a finished long tokenization


@dataclass(frozen=True)
class PromptText:
    """A prompt rendered and checked, its text not tokenized yet."""

    text: str
    add_special_tokens: bool


class TokenizerService:
    """Pure logic of the actor (no sockets), so tests can drive it directly."""

    def __init__(self, tokenizer: Tokenizer, context_len: int,
                 model_vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len
        # Ids the model can embed: the smaller of the tokenizer's and the model's vocabulary.
        self.vocab_limit = min(tokenizer.vocab_size, model_vocab_size or tokenizer.vocab_size)
        self.live: dict[str, _Live] = {}
        # First outputs of structured requests, held until the scheduler says their grammar
        # compiled: a refused grammar must reach the client as the first output (a 400).
        self.held: dict[str, RequestOutput] = {}

    def tokenize(self, req: GenerateRequest) -> Admission:
        """Returns the scheduler's request (None when rejected) and the first client output
        (None: held until the request's grammar is ready)."""
        started = self.start(req)
        if isinstance(started, PromptText):
            try:
                ids = self.tokenizer.encode(started.text, started.add_special_tokens)
            except Exception as exc:  # noqa: BLE001 - bad text must not kill the process
                return self.refuse(req, exc)
            return self.admit(req, started.text, ids)
        return started

    def start(self, req: GenerateRequest) -> Admission | PromptText:
        """Everything before tokenizing the prompt's text (rendering, checks); short texts are
        tokenized at once. A PromptText is left for `admit` once its ids are known."""
        try:
            if req.messages is not None:
                if not req.messages:
                    raise ValueError("messages must not be empty")
                text = self._within_reach(self.tokenizer.apply_chat_template(
                    [chat_dict(m) for m in req.messages], req.add_generation_prompt, req.tools,
                    req.template_kwargs, req.continue_final_message))
                # The template already holds every special token it wants.
                return self._text(req, PromptText(text, add_special_tokens=False))
            if req.prompt_token_ids is not None:
                ids = unpack_ids(req.prompt_token_ids).tolist()
                bad = [i for i in ids if not 0 <= i < self.vocab_limit]
                if bad:
                    raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary")
                return self.admit(req, self.tokenizer.decode(ids, skip_special_tokens=False), ids)
            if req.prompt is not None:
                return self._text(req, PromptText(self._within_reach(req.prompt), True))
            raise ValueError("a prompt, prompt token ids or messages are required")
        except Exception as exc:  # noqa: BLE001 - bad input (template, ids, text) must not
            return self.refuse(req, exc)  # kill the process

    def _text(self, req: GenerateRequest, prompt: PromptText) -> Admission | PromptText:
        if len(prompt.text) > INLINE_PROMPT_CHARS:
            return prompt
        return self.admit(req, prompt.text,
                          self.tokenizer.encode(prompt.text, prompt.add_special_tokens))

    def refuse(self, req: GenerateRequest, exc: Exception) -> Admission:
        if not isinstance(exc, (ValueError, ChatTemplateError)):
            exc = ValueError(f"could not tokenize the request: {type(exc).__name__}: {exc}")
        return None, RequestOutput(req.request_id, finish_reason=FinishReason.ERROR,
                                   error=str(exc))

    def admit(self, req: GenerateRequest, prompt_text: str | None, ids: list[int]) -> Admission:
        """The request with its prompt's ids: refused, counted (count_only) or live."""
        if not ids:
            return self.refuse(req, ValueError("the prompt is empty"))
        if req.count_only:
            return None, RequestOutput(req.request_id, finish_reason=FinishReason.STOP,
                                       prompt_tokens=len(ids))
        if len(ids) >= self.context_len:
            return self.refuse(req, ValueError(
                f"the prompt has {len(ids)} tokens; this server's context length (the "
                f"model's, capped by its KV cache) is {self.context_len} tokens, which must "
                "also leave room for the output"))
        p = req.params
        self.live[req.request_id] = _Live(
            IncrementalDetokenizer(self.tokenizer, p.stop, p.skip_special_tokens, ids),
            logprobs=p.logprobs is not None,
            prompt_tokens=len(ids),
            prompt_ids=list(ids) if p.prompt_logprobs is not None else None,
        )
        first = RequestOutput(req.request_id, prompt_tokens=len(ids), prompt_text=prompt_text)
        tokenized = TokenizedRequest(req.request_id, pack_ids(ids), p)
        if p.grammar is not None:
            self.held[req.request_id] = first
            return tokenized, None
        return tokenized, first

    def _within_reach(self, text: str) -> str:
        """`text`, unless it is too long for the context whatever its tokens: then it is
        refused untokenized, since every stream's detokenization waits behind a tokenization
        (a 7 MiB prompt held them all for 34 s). Half the bound of n / max_token_chars
        tokens, for normalizers that compose characters."""
        floor = len(text) // (2 * self.tokenizer.max_token_chars)
        if floor >= self.context_len:
            raise ValueError(
                f"the prompt has at least {floor} tokens; this server's context length is "
                f"{self.context_len} tokens (it was not tokenized)")
        return text

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.live.pop(rid, None)
            self.held.pop(rid, None)

    def outputs(self, delta: TokenDelta) -> tuple[list[RequestOutput], bool]:
        """The client outputs for one delta (a held first output goes out before the delta's
        own, unless the delta refuses the request); the bool says the scheduler must abort it
        (stop string hit)."""
        held = self.held.pop(delta.request_id, None)
        if held is not None and delta.finish_reason != FinishReason.ERROR:
            if not len(delta.token_ids) and delta.finish_reason is None:
                return [held], False  # the grammar is ready: nothing else to say yet
            out, stop_hit = self.detokenize(delta)
            return [held] + ([out] if out is not None else []), stop_hit
        out, stop_hit = self.detokenize(delta)
        return ([out] if out is not None else []), stop_hit

    def detokenize(self, delta: TokenDelta) -> tuple[RequestOutput | None, bool]:
        """Text for one delta; the bool says the scheduler must abort it (stop string hit)."""
        live = self.live.get(delta.request_id)
        if live is None:  # aborted meanwhile
            return None, False
        ids = unpack_ids(delta.token_ids)
        n_before = live.completion_tokens
        # The token that stopped the output (EOS, a stop token id: the scheduler's STOP) is
        # counted but not written: kept special tokens would show it (`<|im_end|>`), as vLLM.
        stop_token = delta.finish_reason == FinishReason.STOP and len(ids) > 0
        text_ids = ids[:-1] if stop_token else ids
        used = live.detok.add(text_ids)
        if used == len(text_ids):
            used = len(ids)
        ids = ids[:used]  # tokens after a stop string are dropped, their logprobs too
        live.completion_tokens += len(ids)
        finish = delta.finish_reason
        stop_hit = live.detok.stopped and finish is None
        kv_transfer = delta.kv_transfer
        if kv_transfer is not None and live.detok.stopped:
            # A stop string ended it for good: no decode server continues it, and the scheduler
            # frees the KV it held for one.
            kv_transfer, stop_hit = None, True
        if live.detok.stopped:
            finish = FinishReason.STOP
        text = live.detok.take(final=finish is not None)
        logprobs = []
        if live.logprobs and delta.logprobs:
            tt = self.tokenizer.token_text
            for lp in delta.logprobs[:used]:
                logprobs.append(PositionLogprobs(
                    TokenLogprob(lp.token_id, tt(lp.token_id), lp.logprob),
                    [TokenLogprob(i, tt(i), v) for i, v in zip(lp.top_ids, lp.top_logprobs)],
                ))
        out = RequestOutput(
            delta.request_id,
            text=text,
            token_ids=ids.tobytes(),
            logprobs=logprobs,
            finish_reason=finish,
            prompt_tokens=live.prompt_tokens,
            completion_tokens=n_before + len(ids),
            cached_tokens=delta.cached_tokens,
            error=delta.error,
            replayed_tokens=delta.replayed_tokens,
            kv_transfer=kv_transfer,
            stop_reason=live.detok.stop_string,
        )
        if live.prompt_ids is not None and (len(ids) or finish is not None):
            # The scheduler sends them all on the first delta with a token or a finish.
            out.prompt_logprobs = prompt_logprob_list(live.prompt_ids, delta.prompt_logprobs,
                                                      self.tokenizer.token_text)
            live.prompt_ids = None
        if finish is not None:
            del self.live[delta.request_id]
        return out, stop_hit


class TokenizerLoop:
    """The actor's loop over its sockets: drain what arrived, answer once. Long prompts'
    texts go to a tokenizing thread (`pending`); their requests are admitted when it is done,
    unless aborted meanwhile."""

    def __init__(self, service: TokenizerService, inbound: zmq.Socket, to_client: zmq.Socket,
                 to_scheduler: zmq.Socket) -> None:
        self.service = service
        self.inbound, self.to_client, self.to_scheduler = inbound, to_client, to_scheduler
        self.decode = msgspec.msgpack.Decoder(TokenizerInbound).decode
        self.encode = msgspec.msgpack.Encoder().encode
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.pending: dict[str, tuple[GenerateRequest, PromptText, Future[list[int]]]] = {}
        self.detokenize_seconds = 0.0

    def step(self, wait_ms: int | None = None) -> None:
        """Wait for messages (`wait_ms`; None: until one comes, or a few ms while a long prompt
        is being tokenized), handle them and every finished tokenization, answer once."""
        if wait_ms is None and self.pending:
            wait_ms = PENDING_POLL_MS
        msgs = []
        if self.inbound.poll(wait_ms):
            while self.inbound.poll(0):
                msgs.append(self.decode(self.inbound.recv(zmq.NOBLOCK)))
        outputs: list[RequestOutput] = []
        lora_updates: list[LoRAUpdated] = []
        stats = None
        for msg in msgs:
            if isinstance(msg, GenerateRequest):
                started = self.service.start(msg)
                if isinstance(started, PromptText):
                    self.pending[msg.request_id] = (msg, started, self.reader.submit(
                        self.service.tokenizer.encode_releasing_gil, started.text,
                        started.add_special_tokens))
                else:
                    self._admitted(started, outputs)
            elif isinstance(msg, Abort):
                for rid in msg.request_ids:
                    self.pending.pop(rid, None)  # its tokens, when they come, go nowhere
                self.service.abort(msg.request_ids)
                self.to_scheduler.send(self.encode(msg))
            elif isinstance(msg, LoRAUpdate):  # the scheduler's to check and answer
                self.to_scheduler.send(self.encode(msg))
            else:
                stats = msg.stats or stats
                lora_updates.extend(msg.lora_updates)
                self._detokenize(msg.deltas, outputs)
        self._tokenized(outputs)
        if stats is not None:
            stats.detokenize_seconds = self.detokenize_seconds
        if outputs or stats is not None or lora_updates:
            self.to_client.send(self.encode(OutputBatch(outputs, stats, lora_updates)))

    def _admitted(self, admission: Admission, outputs: list[RequestOutput]) -> None:
        tokenized, first = admission
        if first is not None:
            outputs.append(first)
        if tokenized is not None:
            self.to_scheduler.send(self.encode(tokenized))

    def _tokenized(self, outputs: list[RequestOutput]) -> None:
        for rid, (req, prompt, ids) in list(self.pending.items()):
            if ids.done():
                del self.pending[rid]
                try:
                    admission = self.service.admit(req, prompt.text, ids.result())
                except Exception as exc:  # noqa: BLE001 - bad text must not kill the process
                    admission = self.service.refuse(req, exc)
                self._admitted(admission, outputs)

    def _detokenize(self, deltas: list[TokenDelta], outputs: list[RequestOutput]) -> None:
        t0 = time.perf_counter()
        stopped = []
        for delta in deltas:
            outs, stop_hit = self.service.outputs(delta)
            outputs.extend(outs)
            if stop_hit:
                stopped.append(delta.request_id)
        if stopped:  # a normal finish for the scheduler: its KV is worth caching
            self.to_scheduler.send(self.encode(Abort(stopped, FinishReason.STOP)))
        self.detokenize_seconds += time.perf_counter() - t0


def main(ctx: ChildContext) -> None:
    cfg = ctx.config
    service = TokenizerService(Tokenizer(cfg.resolved_model_dir()), cfg.context_len(),
                               cfg.model_config().vocab_size)
    loop = TokenizerLoop(service, pull(ctx.zmq, ctx.endpoints.tokenizer_in),
                         push(ctx.zmq, ctx.endpoints.client_in),
                         push(ctx.zmq, ctx.endpoints.scheduler_in))
    ctx.ready(context_len=str(cfg.context_len()), vocab_size=str(service.tokenizer.vocab_size))
    while True:
        loop.step()
